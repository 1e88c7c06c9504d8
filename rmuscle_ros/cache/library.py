"""The rMuscle reference library on disk: dense episodes the cell has already run.

Layout of a library folder:

    index.json                  versioned header + one entry per episode (file, sha256, calls, bytes, …;
                                meta: the task it ran, which rMuscle serves it to, and its session episode)
    episode_<id>.safetensors    one file per episode, tensors stacked over its calls:
        descriptors   (T, C, D) float32  retrieval descriptor: pooled visual embedding per camera
        images        (T, C, H, W, 3) uint8  the preprocessed observation, to rebuild the VLM states
        tokens        (T, L) int64, token_mask (T, L) bool  the prompt with the discretised state
        action_masks  (T, steps, depth, k) int16  top-ρn expert neurons per (step, layer), if recorded
        image_masks   (T, C) bool  which cameras were present, if recorded (else all)

Guarantees:
- **Keyed by content.** The index records the model's weights fingerprint and shapes; a library from
  other weights is refused with a message saying so (`LibraryMismatch`).
- **Atomic.** Episode files and the index are written to a temporary name, fsynced and renamed, and the
  folder is fsynced after each rename (so the rename itself survives a power cut); the index is replaced
  last, so a crash leaves the previous library intact and never an index naming an episode file the
  disk does not have. A write that fails (a full disk) deletes its partial file and raises
  RecordingFailed, naming the library (and, on a full disk, what makes room); the partial files of a
  writer that died are deleted at the next open, and an episode file the index does not name is
  reported there and kept (its id is never reused).
- **Checked.** Every episode file's sha256 is verified on open; a corrupt or missing episode is reported
  and left out (its file is kept for inspection), never silently used. A corrupt index is an error; it is
  moved aside (not deleted) before a new library is saved in its place.
- **Bounded.** `max_bytes` / `max_episodes`, evicting the least recently used episode of the task that
  holds the most (episodes recorded without a task, which are never served, go first): a job the cell
  runs all day does not evict another job's episodes, only its own oldest. An episode is used when a call
  is served from it (`touch`) or its file is read; that time is kept in the index (written at the next
  add or remove, and at `close`), so it survives a restart. Bounds lowered since the library was recorded
  apply when a writer opens it. An episode larger than `max_bytes` on its own is refused
  (`EpisodeTooLarge`) before anything is written or evicted.
- **One writer** (lock.py, which explains the design). An open library holds a kernel lock (`flock`) on
  its lock file (`.lock`), which the kernel gives up when its process ends, however it ends: nothing stale
  can block a library after a crash, a reboot or a new container. Opening a library another process holds
  is refused (`LibraryBusy`): two nodes given the same folder would each rewrite the index from their own
  memory and drop the other's episodes. A second opener in the same process is refused too, and the command
  line below refuses to remove episodes from a library another process holds. The open marker of earlier
  versions (`.open`) is still written and honoured. An existing folder where the lock file cannot be
  created (a read-only mount) opens read-only: its episodes are served, and `add` / `remove` are refused;
  a folder that does not exist and cannot be created fails the open. An episode file is never written
  over: a second writer's file of the same id is refused.
No pickle: safetensors and JSON only.

On a cell (read-only while the node runs; `remove` once it is cleaned up or stopped):

    python -m rmuscle_ros.cache.library list /var/lib/rmuscle/cell7
    python -m rmuscle_ros.cache.library verify /var/lib/rmuscle/cell7
    python -m rmuscle_ros.cache.library similarity /var/lib/rmuscle/cell7 --threshold 0.8
    python -m rmuscle_ros.cache.library remove /var/lib/rmuscle/cell7 3 7
    python -m rmuscle_ros.cache.library remove /var/lib/rmuscle/cell7 --task "fold the towel"
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

# The one-writer guard (lock.py). Its file names, exceptions and `holder` are re-exported: the node, the
# tests and other modules import them from here.
from rmuscle_ros.cache.lock import LOCK_FILE as LOCK_FILE
from rmuscle_ros.cache.lock import (
    OPEN_MARKER,
    LibraryBusy,
    LibraryError,
    LibraryLock,
    holder,
    marker_draft_alive,
)

log = logging.getLogger(__name__)

LIBRARY_VERSION = 1
REINDEX_HINT = (
    "`python -m rmuscle_ros.cache.library reindex <library>`, with no node holding it, indexes the episode "
    "files an index does not name, setting an unreadable index aside"
)
INDEX = "index.json"
TMP_INFIX = ".tmp-"  # ".<name>.tmp-<pid>": a file being written, renamed to <name> once it is on disk
EPISODE_FILE = re.compile(r"episode_(\d{6,})\.safetensors")
EPISODE_TENSORS = ("descriptors", "images", "tokens", "token_mask")
OPTIONAL_TENSORS = ("action_masks", "image_masks")
# What reading an episode file raises when the file is damaged or gone (EpisodeUnreadable)
READ_ERRORS = (OSError, SafetensorError, KeyError, ValueError)


class LibraryMismatch(LibraryError):
    """A library recorded with other weights or shapes. `fields` names what differs ("weights", or the
    shapes' keys such as "mask_steps"), each with both values in `detail`; `recorded_under` says which of
    the caller's settings those are (`with_settings`), so that a cell knows what to set back.
    `earlier_build`: the library's weights key is of a fingerprint this build no longer computes, so no
    setting serves it (found in review: the message said to set the checkpoint back)."""

    def __init__(
        self,
        path: Path,
        fields: tuple[str, ...],
        detail: str,
        recorded_under: str = "",
        earlier_build: bool = False,
    ) -> None:
        self.path, self.fields, self.detail = path, fields, detail
        self.recorded_under, self.earlier_build = recorded_under, earlier_build
        what = "weights" if fields == ("weights",) else "shapes"
        if earlier_build:
            under = "; no setting serves it, it must be recorded again:"
        elif recorded_under:
            under = f"; it was recorded under other {recorded_under}: set them back to serve it, or"
        else:
            under = ";"
        super().__init__(
            f"{path}: recorded with other {what} than the loaded model ({detail}){under} point library_path "
            "elsewhere or delete it to record a new library"
        )

    def with_settings(self, recorded_under: str) -> LibraryMismatch:
        if self.earlier_build:
            return self
        return LibraryMismatch(self.path, self.fields, self.detail, recorded_under)


class EpisodeTooLarge(LibraryError):
    """An episode larger on its own than the library's byte bound: refused before anything is written or
    evicted (it would evict every other episode and still not fit)."""


class EpisodeUnreadable(LibraryError):
    """An episode whose file could not be read after open checked it (damaged or removed since)."""


class RecordingFailed(LibraryError):
    """An episode that could not be written (a full disk, an I/O error): the library is left as it was. The
    message names the library and the OS's error; `__cause__` is that error (an OSError, or safetensors'
    SafetensorError: a full disk reaches its writer as that, not as an OSError)."""


@dataclass(frozen=True)
class LibraryKey:
    """What a library must match: the model's weights fingerprint and the shapes it stores."""

    weights: str  # rmuscle_ros.models.checkpoint.weights_fingerprint(model)
    shapes: Mapping[str, int | list[int]]  # e.g. cameras, descriptor_dim, image_size, max_tokens

    def to_json(self) -> dict:
        return {"weights": self.weights, "shapes": dict(self.shapes)}


def is_sampled_fingerprint(value: object) -> bool:
    """Whether a stored weights key is an earlier build's fingerprint (16 bare hex digits over ~4096 sampled
    values per tensor; weights_fingerprint now hashes every byte and writes "sha256:…"). No model loaded
    by this build matches one, so what was recorded under it must be recorded again."""
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{16}", value) is not None


def _mismatch(index_path: Path, stored: Any, key: LibraryKey) -> LibraryMismatch:
    """What differs between a library's key and the model's, each field named with both values."""
    stored = stored if isinstance(stored, dict) else {}
    stored_shapes = stored.get("shapes") if isinstance(stored.get("shapes"), dict) else {}
    earlier_build = False
    if stored.get("weights") != key.weights:
        fields: tuple[str, ...] = ("weights",)
        detail = f"library {stored.get('weights')!r}, model {key.weights!r}"
        earlier_build = is_sampled_fingerprint(stored.get("weights"))
        if earlier_build:
            detail += (
                "; the library's is an earlier build's fingerprint, over a sample of the weights, which no "
                "model matches now that every weight is hashed"
            )
    else:
        fields = tuple(
            k
            for k in sorted(set(stored_shapes) | set(key.shapes))
            if stored_shapes.get(k) != key.shapes.get(k)
        )
        detail = "; ".join(
            f"{k}: library {stored_shapes.get(k, 'absent')}, model {key.shapes.get(k, 'absent')}"
            for k in fields
        )
    return LibraryMismatch(index_path, fields, detail, earlier_build=earlier_build)


