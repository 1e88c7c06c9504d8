"""Load π0.5 weights from a LeRobot / openpi PyTorch `model.safetensors` (never pickle).

Accepted layouts (see ../shared/reference/pi05_architecture.md §2):
- a `model.safetensors` file, or the directory holding one (LeRobot's `pretrained_model/`);
- keys with or without LeRobot's `model.` prefix (a file holding one tensor under both is refused);
- the token embedding stored as `…language_model.embed_tokens.weight`, or only as the tied
  `…paligemma.lm_head.weight` copy (openpi's converter deduplicates tied tensors);
- `…lm_head.weight` tensors, which inference never uses, are accepted and ignored;
- F32, BF16 or F16 tensors (converted to the model's dtype); any other dtype is refused.
Missing, mis-shaped and unexpected tensors are reported together in one `CheckpointError` (counts and the
first few keys of each), with a hint when the file looks like a π0 checkpoint. A `config.json` beside
the file (LeRobot's or openpi's converter's) that records another chunk size, step count or prompt length
than the preset is refused (`check_recorded_config`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeGuard

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from rmuscle_ros.models.config import Pi05Config
from rmuscle_ros.models.pi05 import Pi05Model

# Our module prefix -> the checkpoint's (Hugging Face PaliGemma + Gemma expert) prefix.
KEY_PREFIXES: tuple[tuple[str, str], ...] = (
    ("vision_tower.", "paligemma_with_expert.paligemma.model.vision_tower.vision_model."),
    ("projector.", "paligemma_with_expert.paligemma.model.multi_modal_projector.linear."),
    ("llm.", "paligemma_with_expert.paligemma.model.language_model."),
    ("expert.", "paligemma_with_expert.gemma_expert.model."),
)
log = logging.getLogger(__name__)

LEROBOT_PREFIX = "model."
TIED_EMBEDDING_KEY = "paligemma_with_expert.paligemma.lm_head.weight"
IGNORED_KEYS = frozenset({TIED_EMBEDDING_KEY, "paligemma_with_expert.gemma_expert.lm_head.weight"})
# Older openpi PyTorch exports name the pi05 time MLP like pi0's.
LEGACY_ALIASES = {"time_mlp_in.": "action_time_mlp_in.", "time_mlp_out.": "action_time_mlp_out."}
# Stored dtypes copied into the model as values; int8/bool/FP8 would be cast (an int8 copy came out all
# zeros) or fail deep inside PyTorch, and quantised files need their scales, which this loader does not read.
ACCEPTED_DTYPES = ("F32", "BF16", "F16")
LISTED = 3  # keys named per kind of mismatch in one error
# `config.json` fields beside a checkpoint against what our presets fix: (its field, Pi05Config field, rule).
# "equal": the model was trained on it (the horizon: the action tokens attend to each other, so another
# count changes every action); "at_most": prompts it was trained with must fit (a shorter trained length:
# prompts are cut at it, as training cut them, `trained_prompt_len`); "note": an inference choice, logged
# (the step count).
# LeRobot's names are PI05Config's (lerobot/policies/pi05/configuration_pi05.py, policy type "pi05");
# openpi's PyTorch converter writes {action_dim, action_horizon, paligemma_variant, …} and no "type".
LEROBOT_POLICY_TYPE = "pi05"
LEROBOT_FIXED_FIELDS = (
    ("chunk_size", "horizon", "equal"),
    ("num_inference_steps", "num_steps", "note"),
    ("tokenizer_max_length", "max_token_len", "at_most"),
    # The time embedding's periods condition every denoising step's adaRMS (found in review: not compared,
    # and a checkpoint trained with other periods loaded and ran, its actions off by up to 0.8).
    ("min_period", "time_min_period", "close"),
    ("max_period", "time_max_period", "close"),
)
OPENPI_FIXED_FIELDS = (("action_horizon", "horizon", "equal"), ("max_token_len", "max_token_len", "at_most"))
# π0 stores plain RMSNorm weights in the expert where π0.5 has adaRMS `…_layernorm.dense`, and a state_proj.
PI0_EXPERT_NORM = re.compile(r"gemma_expert\.model\.(layers\.\d+\.\w+_layernorm|norm)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be loaded into the configured model."""


def checkpoint_key(ours: str) -> str:
    """Map one of our parameter names to the checkpoint's name (without the `model.` prefix)."""
    for mine, theirs in KEY_PREFIXES:
        if ours.startswith(mine):
            return theirs + ours[len(mine) :]
    return ours


SHARD = re.compile(r".*-\d+-of-\d+\.safetensors$")


def _checkpoint_file(given: str | os.PathLike[str]) -> Path:
    """The safetensors file `path` names: itself, or `model.safetensors` inside a checkpoint directory. A
    sharded checkpoint (`model-0000k-of-0000n.safetensors` and its `.safetensors.index.json`) is refused
    saying so (found in review: its directory read as "without a model.safetensors", its index as a
    corrupt file, a shard as another architecture)."""
    if not os.fspath(given):  # Path("") is ".": the working directory's weights (found in review)
        raise CheckpointError("checkpoint: an empty path; give a model.safetensors or its directory")
    path = Path(given)
    shards = sorted(path.glob("*.safetensors.index.json")) if path.is_dir() else []
    if shards or path.name.endswith(".safetensors.index.json") or SHARD.fullmatch(path.name):
        folder = path if path.is_dir() else path.parent
        raise CheckpointError(
            f"{folder}: a sharded checkpoint (an index and model-k-of-n.safetensors files); this loader reads one "
            "model.safetensors: merge the shards into one (e.g. load them with safetensors and save_file)"
        )
    if path.is_dir():
        inner = path / "model.safetensors"
        if inner.is_file():
            return inner
        raise CheckpointError(f"{path} is a directory without a model.safetensors; give the file's path")
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    return path


def _not_safetensors(path: Path) -> str | None:
    """What a file safetensors cannot open is instead, judged from its first bytes (never unpickled).

    Asked only after safetensors refused the file: a valid file's 8-byte header length may well begin
    with 0x80 or "PK".
    """
    try:
        with path.open("rb") as f:
            head = f.read(32)
    except OSError:
        return None
    if head.startswith(b"version https://git-lfs"):
        return "is a git-lfs pointer, not the weights; run `git lfs pull` in its repository"
    if len(head) > 8 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 1 << 30:
        return None  # a safetensors header (its length, then JSON): truncated or corrupt, not a pickle
    pickled = (
        "is a pickle file (torch.save's .bin / .pt), not safetensors: a pickle checkpoint is refused; "
        "convert it to safetensors"
    )
    if head.startswith(b"PK\x03\x04"):
        # torch.save's zip archive holds a data.pkl; any other zip (an .npz) is not a pickle (review). The
        # names are read from the archive's directory: nothing is unpickled.
        import zipfile

        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (OSError, zipfile.BadZipFile):
            names = []
        if any(n == "data.pkl" or n.endswith("/data.pkl") for n in names):
            return pickled
        return "is a zip archive (an .npz?), not safetensors; convert it to safetensors"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return pickled  # a bare pickle (its PROTO opcode and protocol 2 to 5)
    return None


def _listed(what: str, items: list[str]) -> str:
    """`what` and the first few `items`, with their count when there are several: one error, every kind."""
    named = ", ".join(items[:LISTED]) + (", …" if len(items) > LISTED else "")
    return f"{what} {named}" + (f" ({len(items)} in all)" if len(items) > 1 else "")