@dataclass
class EpisodeEntry:
    id: int
    file: str
    sha256: str
    calls: int
    bytes: int
    created: float
    last_used: float
    meta: dict = field(default_factory=dict)


@dataclass
class Episode:
    """One recorded dense episode, arrays stacked over its calls."""

    descriptors: np.ndarray  # (T, C, D) float32
    images: np.ndarray  # (T, C, H, W, 3) uint8
    tokens: np.ndarray  # (T, L) int64
    token_mask: np.ndarray  # (T, L) bool
    action_masks: np.ndarray | None = None  # (T, steps, depth, k) int16
    image_masks: np.ndarray | None = None  # (T, C) bool, False = camera missing in that call

    def __post_init__(self) -> None:
        t = self.descriptors.shape[0]
        checks = {
            "descriptors": (self.descriptors, 3, np.float32),
            "images": (self.images, 5, np.uint8),
            "tokens": (self.tokens, 2, np.int64),
            "token_mask": (self.token_mask, 2, np.bool_),
        }
        if self.action_masks is not None:
            checks["action_masks"] = (self.action_masks, 4, np.int16)
        if self.image_masks is not None:
            checks["image_masks"] = (self.image_masks, 2, np.bool_)
        for name, (array, ndim, dtype) in checks.items():
            if array.ndim != ndim or array.dtype != dtype or array.shape[0] != t:
                raise ValueError(
                    f"episode {name}: expected {ndim}-D {np.dtype(dtype).name} with {t} calls, "
                    f"got shape {array.shape} dtype {array.dtype}"
                )
        if t == 0:
            raise ValueError("an episode needs at least one call")

    @property
    def calls(self) -> int:
        return self.descriptors.shape[0]

    @property
    def nbytes(self) -> int:
        """Its arrays' bytes (its file's size, less a small header)."""
        arrays = (getattr(self, k) for k in (*EPISODE_TENSORS, *OPTIONAL_TENSORS))
        return sum(a.nbytes for a in arrays if a is not None)

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, np.ndarray]) -> Episode:
        """The episode an episode file holds (`tensors`' inverse): KeyError if a required tensor is missing,
        ValueError if one is not as an episode's."""
        return cls(
            **{k: tensors[k] for k in EPISODE_TENSORS}, **{k: tensors.get(k) for k in OPTIONAL_TENSORS}
        )

    def tensors(self) -> dict[str, np.ndarray]:
        out = {k: np.ascontiguousarray(getattr(self, k)) for k in EPISODE_TENSORS}
        for name in OPTIONAL_TENSORS:
            if getattr(self, name) is not None:
                out[name] = np.ascontiguousarray(getattr(self, name))
        return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_problem(root: Path, entry: EpisodeEntry) -> str | None:
    """What is wrong with an episode's file (missing, or not what the index recorded), None if nothing."""
    path = root / entry.file
    try:
        if not path.exists():
            return f"episode {entry.id}: {entry.file} is missing"
        if path.stat().st_size != entry.bytes or _sha256(path) != entry.sha256:
            return f"episode {entry.id}: {entry.file} is corrupt (checksum mismatch); left out"
    except OSError as e:  # a bad sector (EIO), a file we may not read: this episode's, not the library's
        return f"episode {entry.id}: {entry.file} could not be read ({e}); left out"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _utf8(value: Any) -> bool:
    """A string that UTF-8 can write: JSON's \\udc80 escape reads as a lone surrogate, which printing or
    saving it again fails on (found in review: `list` died on one in a task name)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


# Episode ids stay below this: an index edited to hold a huge one (10**300) opened without a problem and
# then failed every recording (its file name too long) while `verify` passed (found in review). A cell
# that records an episode a second would take ~30,000 years to reach it.
ID_LIMIT = 10**12
_ID = f"an integer >= 0 and < 10**{len(str(ID_LIMIT)) - 1}"


def _is_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value < ID_LIMIT


# Each field of an episode entry: what it must be, and how that reads in a message.
_FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "id": (_is_id, _ID),
    "file": (lambda v: isinstance(v, str), "a file name"),
    "sha256": (lambda v: isinstance(v, str), "a string"),
    "calls": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "bytes": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "created": (_is_number, "a time in seconds"),
    "last_used": (_is_number, "a time in seconds"),
    "meta": (
        lambda v: isinstance(v, dict) and all(_utf8(k) and _utf8(x) for k, x in v.items()),
        "an object of strings (UTF-8)",
    ),
}


def _entries(index_path: Path, episodes: Any) -> list[EpisodeEntry]:
    """The index's episode entries. An index that parses but whose entries are not the library's (not a
    list of objects, a field missing, unknown or of another type, a file that is not its episode's) is a
    LibraryError naming the index and the entry: the command line and the node must report it, not fail
    on it later (a `file` such as "../x" would have `remove` delete a file outside the library)."""
    if not isinstance(episodes, list):
        raise LibraryError(f"{index_path}: unreadable library index (episodes is not a list)")
    entries = []
    for i, raw in enumerate(episodes):
        try:
            entry = EpisodeEntry(**raw)
        except TypeError as e:  # not a mapping, or a missing or unexpected field: e names it
            raise LibraryError(f"{index_path}: unreadable library index (episode entry {i}: {e})") from None
        for name, (fits, what) in _FIELD_TYPES.items():
            value = getattr(entry, name)
            if not fits(value):
                raise LibraryError(
                    f"{index_path}: unreadable library index (episode entry {i}: {name} is {value!r}, "
                    f"not {what})"
                )
        m = EPISODE_FILE.fullmatch(entry.file)
        if m is None or int(m.group(1)) != entry.id:
            raise LibraryError(
                f"{index_path}: unreadable library index (episode entry {i}: file {entry.file!r} is not "
                f"episode {entry.id}'s file, episode_{entry.id:06d}.safetensors in the library's folder)"
            )
        if any(e.id == entry.id for e in entries):  # served and left out at once, then lost at a remove
            raise LibraryError(
                f"{index_path}: unreadable library index (episode entry {i}: episode {entry.id} is listed "
                "twice)"
            )
        entries.append(entry)
    return entries


def _stored_key(index_path: Path, raw: Any) -> LibraryKey:
    """The index's key, checked for its types (a LibraryError naming what is wrong, not a TypeError later)."""

    def shape(value: Any) -> bool:
        if isinstance(value, list):
            return all(_is_int(v) for v in value)
        return isinstance(value, (int, float, str))

    if not isinstance(raw, dict) or not {"weights", "shapes"} <= set(raw):
        problem = "key is not an object of weights and shapes"
    elif set(raw) - {"weights", "shapes"}:  # found in review: reported as a shape mismatch, naming none
        problem = f"key has unknown field(s) {sorted(map(str, set(raw) - {'weights', 'shapes'}))}"
    elif not isinstance(raw["weights"], str):
        problem = f"key weights is {raw['weights']!r}, not a string"
    elif not isinstance(raw["shapes"], dict):
        problem = f"key shapes is {raw['shapes']!r}, not an object"
    else:
        bad = sorted(str(k) for k, v in raw["shapes"].items() if not isinstance(k, str) or not shape(v))
        if not bad:
            return LibraryKey(raw["weights"], raw["shapes"])
        problem = f"key shapes {bad}: not numbers, strings or lists of integers"
    raise LibraryError(f"{index_path}: unreadable library index ({problem})")


@dataclass(frozen=True)
class _Index:
    """An index as read and checked (`_read_index`)."""

    raw_key: Any  # as stored, for the comparison with a model's key
    key: LibraryKey
    entries: list[EpisodeEntry]
    next_id: int
    removed: set[int]


def _read_index(index_path: Path) -> _Index:
    """Read an index and check every field, as the node's open and the command line both need: a
    LibraryError naming what is wrong (one of another version says so; the others name `reindex`)."""
    try:
        index = json.loads(index_path.read_text())
        version, raw_key, episodes = index["version"], index["key"], index["episodes"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested deep
        raise LibraryError(
            f"{index_path}: unreadable library index ({e}); it was left untouched ({REINDEX_HINT})"
        ) from None
    _check_version(index_path, version)
    try:
        return _Index(
            raw_key,
            _stored_key(index_path, raw_key),
            _entries(index_path, episodes),
            _stored_next_id(index_path, index.get("next_id")),
            _stored_removed(index_path, index.get("removed")),
        )
    except LibraryError as e:  # a hand edit or a disk fault: reindex rebuilds it from the files
        raise LibraryError(f"{e}; it was left untouched ({REINDEX_HINT})") from None


def _readable_index(
    root: Path,
) -> tuple[LibraryKey | None, dict[int, EpisodeEntry], int, set[int], str, dict[int, set[str]]]:
    """For `reindex`: the index's key, entries, next id and removed ids, why it cannot be read ("" if it
    can, or if there is none), and, of one that cannot, the checksums its episode entries still give (id ->
    those recorded for it). One of another format is a LibraryError (this build must not rewrite it); a
    disk error reading it is an OSError (nothing to conclude about its content)."""
    index_path = root / INDEX
    if not index_path.exists():
        return None, {}, 0, set(), "", {}
    try:
        raw = json.loads(index_path.read_text())
    except (ValueError, RecursionError) as e:
        return None, {}, 0, set(), f"not JSON ({e})", {}
    if isinstance(raw, dict) and "version" in raw:
        _check_version(index_path, raw["version"])
    try:
        index = _read_index(index_path)
    except LibraryError as e:
        next_id, removed = 0, set()
        with contextlib.suppress(LibraryError, AttributeError):  # what can still be read of it
            next_id = _stored_next_id(index_path, raw.get("next_id"))
        with contextlib.suppress(LibraryError, AttributeError):
            removed = _stored_removed(index_path, raw.get("removed"))
        return None, {}, next_id, removed, str(e), _recorded_checksums(raw)
    return index.key, {e.id: e for e in index.entries}, index.next_id, index.removed, "", {}


def _recorded_checksums(raw: Any) -> dict[int, set[str]]:
    """The checksums an index that cannot be used still records, by episode id: without them `reindex`
    took a file damaged since as good, its checksum taken afresh (found in review)."""
    episodes = raw.get("episodes") if isinstance(raw, dict) else None
    recorded: dict[int, set[str]] = {}
    for entry in episodes if isinstance(episodes, list) else ():
        if isinstance(entry, dict) and _is_id(entry.get("id")) and isinstance(entry.get("sha256"), str):
            recorded.setdefault(entry["id"], set()).add(entry["sha256"])
    return recorded


def _episode_entry(
    path: Path, episode_id: int, key: LibraryKey | None
) -> tuple[LibraryKey, EpisodeEntry] | str:
    """For `reindex`: an unindexed episode file's entry, from what it carries, with its key (which must be
    `key` unless that is None); or why it cannot be indexed."""
    name = path.name
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
        episode = Episode.from_tensors(tensors)
    except (OSError, SafetensorError, KeyError, ValueError, TypeError, IndexError) as e:  # e.g. bfloat16, 0-d
        return f"{name}: does not load ({type(e).__name__}: {e}); skipped"
    if "key" not in metadata:
        return f"{name}: recorded before episode files carried their library's key; skipped"
    try:
        file_key = _stored_key(path, json.loads(metadata["key"]))
        created = float(metadata.get("created", path.stat().st_mtime))
        meta = json.loads(metadata.get("meta", "{}"))
        if not _FIELD_TYPES["meta"][0](meta):
            raise ValueError(f"meta {meta!r} is not an object of strings")
    except (ValueError, LibraryError) as e:
        return f"{name}: what the file says of itself does not read ({e}); skipped"
    if key is not None and file_key.to_json() != key.to_json():
        return (
            f"{name}: recorded under another key ({_mismatch(path, file_key.to_json(), key).detail}); skipped"
        )
    size = path.stat().st_size
    return file_key, EpisodeEntry(
        episode_id, name, _sha256(path), episode.calls, size, created, created, meta
    )


def _episode_file(episode_id: int) -> str:
    return f"episode_{episode_id:06d}.safetensors"


def _stored_removed(index_path: Path, value: Any) -> set[int]:
    """The index's `removed` ids (none if absent: an earlier build's index), checked for their type."""
    if value is None:
        return set()
    if not isinstance(value, list) or not all(_is_id(v) for v in value):
        raise LibraryError(
            f"{index_path}: unreadable library index (removed is {value!r}, not a list of ids, each {_ID})"
        )
    return set(value)


def _stored_next_id(index_path: Path, value: Any) -> int:
    """The index's `next_id` (0 if absent: an earlier build's index), checked for its type."""
    if value is None:
        return 0
    if not _is_id(value):
        raise LibraryError(f"{index_path}: unreadable library index (next_id is {value!r}, not {_ID})")
    return value


def _check_version(index_path: Path, version: Any) -> None:
    """The node and the command line refuse a library of another format alike."""
    if _is_int(version) and version > LIBRARY_VERSION:
        raise LibraryError(
            f"{index_path}: library version {version} was written by a newer rmuscle_ros than this one (it reads "
            f"version {LIBRARY_VERSION}); the library is left as it was: update rmuscle_ros to use it"
        )
    if version != LIBRARY_VERSION or not _is_int(version):
        raise LibraryError(f"{index_path}: library version {version!r}, this build reads {LIBRARY_VERSION}")


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file is at `path` (device, inode), None if none: a rename onto `path` makes it another."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _fsync_dir(folder: Path) -> bool:
    """Make the renames in `folder` durable: a rename is an entry of the folder, which its own fsync
    writes (on Linux; elsewhere a folder cannot be opened for it, and this does nothing). False if the
    sync failed (logged)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return True
    try:
        os.fsync(fd)
    except OSError as e:  # the rename is done: say that it may not survive a power cut, do not undo it
        log.warning("reference library %s: the folder could not be synced (%s): its latest rename may not "
                    "survive a power cut", folder, e)  # fmt: skip
        return False
    finally:
        os.close(fd)
    return True


def _replace_durably(tmp: Path, path: Path) -> bool:
    """Rename `tmp` onto `path` and sync the folder. Once this returns or raises, the rename either
    happened (the folder's sync only logs a failure, and this returns False) or did not (os.replace
    raised)."""
    os.replace(tmp, path)
    return _fsync_dir(path.parent)


def _new_file_mode() -> int | None:
    """The mode a new file gets in this process (0o666 less the umask), read without changing the umask
    (os.umask sets it for every thread); None where /proc does not say (then files keep their mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _temporary(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (see `_leftovers`)."""
    return path.with_name(f".{path.name}{TMP_INFIX}{os.getpid()}")


def _write_atomic(path: Path, data: bytes) -> bool:
    """Write `path` whole or not at all; False if the folder's sync after the rename failed."""
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return _replace_durably(tmp, path)
    except BaseException:  # a full disk: the partial file must not keep holding the space
        tmp.unlink(missing_ok=True)
        raise


def _keep_aside(index_path: Path) -> Path:
    """A copy of an index that cannot be used, as `index.json.corrupt-<time>`, written before the new index
    replaces it: index.json never goes missing (found in review: renamed aside first, a kill before the new
    one was in place left no index, and the next open found an empty library). The same content is kept
    once: a copy already there of it is returned."""
    data = index_path.read_bytes()
    for kept in sorted(index_path.parent.glob(f"{INDEX}.corrupt-*")):
        with contextlib.suppress(OSError):
            if kept.stat().st_size == len(data) and kept.read_bytes() == data:
                return kept
    aside = index_path.with_name(f"{INDEX}.corrupt-{int(time.time())}")
    _write_atomic(aside, data)
    return aside


def _unnamed(root: Path, indexed: set[int]) -> dict[int, str]:
    """Episode files in `root` whose id the index does not hold: id -> file name."""
    files = root.glob("episode_*.safetensors") if root.is_dir() else ()
    return {
        int(m.group(1)): path.name
        for path in files
        if (m := EPISODE_FILE.fullmatch(path.name))
        and _is_id(int(m.group(1)))
        and int(m.group(1)) not in indexed
    }


def _place_new(tmp: Path, path: Path) -> None:
    """Give the file written at `tmp` the name `path`, which must not exist (FileExistsError if it does):
    an episode file is never written over, not even by a second writer that got past the lock (a library
    on a filesystem whose locks do not reach another host). Hard-linked, which fails if the name exists;
    on a filesystem without hard links (FAT), checked and renamed. The folder is synced as by
    `_replace_durably`."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK):
            raise
        if os.path.lexists(path):  # no hard links here: the check and the rename are two steps
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(path)) from None
        os.rename(tmp, path)
    else:
        with contextlib.suppress(OSError):  # left over: the next open deletes it (`_leftovers`)
            tmp.unlink()
    _fsync_dir(path.parent)


def _leftovers(root: Path) -> list[Path]:
    """Temporary files of writes that never finished (a process killed mid-write, a power cut). A draft of
    the open marker (`.open.tmp-<pid>`, lock.py) counts only once its process is gone: a live one is
    an earlier version's node taking its marker (deleting it would leave that node unguarded)."""
    ours = (f".{INDEX}{TMP_INFIX}*", f".episode_*.safetensors{TMP_INFIX}*")
    found = [p for pattern in ours for p in root.glob(pattern) if p.is_file()]
    for draft in root.glob(f"{OPEN_MARKER}{TMP_INFIX}*"):
        if draft.is_file() and not marker_draft_alive(draft):
            found.append(draft)
    return sorted(found)


class ReferenceLibrary:
    """Episodes in memory (indexed) and on disk. Not thread-safe: one owner (the node's cache)."""

    def __init__(
        self, root: Path, key: LibraryKey, *, max_bytes: int = 4 << 30, max_episodes: int = 64
    ) -> None:
        if max_bytes <= 0 or max_episodes <= 0:
            raise ValueError("max_bytes and max_episodes must be positive")
        self.root, self.key = Path(root), key
        self.max_bytes, self.max_episodes = max_bytes, max_episodes
        self.entries: dict[int, EpisodeEntry] = {}
        self.problems: list[str] = []  # what open() found wrong, for logs and CacheStatus
        self.disk_error = ""  # why the latest disk_free_bytes() could not read the disk ("" when it could)
        self.left_out: dict[int, EpisodeEntry] = {}  # the index's episodes whose files open() refused
        self._next_id = 0
        # Episodes removed or evicted: their ids, kept in the index while a file of theirs remains (a delete
        # that failed), so that the next open deletes it and `reindex` does not bring it back.
        self._removed: set[int] = set()
        self._unsaved_use = False  # touch() since the index was last written
        self._index_synced = True  # the folder's sync after the latest index write succeeded
        self._lock: LibraryLock | None = None  # the library's lock, from `open` (given up at `close`)
        # Gives the lock up at `close`, or when this object is collected unclosed (`LibraryLock.release`).
        self._finalizer: weakref.finalize | None = None
        self._bounded = False  # the opener's bounds apply at open too (`_apply_bounds`)
        self._closed = False  # close() ran: nothing more is written

    @property
    def next_id(self) -> int:
        """The id the next recording gets (ids are never given twice)."""
        return self._next_id

    @property
    def read_only(self) -> str:
        """Why add/remove are refused ("" if they are not): the lock file could not be created
        (`LibraryLock.take`)."""
        return self._lock.read_only if self._lock is not None else ""

    # ── open / save ──────────────────────────────────────────────────────────────────────────────────────

    @classmethod
    def open(
        cls, root: Path, key: LibraryKey, *, evict_at_open: bool = True, **bounds: int
    ) -> ReferenceLibrary:
        """Load the index at `root` (empty library if there is none) and verify every episode file.
        LibraryBusy if another process holds the library's lock, an earlier version's node its open
        marker, or another ReferenceLibrary of this process has it open (`LibraryLock.take`). The lock is
        taken first, before the index is read: a `remove` or a second node that comes while this one reads
        and verifies (seconds, for gigabytes of episodes) finds the library busy (before, found in review,
        it did not, and this one's index in memory put a removed episode back). Bounds passed here apply at
        once (`_apply_bounds`) unless `evict_at_open` is False (an opener that records nothing: found in
        review, a bring-up with recording off and a lowered bound deleted other tasks' episodes at open),
        and to every recording after; an opener that passes none (the command line's reads) changes nothing."""
        lib = cls(root, key, **bounds)
        lib._bounded = bool(bounds) and evict_at_open
        lib._lock = LibraryLock.take(lib.root)
        lib._finalizer = weakref.finalize(lib, lib._lock.release)
        try:
            lib._load()
        except BaseException:
            lib._give_up_lock()
            raise
        return lib

    def _load(self) -> None:
        """Read the index at the root and verify every episode file (`open`)."""
        lib, key = self, self.key
        index_path = lib.root / INDEX
        if not index_path.exists():
            lib._tidy()
            return
        index = _read_index(index_path)
        if index.raw_key != key.to_json():
            raise _mismatch(index_path, index.raw_key, key)
        entries, lib._removed = index.entries, index.removed
        for entry in entries:
            problem = _file_problem(lib.root, entry)
            if problem is None:
                lib.entries[entry.id] = entry
            else:
                lib.problems.append(problem)
                lib.left_out[entry.id] = entry
        for problem in lib.problems:
            log.warning("reference library %s: %s", lib.root, problem)
        lib._next_id = max([e.id for e in entries], default=-1) + 1
        lib._next_id = max(lib._next_id, index.next_id)
        lib._tidy()
        if lib._bounded and not lib.read_only:
            lib._apply_bounds()

    def _apply_bounds(self) -> None:
        """Evict at open what lies past the bounds (lowered since the episodes were recorded), as a
        recording would: else the library serves them all until its next recording evicts many at once.
        An index write that fails is logged and leaves the library as it was (the next recording evicts)."""
        count, size = len(self.entries), self.total_bytes
        if count <= self.max_episodes and size <= self.max_bytes:
            return
        before = dict(self.entries)
        evicted = self._evict(keep=-1)
        if not evicted:  # one episode, larger than max bytes: eviction keeps the last (found in review)
            log.warning(
                "reference library %s: its one episode (%.1f MiB) is larger than max bytes (%.1f MiB); kept, "
                "as eviction keeps the last episode: raise max_library_mb, or remove it",
                self.root, size / 2**20, self.max_bytes / 2**20,
            )  # fmt: skip
            return

        def undo() -> None:
            self.entries.clear()
            self.entries.update(before)

        try:
            self._commit_index(undo)
        except OSError as e:
            log.warning(
                "reference library %s: holds %d episode(s), %.1f MiB, past its bounds, but its index could "
                "not be written to evict (%s); all are kept until the next recording",
                self.root, count, size / 2**20, e,
            )  # fmt: skip
            return
        self._delete_files(evicted)
        log.warning(
            "reference library %s: held %d episode(s), %.1f MiB, past its bounds (max_episodes %d, max bytes "
            "%.1f MiB, lower than when they were recorded); evicted episode(s) %s at open",
            self.root, count, size / 2**20, self.max_episodes, self.max_bytes / 2**20,
            sorted(e.id for e in evicted),
        )  # fmt: skip

    def _tidy(self) -> None:
        """What writes that never finished left behind: their partial files are deleted (not by a reader
        without the lock: a writer may be writing them), and episode files the index does not name are
        reported and kept, their ids never reused."""
        if not self.read_only:
            self._remove_leftovers()
        unnamed = _unnamed(self.root, set(self.entries) | set(self.left_out))
        if unnamed:
            self._next_id = max(self._next_id, max(unnamed) + 1)  # never written over
        for episode_id in sorted(set(unnamed) & self._removed):  # removed or evicted, their delete failed
            if self.read_only:
                break
            try:
                (self.root / unnamed[episode_id]).unlink()
            except OSError as e:
                log.warning("reference library %s: cannot delete %s, of removed episode %d (%s)",
                            self.root, unnamed[episode_id], episode_id, e)  # fmt: skip
                continue
            log.warning("reference library %s: deleted %s, of removed episode %d (its delete had failed)",
                        self.root, unnamed[episode_id], episode_id)  # fmt: skip
            del unnamed[episode_id]
        unnamed = {i: name for i, name in unnamed.items() if i not in self._removed}
        if unnamed:
            log.warning(
                "reference library %s: episode file(s) the index does not name, kept and never used: %s "
                "(a recording whose index write failed, or an eviction whose delete did; %s, or delete them)",
                self.root,
                ", ".join(unnamed[i] for i in sorted(unnamed)),
                REINDEX_HINT,
            )

    def _remove_leftovers(self) -> None:
        """Delete the partial files of writes that never finished: this process holds the lock (taken
        before this), so no other is still writing them, and nothing names them. An episode written in
        full but not yet in the index when its writer died is one of them (its recording never finished:
        the index is written last)."""
        found = _leftovers(self.root) if self.root.is_dir() else []
        freed = 0
        for path in found:
            try:
                size = path.stat().st_size
                path.unlink()
                freed += size
            except OSError as e:
                log.warning(
                    "reference library %s: cannot remove the partial file %s (%s)", self.root, path, e
                )
        if found:
            log.warning(
                "reference library %s: removed %d partial file(s) of writes that never finished (%.1f MiB): %s",
                self.root,
                len(found),
                freed / 2**20,
                ", ".join(p.name for p in found),
            )

    def _give_up_lock(self) -> None:
        """Give this library's lock up (`LibraryLock.release`), once."""
        finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer()

    def close(self) -> None:
        """Give up the library: the episodes' last use is written to the index if it changed since the last
        write (a failed write is logged: the episodes are on disk already; a read-only library, or one a
        fork child inherited, writes nothing), then its lock is given up."""
        not_writable = self._not_writable()
        if self._unsaved_use and not_writable:
            log.info("reference library %s: its episodes' last use was not saved (%s)",
                     self.root, not_writable)  # fmt: skip
        self.save_use()
        self._closed = True
        self._give_up_lock()

    def save_use(self) -> bool:
        """Write the index if an episode's last use changed since it was last written (`touch`), and the
        library may be written; returns whether it was. A failed write is logged, not raised: the episodes
        are on disk already. Called at each episode reset (RMuscle.reset_episode), not only at close: a cell
        served from one task records nothing for hours, so a process killed without a clean close (SIGKILL
        ten seconds after a launch's Ctrl-C, the OOM killer, a power cut) lost the day's use, and eviction
        after the restart took the episode the cell had been served from (found in review)."""
        if not self._unsaved_use or self._not_writable():
            return False
        try:
            self.save_index()
        except OSError as e:
            log.warning("reference library %s: its episodes' last use was not saved (%s)", self.root, e)
            return False
        return True

    def _not_writable(self) -> str:
        """Why this library may not be written ("" if it may): opened read-only (`LibraryLock.take`),
        closed (found in review: a closed library's remove() rewrote the index from its own memory, dropping
        the episodes of the process that had opened it since), or opened by the process this one is a fork
        of (the lock is that one's)."""
        if self.read_only:
            return (
                f"the library was opened read-only ({self.read_only}); make the folder writable, or point "
                "library_path at a writable one"
            )
        if self._closed:
            return "the library was closed; open it again"
        if self._lock is not None and self._lock.pid != os.getpid():
            return (
                f"the library was opened by process {self._lock.pid}, of which this one is a fork (the lock is "
                "that process's); open it in this process once that one has closed it"
            )
        return ""

    def _folder_gone(self) -> str:
        """Why the library's folder is no longer the one this process opened and locked ("" if it is): it
        was removed or moved while open (`rm -rf`, `mv`, a drive unmounted). A write then recreated the
        folder at its old path, unlocked, with an index naming episodes that were not there, and another
        process could open it beside this one (found in review)."""
        lock = self._lock
        if lock is None or lock.identity is None or self.read_only:
            return ""
        if _identity(self.root / LOCK_FILE) == lock.identity:
            return ""
        return (
            f"its folder {self.root} was removed or moved since this process opened it (the lock file there "
            "is not the one it holds)"
        )

    def _writable(self, what: str) -> None:
        """LibraryError if this library may not be written (`_not_writable`)."""
        not_writable = self._not_writable()
        if not_writable:
            raise LibraryError(f"{self.root}: cannot {what}: {not_writable}")

    def save_index(self) -> None:
        """Atomically replace index.json with the current entries (episode files are already on disk). The
        corrupt episodes open() left out stay in it: every open reports them until they are removed, and
        their ids stay taken, so that no new episode's file overwrites one kept for inspection."""
        if self._closed:
            raise LibraryError(f"{self.root}: cannot write its index: the library was closed; open it again")
        gone = self._folder_gone()
        if gone:  # an OSError: callers that save the episodes' last use log it and go on
            raise FileNotFoundError(errno.ENOENT, f"{self.root}: its index was not written: {gone}")
        self.root.mkdir(parents=True, exist_ok=True)
        index_path = self.root / INDEX
        if index_path.exists():
            try:
                json.loads(index_path.read_text())
            except (ValueError, RecursionError):  # never overwrite what we could not read: keep it aside
                _keep_aside(index_path)
        index = {
            "version": LIBRARY_VERSION,
            "key": self.key.to_json(),
            # The next episode's id: a removed episode's id is never given again, so a `remove` of a stale id
            # (from shell history) cannot take a newer recording (found in review). Absent in earlier builds'
            # indexes: the highest id held + 1 then.
            "next_id": self._next_id,
            "removed": sorted(
                i
                for i in self._removed
                if i not in self.entries
                and i not in self.left_out
                and (self.root / _episode_file(i)).exists()
            ),
            "episodes": [
                asdict(e)
                for e in sorted([*self.entries.values(), *self.left_out.values()], key=lambda e: e.id)
            ],
        }
        self._index_synced = _write_atomic(index_path, json.dumps(index, indent=1).encode())
        self._unsaved_use = False

    def _commit_index(self, undo: Callable[[], None]) -> None:
        """save_index for a change already made in memory; if it fails before the new index is renamed into
        place, `undo` puts the library in memory back to the index on disk. One that fails after the rename
        (an interrupt during the folder's sync) leaves the change: the index on disk already holds it."""
        index_path = self.root / INDEX
        before = _identity(index_path)
        try:
            self.save_index()
        except BaseException:
            # Not renamed: the index on disk is the previous one (or none, one moved aside as corrupt).
            if _identity(index_path) in (before, None):
                undo()
            raise

    def _delete_files(self, entries: Sequence[EpisodeEntry]) -> None:
        """Delete the files of episodes the committed index no longer names. One that cannot be deleted is
        logged, not raised: the change is done, and the next open reports the file as one it does not name.
        None is deleted while the folder's sync after the index's rename failed: a power cut could bring
        back the index naming them (found in review). They are in the index's `removed`, so the next open
        deletes them."""
        if entries and not self._index_synced:
            log.warning("reference library %s: episode file(s) %s kept until the next open: the folder's sync "
                        "after the index was written failed", self.root, [e.file for e in entries])  # fmt: skip
            return
        for entry in entries:
            try:
                (self.root / entry.file).unlink(missing_ok=True)
                # Gone: nothing left for the next open to delete. Kept, the set grew for the life of the
                # process and every index write checked each id on disk (found in review).
                self._removed.discard(entry.id)
            except OSError as e:
                log.warning("reference library %s: cannot delete %s, which the index no longer names (%s)",
                            self.root, entry.file, e)  # fmt: skip

    # ── episodes ─────────────────────────────────────────────────────────────────────────────────────────

    def add(self, episode: Episode, meta: Mapping[str, str] | None = None) -> int:
        """Write a recorded episode, update the index atomically, evict LRU episodes past the bounds. An
        episode larger than `max_bytes` on its own is refused (EpisodeTooLarge) before anything is evicted
        or renamed into place; an episode file of its id written meanwhile by another is never overwritten
        (LibraryError); a write that fails (a full disk, an I/O error) raises RecordingFailed. Each way the
        library is left as it was. One that fails after the new index took its place (the folder's sync)
        is recorded: its id is returned, with a warning (the files it evicted go at the next open)."""
        self._writable("record an episode")
        gone = self._folder_gone()
        if gone:  # kept by the runtime and tried again, as after a full disk: it may be put back
            raise RecordingFailed(
                f"reference library {self.root}: the episode could not be recorded: {gone}; put the folder "
                "back, or configure the node again to open the library anew"
            ) from FileNotFoundError(errno.ENOENT, gone)
        expected = self._next_id
        try:
            return self._add(episode, meta)
        except (OSError, SafetensorError) as e:
            if expected in self.entries:  # failed after the index naming it took its place: it is recorded
                log.warning("reference library %s: episode %d is recorded, but a step after its index was "
                            "written failed: %s", self.root, expected, e)  # fmt: skip
                return expected
            raise RecordingFailed(self._recording_failed(e, episode)) from e

    def _recording_failed(self, error: BaseException, episode: Episode) -> str:
        """RecordingFailed's message: the library, the OS's error and, where the disk cannot hold the
        episode, what frees room (eviction makes room only within the bounds: found in review, a
        `max_library_mb` above what the disk holds failed every recording once the disk was full)."""
        message = (
            f"reference library {self.root}: the episode could not be recorded ({type(error).__name__}: "
            f"{error}); the library is as it was"
        )
        free, size = self.disk_free_bytes(), episode.nbytes
        if free is not None and free < size + (1 << 20):
            message += (
                f". Its disk has {free / 2**20:.1f} MiB free for a {size / 2**20:.1f} MiB episode: free "
                "space on that disk"
            )
            if self.entries:  # eviction frees the library's own space only within its bound
                message += (
                    f"; the library holds {self.total_bytes / 2**20:.1f} MiB of its "
                    f"{self.max_bytes / 2**20:.0f} MiB bound (max_library_mb, read at configure): a bound "
                    "below what the disk can hold lets eviction make room for later recordings"
                )
        return message

    def _add(self, episode: Episode, meta: Mapping[str, str] | None) -> int:
        tensors = episode.tensors()
        # The file holds the tensors and a small header: already too large without the header, it is
        # refused before it is written; with it, right after.
        self._refuse_too_large(episode, episode.nbytes)
        self.root.mkdir(parents=True, exist_ok=True)
        episode_id = self._next_id
        self._next_id += 1
        name = _episode_file(episode_id)
        path = self.root / name
        tmp = _temporary(path)
        ours = None  # the written file's identity, once known
        entries = dict(self.entries)  # as the index on disk names them

        def restore() -> None:
            self.entries.clear()
            self.entries.update(entries)

        def undo() -> None:  # the index on disk is the previous one: so is the library, here too
            restore()
            path.unlink(missing_ok=True)

        try:
            now = time.time()
            save_file(tensors, str(tmp), metadata=self._file_metadata(episode_id, meta, now))
            # safetensors creates its files 0600: an engineer's `verify` under another user than the node's
            # read them as unreadable (found in review). They get the mode any file gets, as the index does.
            mode = _new_file_mode()
            if mode is not None:
                os.chmod(tmp, mode)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            size = tmp.stat().st_size
            self._refuse_too_large(episode, size)
            # Read before the file takes its name: from there to the index's write nothing reads the disk
            # (found in review: an interrupt while hashing the placed file left it unindexed, the runtime
            # recorded the episode again, and `reindex` then adopted the first copy too)
            digest = _sha256(tmp)
            ours = _identity(tmp)
            _place_new(tmp, path)  # on disk before the index that names it
            # Interrupted from here to the index's write (in the eviction), the handler below undoes it all
            # (found in review: the new entry stayed in memory, unindexed on disk)
            self.entries[episode_id] = EpisodeEntry(
                episode_id, name, digest, episode.calls, size, now, now, dict(meta or {})
            )
            evicted = self._evict(keep=episode_id)
        except FileExistsError:
            tmp.unlink(missing_ok=True)
            raise LibraryError(
                f"{path}: an episode file of this id exists already (written by another process with this "
                "library open?); it is not overwritten, and this recording is not saved"
            ) from None
        except BaseException:  # a full disk: the partial file must not keep holding the space
            tmp.unlink(missing_ok=True)
            if ours is not None and _identity(path) == ours:  # placed, then interrupted
                path.unlink(missing_ok=True)
            restore()  # (its id stays taken: ids only go up, as `list` shows; a failed write skips one)
            raise
        self._commit_index(undo)
        self._delete_files(evicted)  # only once the index no longer names them
        return episode_id

    def _file_metadata(
        self, episode_id: int, meta: Mapping[str, str] | None, created: float
    ) -> dict[str, str]:
        """What an episode file carries beside its tensors: its id, and what the index holds of it that the
        file alone cannot give (the library's key, its meta, when it was recorded), so that `reindex` can
        rebuild a lost or damaged index from the files."""
        return {
            "episode": str(episode_id),
            "key": json.dumps(self.key.to_json(), sort_keys=True),
            "meta": json.dumps(dict(meta or {}), sort_keys=True),
            "created": repr(created),
        }

    @classmethod
    def reindex(cls, root: Path) -> tuple[list[int], list[str], bool]:
        """Index the episode files the index does not name, from what each file carries (`_file_metadata`):
        a recording whose index write failed, or every file if the index is lost or cannot be read. An
        unreadable index is set aside as `index.json.corrupt-<time>` once a new one is written from the
        files (left as it was if no file can rebuild it); one of another format is left alone
        (LibraryError). Skipped and named: a file of an episode the index says was removed or evicted (its
        delete failed: not a lost recording), files of another key or of none (recorded before files carried
        it), and files that do not load. Takes the library's lock (LibraryBusy while a
        node has it open). Returns (the ids indexed, what was skipped or set aside, whether all went well)."""
        root = Path(root)
        lock = LibraryLock.take(root)
        try:
            if lock.read_only:
                raise LibraryError(f"{root}: cannot reindex: {lock.read_only}")
            key, entries, next_id, removed, broken, checksums = _readable_index(root)
            notes: list[str] = []
            indexed: list[int] = []
            ok = True  # nothing skipped, nothing left as it was
            unnamed = _unnamed(root, set(entries))
            for episode_id, name in sorted(unnamed.items()):
                if episode_id in removed:
                    notes.append(
                        f"{name}: of episode {episode_id}, removed or evicted (the index says so), whose file "
                        "could not be deleted: not a lost recording; skipped (delete it)"
                    )
                    ok = False
                    continue
                adopted = _episode_entry(root / name, episode_id, key)
                if isinstance(adopted, str):
                    notes.append(adopted)
                    ok = False
                    continue
                if episode_id in checksums and adopted[1].sha256 not in checksums[episode_id]:
                    notes.append(
                        f"{name}: its checksum is not the one the unreadable index recorded for episode "
                        f"{episode_id}: damaged since it was written; skipped (remove it)"
                    )
                    ok = False
                    continue
                key, entries[episode_id] = adopted
                indexed.append(episode_id)
            index_path = root / INDEX
            if broken and not indexed:
                notes.append(f"{INDEX}: {broken}; no episode file can rebuild it: left as it was")
                ok = False
            elif indexed and key is not None:
                if broken:
                    aside = _keep_aside(index_path)
                    notes.append(
                        f"{INDEX}: {broken}; set aside as {aside.name}, rebuilt from the episode files"
                    )
                lib = cls(root, key)
                lib.entries, lib._removed = entries, removed
                lib._next_id = max([next_id, *(i + 1 for i in [*entries, *unnamed])])
                lib.save_index()
            return indexed, notes, ok
        finally:
            lock.release()

    def _refuse_too_large(self, episode: Episode, size: int) -> None:
        """EpisodeTooLarge if `size` bytes exceed what the whole library may hold: making room would evict
        every other episode, of every task, and the bound would still be exceeded."""
        if size > self.max_bytes:
            raise EpisodeTooLarge(
                f"{self.root}: an episode of {episode.calls} calls takes {size / 2**20:.1f} MiB, more than the "
                f"whole library may hold ({self.max_bytes / 2**20:.1f} MiB, max_library_mb); it is not "
                "recorded, and the library is left as it was. Raise max_library_mb, or reset episodes more "
                "often (~/reset_episode) so that each is shorter"
            )

    def load(self, episode_id: int) -> Episode:
        """Read an episode (checksum verified on open). Reading is not use: a call served from it is
        (`touch`). Found in review: every window refill marked the episode it read as used, so an episode
        refilled at each reset but never served stayed "recent" for eviction and for the next refill."""
        entry = self.entries[episode_id]
        try:
            tensors = load_file(str(self.root / entry.file))
            episode = Episode.from_tensors(tensors)
        except READ_ERRORS as e:
            raise self._unreadable(episode_id, e) from e
        return episode

    def _unreadable(self, episode_id: int, e: Exception) -> EpisodeUnreadable:
        """What `load` and `load_call` raise for an episode file they could not read."""
        file = self.entries[episode_id].file
        return EpisodeUnreadable(f"episode {episode_id}: {file} could not be read ({type(e).__name__}: {e})")

    def load_call(self, episode_id: int, call: int) -> Episode:
        """One call of an episode, as an Episode of one call, read without the rest of its file: what a
        window entry's rebuild needs. At `pi05` a call holds ~1.2 MB (its images and Action Cache masks),
        so a 100-call episode's file is ~116 MiB: read whole in 78 ms on this project's 2-core machine
        (page cache warm), one call's rows in 0.22 ms (bench/bench_episode_read.py). Errors as `load`'s;
        IndexError for a call the episode lacks."""
        entry = self.entries[episode_id]
        if not 0 <= call < entry.calls:
            raise IndexError(f"episode {episode_id} has {entry.calls} calls: no call {call}")
        try:
            with safe_open(str(self.root / entry.file), framework="np") as f:
                held = set(f.keys())  # a safetensors handle, not a dict
                rows = {
                    k: f.get_slice(k)[call : call + 1]
                    for k in (*EPISODE_TENSORS, *OPTIONAL_TENSORS)
                    if k in held
                }
            return Episode.from_tensors(rows)
        except READ_ERRORS as e:
            raise self._unreadable(episode_id, e) from e

    def leave_out(self, episode_id: int, problem: str) -> None:
        """Take an episode out of service after open (its file could not be read): reported (`problems`)
        and kept as open() keeps a corrupt one, in the index and on disk for inspection. The next open
        checks its file again."""
        self.left_out[episode_id] = self.entries.pop(episode_id)
        self.problems.append(problem)
        log.warning("reference library %s: %s; left out until it is removed or checks out at the next open",
                    self.root, problem)  # fmt: skip

    def touch(self, episode_id: int) -> None:
        """Mark an episode used now (a call was served from it): eviction takes it after the episodes of its
        task used less recently. Kept in memory until the index is next written. An episode no longer in
        the library is ignored: bookkeeping must not fail the call that was served."""
        entry = self.entries.get(episode_id)
        if entry is not None:
            entry.last_used = time.time()
            self._unsaved_use = True

    def load_field(self, episode_id: int, name: str) -> np.ndarray:
        """One tensor of an episode (e.g. its descriptors for retrieval), without reading the rest."""
        entry = self.entries[episode_id]
        with safe_open(str(self.root / entry.file), framework="numpy") as f:
            if name not in set(f.keys()):  # a safetensors handle, not a dict
                raise KeyError(f"episode {episode_id} has no {name!r}")
            return f.get_tensor(name)

    def remove(self, episode_ids: Sequence[int]) -> None:
        """Take episodes out of the library, corrupt ones (left out at open) too: the index first
        (atomically), then their files. An id the index does not hold is a KeyError naming it, and nothing
        is removed. Refused on a library opened read-only."""
        self._writable("remove episodes")
        unknown = sorted(set(episode_ids) - set(self.entries) - set(self.left_out))
        if unknown:
            held = sorted([*self.entries, *self.left_out])
            raise KeyError(f"no episode {unknown} in {self.root} (it holds {held})")
        before = dict(self.entries), dict(self.left_out)
        removed = [self.entries.pop(i, None) or self.left_out.pop(i) for i in dict.fromkeys(episode_ids)]
        self._removed.update(e.id for e in removed)

        def undo() -> None:  # the index on disk still names them: so must the library here, as it was
            for current, was in zip((self.entries, self.left_out), before, strict=True):
                current.clear()  # in place: the runtime holds `entries`
                current.update(was)

        self._commit_index(undo)
        self._delete_files(removed)  # once the index no longer names them

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    def disk_free_bytes(self) -> int | None:
        """Free space on the disk the library writes to (its folder, or the nearest existing folder above
        it before the first recording creates it); None if that cannot be read, with the reason in
        `disk_error` (a failing disk, EIO, or a stale network mount, ESTALE: the next recording would
        likely fail too)."""
        try:  # exists() too raises on those
            folder = self.root.absolute()
            while not folder.exists() and folder != folder.parent:
                folder = folder.parent
            free = shutil.disk_usage(folder).free
        except OSError as e:
            self.disk_error = f"{type(e).__name__}: {e}"
            return None
        self.disk_error = ""
        return free

    def disk_low(self, free: int | None) -> bool:
        """Whether `free` bytes (`disk_free_bytes`) could not take another episode as large as the largest
        held: the next recording would then likely fail (and is reported when it does). False with no
        episode yet, or free space unknown."""
        largest = max((e.bytes for e in self.entries.values()), default=0)
        return free is not None and largest > 0 and free < largest + (1 << 20)  # + the index, with room

    def _evict(self, keep: int) -> list[EpisodeEntry]:
        """Past a bound, take out the least recently used episode of the task holding the most episodes
        (ties: the task whose oldest use is oldest); episodes without a task first, as nothing serves them.
        Until then, one task's new recordings evict only its own episodes once it holds the largest share.
        `keep` (the episode being added) is never taken, though others' last use may lie in its future (an
        index written while the clock was ahead)."""
        evicted = []
        while len(self.entries) > 1 and (
            len(self.entries) > self.max_episodes or self.total_bytes > self.max_bytes
        ):
            by_task: dict[str | None, list[EpisodeEntry]] = {}
            for entry in self.entries.values():
                by_task.setdefault(entry.meta.get("task"), []).append(entry)
            for held in by_task.values():
                held.sort(key=lambda e: (e.id == keep, e.last_used, e.id))
            # A task gives up only episodes it held before; its share counts the one being added.
            by_task = {t: held for t, held in by_task.items() if held[0].id != keep}
            task = (
                None
                if None in by_task
                else max(by_task, key=lambda t: (len(by_task[t]), -by_task[t][0].last_used))
            )
            victim = by_task[task][0]
            evicted.append(self.entries.pop(victim.id))
            self._removed.add(victim.id)
            log.info(
                "reference library %s: evicted episode %d (task %r: the least recently used of its %d)",
                self.root,
                victim.id,
                task,
                len(by_task[task]),
            )
        return evicted


# ── command line ─────────────────────────────────────────────────────────────────────────────────────────


def _stored(root: Path) -> tuple[LibraryKey, list[dict]]:
    """The index's key and entries, checked as `open` checks them (version, types), for the command line."""
    index_path = Path(root) / INDEX
    if not index_path.exists():
        raise LibraryError(f"{root}: no library here (no {INDEX})")
    index = _read_index(index_path)
    return index.key, [asdict(e) for e in index.entries]


def _when(seconds: float) -> str:
    try:
        return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError):  # a time no calendar holds (an index edited by hand)
        return f"{seconds!r} (not a date)"


def _descriptors(root: Path, episodes: list[dict]) -> tuple[dict[int, np.ndarray], list[str]]:
    """Each readable episode's descriptors as unit rows (as retrieval holds them), and what could not be
    read. Only the descriptors are read from each file, not its images."""
    # The runtime's own normalisation; imported here, as retrieval imports torch, which the other commands
    # do not need.
    from rmuscle_ros.cache.retrieval import unit_rows

    rows: dict[int, np.ndarray] = {}
    problems = []
    for e in episodes:
        problem = _file_problem(Path(root), EpisodeEntry(**e))
        if problem is not None:  # left out, as the node leaves it out: its descriptors may be the damage
            problems.append(f"{problem}, see verify")
            continue
        try:
            with safe_open(str(Path(root) / e["file"]), framework="np") as f:
                rows[e["id"]] = unit_rows(f.get_tensor("descriptors"))
        except (OSError, SafetensorError, KeyError, ValueError) as err:
            problems.append(f"episode {e['id']}: descriptors unreadable ({err}); left out, see verify")
    return rows, problems


@dataclass(frozen=True)
class TaskSimilarity:
    """Per task, every recorded call's best descriptor similarity among the task's other episodes (what a
    repeat of the task scores) and among other tasks' episodes (what another job's scene scores)."""

    task: str | None
    episodes: int
    calls: int
    repeat: np.ndarray  # (calls,), empty when the task has one episode
    other: np.ndarray  # (calls,), empty when the library holds one task


def task_similarities(
    rows: Mapping[int, np.ndarray], tasks: Mapping[int, str | None]
) -> list[TaskSimilarity]:
    """rows: episode id -> unit descriptor rows; tasks: episode id -> its task (None: recorded without)."""
    out = []
    for task in sorted(set(tasks.values()), key=str):
        mine = [i for i in rows if tasks[i] == task]
        others = [rows[j] for j in rows if tasks[j] != task]
        other_rows = np.concatenate(others) if others else None  # the same for each of the task's episodes
        repeat, other = [], []
        for i in mine:
            same = [rows[j] for j in mine if j != i]
            if same:
                repeat.append((rows[i] @ np.concatenate(same).T).max(axis=1))
            if other_rows is not None:
                other.append((rows[i] @ other_rows.T).max(axis=1))
        stack = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.float32)  # noqa: E731
        calls = sum(len(rows[i]) for i in mine)
        out.append(TaskSimilarity(task, len(mine), calls, stack(repeat), stack(other)))
    return out


def _similarity_report(root: Path, episodes: list[dict], threshold: float) -> list[str]:
    rows, problems = _descriptors(root, episodes)
    tasks = {e["id"]: e.get("meta", {}).get("task") for e in episodes if e["id"] in rows}
    lines = [
        f"library {root}: each recorded call's best descriptor similarity (cosine, as retrieval computes it)",
        "  against its task's other episodes (a repeat: should stay above cache.similarity_threshold) and",
        "  against other tasks' episodes (another job's scene: below it, unless the jobs share a bench)",
    ]
    lines += [f"  {problem}" for problem in problems]
    repeats, others = [], []
    for t in task_similarities(rows, tasks):
        name = f"task {t.task!r}" if t.task is not None else "no task recorded"
        lines.append(f"  {name}: {t.episodes} episode(s), {t.calls} calls")
        if len(t.repeat):
            below = int((t.repeat < threshold).sum())
            lines.append(
                f"    repeats: min {t.repeat.min():.3f}, 5th percentile {np.percentile(t.repeat, 5):.3f}, "
                f"median {np.median(t.repeat):.3f}; {below} of {len(t.repeat)} below {threshold:g} (would run dense)"
            )
            repeats.append(t.repeat)
        else:
            lines.append("    repeats: none (one episode)")
        if len(t.other):
            above = int((t.other >= threshold).sum())
            lines.append(
                f"    other tasks: max {t.other.max():.3f}, 95th percentile {np.percentile(t.other, 95):.3f}, "
                f"median {np.median(t.other):.3f}; {above} of {len(t.other)} at or above {threshold:g}"
            )
            others.append(t.other)
    if repeats and others:
        low, high = min(r.min() for r in repeats), max(o.max() for o in others)
        if low > high:
            lines.append(
                f"separated: every repeat scored above every other task's scene; a threshold between "
                f"{high:.3f} and {low:.3f} tells them apart ({threshold:g} "
                f"{'does' if high < threshold <= low else 'does not'})"
            )
        else:
            lines.append(
                f"not separated: a repeat scored as low as {low:.3f} and another task's scene as high as "
                f"{high:.3f}; retrieval keeps tasks apart by name (cache.task or the prompt), not by threshold"
            )
    return lines


EXIT_BUSY = 75  # EX_TEMPFAIL: open in a live process; try again once it is cleaned up (other errors: 2)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rmuscle_ros.cache.library",
        description="Inspect a reference library, check its files, rebuild its index, or take episodes out of it.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the library's key and episodes (reads the index only)").add_argument(
        "root", type=Path
    )
    sub.add_parser("verify", help="check every episode file's size and checksum").add_argument(
        "root", type=Path
    )
    similarity = sub.add_parser(
        "similarity", help="how alike repeats and other tasks' scenes look to retrieval, against a threshold"
    )
    similarity.add_argument("root", type=Path)
    similarity.add_argument("--threshold", type=float, default=0.8, help="cache.similarity_threshold")
    sub.add_parser(
        "reindex",
        help="index the episode files the index does not name; an unreadable index is set aside and rebuilt",
    ).add_argument("root", type=Path)
    remove = sub.add_parser("remove", help="take episodes out (not while a live node has it open)")
    remove.add_argument("root", type=Path)
    remove.add_argument("ids", type=int, nargs="*", metavar="ID")
    remove.add_argument(
        "--task",
        default=None,
        help="instead of ids: every episode of this task, as `list` shows it (a retired job)",
    )
    args = p.parse_args(argv)
    if args.command == "remove" and (args.task is None) == (not args.ids):
        p.error("remove: episode ids, or --task, not both")
    if args.command == "similarity" and not -1.0 <= args.threshold <= 1.0:
        p.error(f"similarity: --threshold is a cosine similarity in [-1, 1], got {args.threshold:g}")
    try:
        if args.command == "reindex":
            if not (args.root / INDEX).exists() and not _unnamed(args.root, set()):
                raise LibraryError(f"{args.root}: no library here (no {INDEX} and no episode files)")
            indexed, notes, ok = ReferenceLibrary.reindex(args.root)
            for note in notes:
                print(f"  {note}")
            print(f"indexed episode(s) {indexed}" if indexed else "no episode file indexed")
            return 0 if ok else 1
        key, episodes = _stored(args.root)
        # found in review: an operator's check after an upgrade looked healthy
        earlier_build = is_sampled_fingerprint(key.weights)
        stale = (
            f"  weights {key.weights}: an earlier build's fingerprint, which no model loaded by this build "
            "matches: a node refuses this library; record it again"
        )
        if args.command == "list":
            total = sum(e["bytes"] for e in episodes) / 2**20
            print(f"library {args.root}: {len(episodes)} episode(s), {total:.1f} MiB, weights {key.weights}, "
                  f"shapes {dict(key.shapes)}")  # fmt: skip
            if earlier_build:
                print(stale)
            who = holder(args.root)
            print(f"open in process {who}" if who else "not open in any live process")
            by_task: dict[str | None, list[dict]] = {}
            for e in episodes:
                by_task.setdefault(e.get("meta", {}).get("task"), []).append(e)
            for task, held in sorted(by_task.items(), key=lambda kv: (-len(kv[1]), str(kv[0]))):
                name = (
                    f"task {task!r}"
                    if task is not None
                    else "no task recorded (served to none, evicted first)"
                )
                mib = sum(e["bytes"] for e in held) / 2**20
                # Eviction takes from the task holding the most; a retired job (long unused) keeps its share
                # until `remove --task`.
                last = _when(max(e["last_used"] for e in held))
                print(f"  {name}: {len(held)} episode(s), {mib:.1f} MiB, last used {last}")
            for e in episodes:
                meta = dict(e.get("meta", {}))
                task = meta.pop("task", None)  # rMuscle serves an episode only to calls of its task
                about = [f"task {task!r}" if task is not None else "no task recorded: served to none"]
                about += [f"{k} {v}" for k, v in sorted(meta.items())]
                print(f"  episode {e['id']}: {e['calls']} calls, {e['bytes'] / 2**20:.1f} MiB, recorded "
                      f"{_when(e['created'])}, last used {_when(e['last_used'])} ({', '.join(about)})")  # fmt: skip
            return 0
        if args.command == "similarity":
            print("\n".join(_similarity_report(args.root, episodes, args.threshold)))
            return 0
        if args.command == "verify":
            found = (_file_problem(args.root, EpisodeEntry(**e)) for e in episodes)
            problems = [problem for problem in found if problem is not None]
            for _, name in sorted(_unnamed(args.root, {e["id"] for e in episodes}).items()):
                print(f"  {name}: not named by the index (kept; never used; `reindex` indexes it)")
            for path in _leftovers(args.root):
                print(f"  {path.name}: a write that never finished (the next open deletes it)")
            for problem in problems:
                print(f"  {problem}")
            if earlier_build:
                print(stale)
            print(f"{len(episodes) - len(problems)} of {len(episodes)} episode(s) intact")
            return 1 if problems or earlier_build else 0
        who = holder(args.root)
        if who is not None:
            raise LibraryBusy(
                f"{args.root} is open in process {who} (a running node?): its index in memory would put "
                "the episodes back. Clean the node up (or stop it), then remove them"
            )
        ids = args.ids
        if args.task is not None:
            ids = [e["id"] for e in episodes if e.get("meta", {}).get("task") == args.task]
            if not ids:
                tasks = sorted({e["meta"]["task"] for e in episodes if "task" in e.get("meta", {})})
                raise KeyError(f"no episode of task {args.task!r} in {args.root} (its tasks: {tasks})")
        lib = ReferenceLibrary.open(args.root, key, max_bytes=1 << 62, max_episodes=1 << 30)
        try:
            lib.remove(ids)
        finally:
            lib.close()
        print(f"removed episode(s) {ids}; {len(lib.entries)} left")
        return 0
    except BrokenPipeError:  # `list … | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 1
    except (LibraryError, KeyError, OSError) as e:  # OSError: a disk error, a full disk
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return EXIT_BUSY if isinstance(e, LibraryBusy) else 2


if __name__ == "__main__":
    sys.exit(main())