class _Reader:
    """Read-only view of a safetensors file with the LeRobot prefix stripped."""

    def __init__(self, path: Path) -> None:
        try:
            self._file = safe_open(str(path), framework="pt")
            raw_keys = list(self._file.keys())
        except (SafetensorError, OSError, ValueError) as e:
            other = _not_safetensors(path)
            if other is not None:
                raise CheckpointError(f"{path} {other}") from e
            raise CheckpointError(
                f"{path} is not a readable safetensors file (corrupt or truncated?): {e}"
            ) from e
        self.path = path
        self._names: dict[str, str] = {}
        duplicates: list[str] = []
        for raw in sorted(raw_keys):
            name = raw.removeprefix(LEROBOT_PREFIX)
            if name in self._names:
                duplicates.append(f"{self._names[name]!r} and {raw!r}")
            self._names[name] = raw
        if duplicates:
            raise CheckpointError(
                f"{path}: {_listed('tensor stored twice:', duplicates)}; with and without LeRobot's "
                f"{LEROBOT_PREFIX!r} prefix, which copy is meant is unknown"
            )

    @property
    def names(self) -> set[str]:
        return set(self._names)

    def check_saved_config(self, cfg: Pi05Config) -> bool:
        """A checkpoint `save_checkpoint` wrote records its model's config in the file's metadata: a field
        that changes no tensor's shape (the horizon, RoPE's base, the time embedding's periods) and differs
        from `cfg` would run the weights as they were not trained, so it is refused, naming each field (found
        in review: never compared). The step count is an inference choice and a shorter prompt length fits
        (as `check_recorded_config` rules); fields the record lacks (an earlier build's) are not compared.
        Returns whether the file records a config."""
        recorded = self.saved_config()
        if recorded is None:
            return False

        def flat(d: dict, prefix: str = "") -> dict[str, object]:
            out: dict[str, object] = {}
            for k, v in d.items():
                out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
            return out

        ours, theirs = flat(cfg.to_dict()), flat(recorded)
        rules = {field: rule for _, field, rule in LEROBOT_FIXED_FIELDS}  # the others: "equal"
        differ = [
            f"{name} {theirs[name]!r} (this model: {ours[name]!r})"
            for name in sorted(set(ours) & set(theirs))
            if _json_value(theirs[name]) != _json_value(ours[name])
            and not _fits(rules.get(name, "equal"), theirs[name], ours[name])
        ]
        if differ:
            raise CheckpointError(
                f"{self.path}: saved from a model of another config: {_listed('', differ).strip()}; load it "
                "with the preset it was saved from"
            )
        return True

    def saved_config(self) -> dict | None:
        """The model config `save_checkpoint` recorded in the file's metadata (None: not one of ours)."""
        try:
            recorded = json.loads((self._file.metadata() or {}).get("rmuscle_ros_config", "null"))
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{self.path}: its recorded model config is not JSON: {e}") from None
        return recorded if isinstance(recorded, dict) else None

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._file.get_slice(self._names[key]).get_shape())

    def dtype(self, key: str) -> str:
        """The stored dtype as safetensors names it: "F32", "BF16", "I8", "F8_E4M3", …"""
        return self._file.get_slice(self._names[key]).get_dtype()

    def tensor(self, key: str) -> torch.Tensor:
        try:
            return self._file.get_tensor(self._names[key])
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.path}: tensor {self._names[key]!r} cannot be read: {e}") from e


def _resolve(reader: _Reader, ours: str) -> str | None:
    """The checkpoint key holding our parameter `ours`, or None."""
    key = checkpoint_key(ours)
    if key in reader:
        return key
    if key.endswith("language_model.embed_tokens.weight") and TIED_EMBEDDING_KEY in reader:
        return TIED_EMBEDDING_KEY
    for new, old in LEGACY_ALIASES.items():
        if key.startswith(new) and old + key[len(new) :] in reader:
            return old + key[len(new) :]
    return None


def _architecture_hint(unexpected: list[str]) -> str:
    evidence = [k for k in unexpected if "state_proj" in k][:1] + [
        k for k in unexpected if PI0_EXPERT_NORM.search(k)
    ][:1]
    if not evidence:
        return ""
    return (
        f" (it holds {' and '.join(map(repr, evidence))}: a π0 checkpoint? π0.5 has no state_proj, and its "
        "expert norms are adaRMS `…_layernorm.dense`)"
    )


def _recorded_config(checkpoint: Path) -> tuple[Path, dict, tuple[tuple[str, str, str], ...]] | None:
    """The `config.json` beside a checkpoint file, its fields and the rules they fall under; None without
    one, or for another policy type. CheckpointError if it cannot be read."""
    config_file = checkpoint.parent / "config.json"
    if not config_file.is_file():
        return None
    try:
        recorded = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{config_file} (beside {checkpoint.name}) cannot be read as JSON: {e}") from e
    if not isinstance(recorded, dict):
        return None
    if recorded.get("type") == LEROBOT_POLICY_TYPE:
        return config_file, recorded, LEROBOT_FIXED_FIELDS
    if "type" not in recorded and "action_horizon" in recorded:
        return config_file, recorded, OPENPI_FIXED_FIELDS
    return None


def trained_prompt_len(path: str | os.PathLike[str], cfg: Pi05Config) -> int:
    """The prompt length (tokens) the checkpoint at `path` was trained with, from its `config.json`, where
    shorter than the preset's `max_token_len` (which it is otherwise). Training cut longer prompts there
    (LeRobot's tokenizer truncates at tokenizer_max_length), so running them uncut would show the model
    tokens and positions it never saw (found in review: a 94-token prompt ran whole against a trained 48).
    A shorter length `save_checkpoint` recorded in the file's metadata cuts them too; the shortest wins
    (found in review: only `config.json`'s did, the metadata's was accepted and not applied)."""
    file = _checkpoint_file(path)
    lengths = [cfg.max_token_len]
    found = _recorded_config(file)
    if found is not None:
        _, recorded, fields = found
        lengths += [recorded.get(theirs) for theirs, ours, _rule in fields if ours == "max_token_len"]
    lengths.append((_Reader(file).saved_config() or {}).get("max_token_len"))
    return min(int(n) for n in lengths if _is_count(n))


def check_relative_actions(path: str | os.PathLike[str], delta_actions: bool) -> None:
    """Refuse a LeRobot checkpoint whose `config.json` records `use_relative_actions` (LeRobot ≥ 0.5.1:
    the joints predicted as offsets from the state) other than the policy runs it (`delta_actions` set or
    not; the node's `delta_joint_actions`). Found in review: a relative checkpoint loaded and ran absolute,
    its "stay where you are" offsets commanded as joint positions near 0. Not recorded: not checked."""
    found = _recorded_config(_checkpoint_file(path))
    if found is None or found[2] is not LEROBOT_FIXED_FIELDS:
        return
    config_file, recorded, _ = found
    relative = recorded.get("use_relative_actions")
    if not isinstance(relative, bool) or relative == delta_actions:
        return
    if relative:
        raise CheckpointError(
            f"{config_file}: the policy was trained with use_relative_actions true (joints predicted as "
            "offsets from the state), and this policy runs its actions as absolute joint positions; set "
            "delta_joint_actions: true (the node; PolicyConfig.delta_actions)"
        )
    raise CheckpointError(
        f"{config_file}: the policy was trained with use_relative_actions false (absolute joint positions), "
        "and this policy adds the state to its actions as offsets; set delta_joint_actions: false (the node; "
        "PolicyConfig.delta_actions empty)"
    )


def _json_value(value: object) -> object:
    """A config value as JSON holds it (tuples as lists), for comparing a recorded config with a live one."""
    return json.loads(json.dumps(value))


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _fits(rule: str, recorded: object, fixed: object) -> bool:
    """Whether a recorded value other than the model's is accepted under its FIXED_FIELDS rule ("close":
    the same number but for float rounding)."""
    return (
        rule == "note"
        or (rule == "at_most" and _is_count(recorded) and _is_count(fixed) and recorded <= fixed)
        or (rule == "close" and _close(recorded, fixed))
    )


def _close(a: object, b: object) -> bool:
    if (
        isinstance(a, bool)
        or isinstance(b, bool)
        or not isinstance(a, int | float)
        or not isinstance(b, int | float)
    ):
        return False
    return math.isclose(a, b, rel_tol=1e-9)


def check_recorded_config(checkpoint: Path, cfg: Pi05Config) -> bool:
    """Refuse a checkpoint whose `config.json` records another horizon, or a longer prompt, than the preset
    runs; log another step count (FIXED_FIELDS' rules).

    These change no tensor's shape, so the weights alone cannot tell: a fine-tune trained with `chunk_size`
    10 would run silently at the preset's 50. Read from a `config.json` in the checkpoint file's directory:
    LeRobot's (`"type": "pi05"`: chunk_size, num_inference_steps, tokenizer_max_length) or openpi's
    converter's (no "type"; action_horizon, max_token_len). Only the fields it holds are checked; no
    `config.json`, another policy type or a missing field means no check. Returns whether one was read.
    """
    found = _recorded_config(checkpoint)
    if found is None:
        return False
    config_file, recorded, fields = found
    for theirs, ours, rule in fields:
        if theirs not in recorded or recorded[theirs] == getattr(cfg, ours):
            continue
        value, fixed = recorded[theirs], getattr(cfg, ours)
        if _fits(rule, value, fixed):
            cut = "; prompts are cut at the recorded length, as in training" if rule == "at_most" else ""
            log.info(
                "%s: recorded %s %r; this model runs %s = %r%s", config_file, theirs, value, ours, fixed, cut
            )
            continue
        raise CheckpointError(
            f"{config_file}: the policy was trained with {theirs} {value!r}, the model preset fixes {ours} = "
            f"{fixed!r}; no preset here runs this checkpoint as it was trained"
        )
    return True


def load_state(model: Pi05Model, path: str | os.PathLike[str]) -> None:
    """Copy every parameter of `model` from the checkpoint at `path`, converting dtype, checking shapes.

    `path` is a `model.safetensors` or the directory holding it. Nothing is copied unless the whole file
    fits: every mismatch is reported at once, then dtypes are checked, then values (NaN/Inf).
    """
    file = _checkpoint_file(path)
    recorded = check_recorded_config(file, model.cfg)
    reader = _Reader(file)
    if not reader.check_saved_config(model.cfg) and not recorded:
        # openpi's PyTorch training writes no config.json (found in review): a fine-tune of another horizon
        # (pi05_libero's 10, pi05_droid's 15) then runs at the preset's without a word
        log.warning(
            "%s records no config (no config.json beside it, none in its metadata): the horizon (%d), prompt "
            "length (%d) and time embedding it was trained with cannot be checked against the preset's; put "
            'its config.json beside it (openpi: {"action_horizon": N, "max_token_len": M})',
            file, model.cfg.horizon, model.cfg.max_token_len,
        )  # fmt: skip
    params = dict(model.named_parameters())
    plan: dict[str, str] = {}
    missing: list[str] = []
    misshaped: list[str] = []
    for name, param in params.items():
        key = _resolve(reader, name)
        if key is None:
            missing.append(repr(checkpoint_key(name)))
            continue
        if reader.shape(key) != tuple(param.shape):
            misshaped.append(
                f"{key!r} has shape {list(reader.shape(key))}, the model expects {list(param.shape)}"
            )
        plan[name] = key
    unexpected = sorted(reader.names - set(plan.values()) - IGNORED_KEYS)
    if missing or misshaped or unexpected:
        parts = []
        if missing:
            parts.append(_listed("missing tensor", missing))
        if misshaped:
            parts.append(
                f"{_listed('mis-shaped tensor', misshaped)} "
                "(is the model config, preset/dims, right for this checkpoint?)"
            )
        if unexpected:
            parts.append(_listed("unexpected tensor", [repr(k) for k in unexpected]))
        raise CheckpointError(
            f"{file} does not fit the model{_architecture_hint(unexpected)}: {'; '.join(parts)}; "
            "refusing a checkpoint of another architecture or size"
        )
    bad_dtypes = [
        f"{key!r} is {reader.dtype(key)}" for key in plan.values() if reader.dtype(key) not in ACCEPTED_DTYPES
    ]
    if bad_dtypes:
        raise CheckpointError(
            f"{file}: {_listed('tensor of a dtype the loader does not convert:', bad_dtypes)}; "
            f"accepted: {', '.join(ACCEPTED_DTYPES)} (a quantised checkpoint needs its dequantised export)"
        )
    with torch.no_grad():
        for name, key in plan.items():
            tensor = reader.tensor(key)
            if not torch.isfinite(tensor).all():
                raise CheckpointError(f"{file}: tensor {key!r} contains NaN or Inf")
            params[name].copy_(tensor)


def iter_checkpoint_tensors(
    model: Pi05Model, prefix: str = LEROBOT_PREFIX
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our parameters under the checkpoint's names (LeRobot layout), e.g. to write test checkpoints."""
    for name, param in model.state_dict().items():
        yield prefix + checkpoint_key(name), param


def save_checkpoint(model: Pi05Model, path: str | os.PathLike[str], *, lerobot_prefix: bool = True) -> None:
    """Write `model` as a `model.safetensors` in the LeRobot/openpi key layout."""
    from safetensors.torch import save_file

    tensors = {
        k: v.detach().contiguous().cpu()
        for k, v in iter_checkpoint_tensors(model, LEROBOT_PREFIX if lerobot_prefix else "")
    }
    save_file(
        tensors, str(path), metadata={"format": "pt", "rmuscle_ros_config": json.dumps(model.cfg.to_dict())}
    )


def init_random_(model: nn.Module, seed: int) -> None:
    """Seeded, non-degenerate random weights: N(0, 1/fan_in) matrices, N(0, 0.1²) vectors.

    Unlike zero-initialised norms and adaRMS layers, this exercises every term (used for `tiny`
    without a checkpoint and for full-size benchmarks, which have no trained weights here).
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            std = 0.1 if param.ndim == 1 else param[0].numel() ** -0.5
            noise = torch.randn(param.shape, generator=gen, device=device, dtype=torch.float32)
            param.copy_(noise * std)


FINGERPRINT_SCHEME = "sha256"  # the prefix of weights_fingerprint's value; earlier builds wrote bare hex
# Bytes of a tensor hashed as one piece. Part of the value: another size keys every library and engine
# anew (a test holds the value; change both with a new scheme, never alone)
FINGERPRINT_CHUNK = 16 << 20
FINGERPRINT_THREADS = 8


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's bytes as stored, in consecutive slices of FINGERPRINT_CHUNK (one, empty, if it has none)."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    return [raw[start : start + FINGERPRINT_CHUNK] for start in range(0, raw.numel(), FINGERPRINT_CHUNK)] or [
        raw
    ]


class _HostCopy(threading.local):
    """A hashing thread's way off the GPU: a pinned buffer and a stream of its own. Pageable copies ran
    one at a time at 1.8 GB/s on the H200's host (7.4 s for `pi05` in float32); pinned, on 8 streams,
    the hashing bounds it (1.4 s; a one-off probe, 2026-12-02). The buffers stay in PyTorch's pinned-memory
    cache: FINGERPRINT_THREADS x FINGERPRINT_CHUNK bytes."""

    buffer: torch.Tensor | None = None
    streams: dict[torch.device, torch.cuda.Stream] | None = None  # one per GPU: a copy runs on its source's


def _piece_digest(piece: torch.Tensor, ready: dict[torch.device, torch.cuda.Event], copy: _HostCopy) -> bytes:
    if piece.device.type != "cuda":
        return hashlib.sha256(piece.numpy()).digest()  # hashlib drops the GIL on large buffers
    if copy.buffer is None or copy.streams is None:
        copy.buffer = torch.empty(FINGERPRINT_CHUNK, dtype=torch.uint8, pin_memory=True)
        copy.streams = {}
    stream = copy.streams.get(piece.device)
    if stream is None:
        stream = copy.streams[piece.device] = torch.cuda.Stream(piece.device)
    host = copy.buffer[: piece.numel()]
    stream.wait_event(ready[piece.device])  # the weights as the caller's stream left them
    with torch.cuda.stream(stream):
        host.copy_(piece, non_blocking=True)
    stream.synchronize()
    return hashlib.sha256(host.numpy()).digest()


def weights_fingerprint(model: nn.Module) -> str:
    """A content hash of every parameter and buffer: name, shape, dtype and every byte.

    Libraries and exported engines key on it, so two checkpoints that differ anywhere (a fine-tune of one
    layer, a few embedding rows) never share either. Each tensor is hashed in 16 MB pieces, the pieces in
    parallel threads (sha256 in hashlib and the copies off the GPU run without the GIL; the 2 GB token
    embedding would otherwise hash alone), then the names, shapes, dtypes and piece digests in order. The
    value is `"sha256:"` and 16 hex digits; earlier builds sampled ~4096 values per tensor and wrote bare
    hex (a library keyed by one is refused saying so: rmuscle_ros.cache.library).
    """
    with torch.no_grad():
        items = sorted(model.state_dict().items())
        pieces = [_pieces(p) for _, p in items]
        flat = [piece for each in pieces for piece in each]
        ready: dict[torch.device, torch.cuda.Event] = {}
        for device in {piece.device for piece in flat if piece.device.type == "cuda"}:
            ready[device] = torch.cuda.Event()
            ready[device].record(torch.cuda.current_stream(device))
        copy = _HostCopy()
        with ThreadPoolExecutor(max_workers=max(1, min(FINGERPRINT_THREADS, os.cpu_count() or 1))) as pool:
            digests = iter(list(pool.map(lambda piece: _piece_digest(piece, ready, copy), flat)))
    h = hashlib.sha256()
    for (name, p), each in zip(items, pieces, strict=True):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:".encode())
        for _ in each:
            h.update(next(digests))
    return f"{FINGERPRINT_SCHEME}:{h.hexdigest()[:16]}"


def load_model(
    cfg: Pi05Config, checkpoint: str | os.PathLike[str] | None = None, *, seed: int = 0, device: str = "cpu"
) -> Pi05Model:
    """Build the model for `cfg`: weights from `checkpoint`, or seeded random weights when it is None.

    The module is built on `device` and allocated once. With a checkpoint it is created without
    initialisation (meta device) and filled from the file. With random weights PyTorch's own
    initialisation runs on `device`, and `init_random_` overwrites it: built on the CPU and then moved,
    the full-size model's took 37-53 s on a 2-core CPU (1-2 threads). (The meta device would skip it, but
    its initialisers import torch._dynamo and Triton, which the CPU path never loads.)
    """
    if checkpoint is None:
        with torch.device(device):
            model = Pi05Model(cfg)
        init_random_(model, seed)
        return model.eval()
    with torch.device("meta"):
        model = Pi05Model(cfg)
    model = model.to_empty(device=device)
    load_state(model, checkpoint)
    return model.eval()
