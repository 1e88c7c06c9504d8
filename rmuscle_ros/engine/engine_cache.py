"""What `engine_cache_dir` holds, and pruning it: `python -m rmuscle_ros.engine.engine_cache list | prune`.

The exported backends keep, under `engine_cache_dir`:
  - `onnx/<export digest>/`: one ONNX export per model version (weights, config, dtype, exporter and the
    code that defines the graphs; `onnx_export.ensure_export`), 6.5 GB at full size in bfloat16;
  - `tensorrt/<stage>-<plan digest>.plan` + `.json`: one TensorRT plan per stage, built from an export
    (its sidecar names the export's digest; `tensorrt.PlanCache`), holding the weights again.
Nothing is removed by the engines: each update of the model or of the graphs' code adds an export and its
plans. A *version* here is an export digest with everything built from it. Its last use is the latest
time its export was reused or one of its plans was loaded (each touches its manifest or sidecar; a
read-only cache is not touched, and then its files' write times count).

`prune` removes whole versions: all but the `--keep` most recently used, and with `--unused-days` only
those not used for that long. Within a version it keeps, it removes the plan sets (a version's stage plans
built together: one TensorRT version, builder code, GPU and profile) that a newer set for the same GPU has
replaced (a TensorRT upgrade, a change to tensorrt.py). Plans of a version are removed before its export,
so an interrupted prune leaves an export that the next warmup reuses rather than plans without one.

What a running engine uses is never removed: each engine holds a lease for its version and plan set
(`hold`: a file under `.inuse/` it keeps locked, shared, for its life; the lock goes with the process,
crashed or not). Found in review: ranked by last use alone, a node that loaded its plans days before lost
them to a prune after a developer ran another model, and rebuilt them at its next restart. Staging files
of writers still at work are never touched (hidden names; those of dead writers go as the engines remove
them, `remove_dead_writers_leftovers`). Entries that are neither (other files someone put there) are
listed and kept.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from rmuscle_ros.engine import onnx_export
from rmuscle_ros.models.config import PRESETS

log = logging.getLogger(__name__)

EXPORTS, PLANS = "onnx", "tensorrt"
EXPORT_NAME = re.compile(r"^[0-9a-f]{16}$")  # onnx_export.ExportKey.digest()
PLAN_NAME = re.compile(r"^(?P<stage>[a-z_]+)-(?P<digest>[0-9a-f]{20})\.plan$")  # tensorrt.PlanCache.path
UNKNOWN = "?"  # the version of a plan whose sidecar cannot be read
INUSE = ".inuse"  # engines' leases: <export digest>.<plan set or EXPORT_ONLY>.<pid>, each locked while held
EXPORT_ONLY = "export"  # the plan set of a lease on the export alone (the onnxruntime backend)
# A newer plan set replaces an older one of its version built for the same GPU and profile (so another
# TensorRT, builder code or plan format): two profiles or two GPUs sharing the cache keep theirs (found
# in review: grouped by GPU alone, a second launch profile's plans went).
REPLACED_WITHIN = ("gpu", "capability", "opt_prompt_len", "workspace_bytes")


def plan_set(key: Mapping[str, Any]) -> str:
    """A plan set's id: its plans' key without the stage (tensorrt.PlanKey as a dict), so that the three
    stage plans built together share it, and a rebuild with another TensorRT, builder or profile does not."""
    rest = {k: v for k, v in key.items() if k != "stage"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _cache_lock(cache_dir: str | Path, exclusive: bool) -> Iterator[bool]:
    """`.inuse/.lock`, held shared while an engine takes its lease and exclusively while leases are read
    and stale ones removed (and by `prune` until it is done), so that no lease is taken, or removed,
    halfway (found in review: two scans, or a scan and a lease being taken, could drop a live lease).
    Yields False where the folder cannot be written (nothing is locked then)."""
    folder = Path(cache_dir) / INUSE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".lock", os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:  # a file system without locks (ENOLCK)
            yield False
            return
        yield True
    finally:
        os.close(fd)


def hold(cache_dir: str | Path, export: str, plans: str = EXPORT_ONLY) -> TextIO | None:
    """Lease `export`'s version (and plan set `plans`) for as long as the returned file stays open (the
    engine keeps it): `prune` leaves what a lease names. None where the cache cannot be written (a
    read-only volume; nothing can prune it either), logged. The cache's folder must be on a local file
    system (flock; NFS emulates it per process)."""
    folder = Path(cache_dir) / INUSE
    path = folder / f"{export}.{plans}.{os.getpid()}"
    with _cache_lock(cache_dir, exclusive=False) as locked:
        if locked:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
                fcntl.flock(fd, fcntl.LOCK_SH)  # released when the file closes, or the process ends
                return os.fdopen(fd)
            except OSError as e:
                error: OSError | None = e
        else:
            error = None
    log.info("engine cache: cannot lease %s in %s (%s): prune may remove it", export, folder, error)
    return None


def leases(cache_dir: str | Path) -> set[tuple[str, str]]:
    """(export digest, plan set) of every lease a live process holds; the marks of processes gone (their
    locks went with them) are removed. Under the cache's lock (`exclusive`), taken here."""
    with exclusive(cache_dir):
        return _leases(cache_dir)


def exclusive(cache_dir: str | Path) -> contextlib.AbstractContextManager[bool]:
    """The cache's lock, exclusively: no engine takes a lease meanwhile (prune holds it while it runs)."""
    return _cache_lock(cache_dir, exclusive=True)


def _leases(cache_dir: str | Path) -> set[tuple[str, str]]:
    folder, held = Path(cache_dir) / INUSE, set()
    for entry in sorted(folder.iterdir()) if folder.is_dir() else ():
        parts = entry.name.split(".")
        if len(parts) != 3 or entry.is_symlink():
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:  # another user's lease, say: kept, and its version with it
            log.warning("engine cache: lease %s unreadable (%s): taken as held", entry, e)
            held.add((parts[0], parts[1]))
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            entry.unlink(missing_ok=True)  # its process is gone; no lease is taken while we hold the lock
        except BlockingIOError:
            held.add((parts[0], parts[1]))
        except OSError as e:  # no locks here, or a read-only folder: kept, and counted as held
            log.warning("engine cache: lease %s not checked (%s): taken as held", entry, e)
            held.add((parts[0], parts[1]))
        finally:
            os.close(fd)
    return held


@dataclass
class Version:
    """One export digest and what was built from it."""

    export: str  # the export's digest, or UNKNOWN for plans whose sidecar cannot be read
    export_dir: Path | None = None
    plans: list[Path] = field(default_factory=list)  # .plan files; each sidecar beside it
    # plan set (plan_set) -> its plans, their last use, and what a newer set must share to replace it
    # (REPLACED_WITHIN's values)
    plan_sets: dict[str, tuple[list[Path], float, str]] = field(default_factory=dict)
    bytes: int = 0
    last_used: float = 0.0  # seconds since the epoch
    about: str = ""  # the model, as the export's manifest or a plan's sidecar says

    def paths(self) -> list[Path]:
        """What pruning this version removes, in order: plans and sidecars, then the export."""
        out = [p for plan in self.plans for p in (plan, plan.with_suffix(".json"))]
        return out + ([self.export_dir] if self.export_dir is not None else [])


@dataclass
class Contents:
    versions: list[Version]  # most recently used first
    other: list[Path]  # entries that are neither an export nor a plan: kept


def _size(path: Path) -> int:
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir())
        return path.lstat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _preset_of(config: object) -> str:
    """The preset whose config the export's key holds, else "another config"."""
    for name, preset in PRESETS.items():
        if json.loads(json.dumps(preset.to_dict())) == config:
            return name
    return "another config"


def _describe_export(manifest: dict | None) -> str:
    if manifest is None:
        return "no readable manifest"
    key = manifest.get("key") if isinstance(manifest.get("key"), dict) else {}
    weights, code = str(key.get("weights", "?")).removeprefix("sha256:")[:12], str(key.get("code", "?"))[:8]
    return f"{_preset_of(key.get('config'))} {key.get('dtype', '?')}, weights {weights}, graphs' code {code}"


def scan(cache_dir: str | Path) -> Contents:
    """Every version under `cache_dir` (most recently used first), and the entries that are neither."""
    root = Path(cache_dir)
    versions: dict[str, Version] = {}
    other: list[Path] = []

    def version(digest: str) -> Version:
        return versions.setdefault(digest, Version(digest))

    exports = root / EXPORTS
    for entry in sorted(exports.iterdir()) if exports.is_dir() else ():
        if entry.name.startswith("."):  # a writer's staging (onnx_export.ensure_export): not ours to touch
            continue
        if not (EXPORT_NAME.match(entry.name) and entry.is_dir() and not entry.is_symlink()):
            other.append(entry)
            continue
        v = version(entry.name)
        v.export_dir = entry
        manifest_path = entry / onnx_export.MANIFEST
        v.about = _describe_export(_read_json(manifest_path))
        v.bytes += _size(entry)
        v.last_used = max(v.last_used, _mtime(manifest_path) or _mtime(entry))
    plans = root / PLANS
    for entry in sorted(plans.iterdir()) if plans.is_dir() else ():
        if entry.name.startswith(".") or (entry.suffix == ".json" and entry.with_suffix(".plan").exists()):
            continue  # staging files; sidecars go with their plan
        orphan = entry.with_suffix(".plan")
        if entry.suffix == ".json" and PLAN_NAME.match(orphan.name) and entry.is_file():
            # A sidecar whose plan is gone (a prune interrupted between the two; a store writes the plan
            # first): nothing loads it. Pruned as a plan without a readable sidecar is, after the quiet
            # period (found in review: listed as another file and kept for good).
            v = version(UNKNOWN)
            v.plans.append(orphan)
            v.bytes += _size(entry)
            v.last_used = max(v.last_used, _mtime(entry))
            v.about = v.about or "sidecars of plans that are gone"
            continue
        match = PLAN_NAME.match(entry.name)
        if match is None or not entry.is_file():
            other.append(entry)
            continue
        sidecar = _read_json(entry.with_suffix(".json"))
        key = sidecar.get("key") if sidecar is not None and isinstance(sidecar.get("key"), dict) else None
        export = key.get("export") if key is not None else None
        v = version(export if isinstance(export, str) and EXPORT_NAME.match(export) else UNKNOWN)
        v.plans.append(entry)
        v.bytes += _size(entry) + _size(entry.with_suffix(".json"))
        used = _mtime(entry.with_suffix(".json")) or _mtime(entry)
        v.last_used = max(v.last_used, used)
        if key is not None:
            members, last, gpu = v.plan_sets.get(
                plan_set(key), ([], 0.0, json.dumps([key.get(f) for f in REPLACED_WITHIN]))
            )
            v.plan_sets[plan_set(key)] = ([*members, entry], max(last, used), gpu)
        if not v.about and key is not None:
            v.about = f"TensorRT {key.get('tensorrt', '?')} on {key.get('gpu', '?')}"
    ordered = sorted(versions.values(), key=lambda v: (v.last_used, v.export), reverse=True)
    return Contents(ordered, other)


def to_prune(
    contents: Contents,
    keep: int,
    unused_days: float | None = None,
    now: float | None = None,
    held: Collection[tuple[str, str]] = (),
) -> list[Version]:
    """What `prune` removes: the versions all but the `keep` most recently used, and with `unused_days`
    only those not used for that long; in each version kept, the plan sets a newer set for the same GPU
    and profile replaced (REPLACED_WITHIN; as Versions with those plans only); and plans whose sidecar cannot be read, an hour after
    their last write. Nothing a lease in `held` (leases()) names: not its version, not its plan set."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    if unused_days is not None and not unused_days >= 0:
        raise ValueError(f"unused_days must be >= 0, got {unused_days}")
    now = time.time() if now is None else now

    def unused(last_used: float) -> bool:
        return unused_days is None or now - last_used >= unused_days * 86400.0

    leased = {export for export, _ in held}
    known = [v for v in contents.versions if v.export != UNKNOWN]
    old = [v for v in known[keep:] if v.export not in leased and unused(v.last_used)]
    replaced = []
    for v in known:
        if any(v is o for o in old):
            continue
        newest: dict[str, float] = {}
        for _, last, gpu in v.plan_sets.values():
            newest[gpu] = max(newest.get(gpu, 0.0), last)
        stale = [
            plan
            for set_id, (plans, last, gpu) in sorted(v.plan_sets.items())
            if last < newest[gpu] and (v.export, set_id) not in held and unused(last)
            for plan in plans
        ]
        if stale:
            replaced.append(Version(
                v.export, plans=stale, bytes=sum(_size(p) + _size(p.with_suffix(".json")) for p in stale),
                last_used=v.last_used, about="plans another set replaced (the export stays)",
            ))  # fmt: skip
    # Plans without a readable sidecar are never loaded (a rebuild writes over them); the quiet period
    # spares a plan whose sidecar is being renamed into place right now (PlanCache.store).
    unknown = [v for v in contents.versions if v.export == UNKNOWN]
    return old + replaced + [v for v in unknown if now - v.last_used >= onnx_export.LEFTOVER_QUIET_S]


def prune(versions: Sequence[Version]) -> tuple[int, list[str]]:
    """Remove `versions` (plans first, then the export). Returns the bytes freed and what could not be
    removed (each named, with why); the rest goes on."""
    freed, failed = 0, []
    for v in versions:
        for path in v.paths():
            size = _size(path)
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError as err:
                failed.append(f"{path}: {err}")
                continue
            freed += size
    return freed, failed


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "never"


def _table(versions: Sequence[Version], held: Collection[tuple[str, str]] = ()) -> list[str]:
    leased = {export for export, _ in held}
    lines = []
    for v in versions:
        stages = ", ".join(sorted({PLAN_NAME.match(p.name)["stage"] for p in v.plans})) or "none"  # type: ignore[index]
        sets = f"{len(v.plan_sets)} plan set(s)" if len(v.plan_sets) > 1 else "plans"
        export = "export" if v.export_dir is not None else "no export"
        use = ", in use by a running engine" if v.export in leased else ""
        lines.append(
            f"  {v.export}  last used {_when(v.last_used)}{use}  {_gb(v.bytes):>9}  {export}; {sets}: {stages}"
            f"  ({v.about})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rmuscle_ros.engine.engine_cache",
        description="List or prune the ONNX exports and TensorRT plans under engine_cache_dir.",
    )
    p.add_argument("--cache-dir", default=str(onnx_export.default_cache_dir()), help="engine_cache_dir")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="each model version: its export, plans, size and last use")
    pr = sub.add_parser("prune", help="remove all but the most recently used versions")
    pr.add_argument("--keep", type=int, default=1, help="most recently used versions kept (default 1)")
    pr.add_argument("--unused-days", type=float, help="remove only versions unused for this many days")
    pr.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    args = p.parse_args(argv)
    root = Path(args.cache_dir)
    if not root.is_dir():
        print(f"{root}: no such folder (engine_cache_dir); nothing cached", file=sys.stderr)
        return 1 if args.command == "prune" else 0
    if args.command == "list":
        contents, held = scan(root), leases(root)
        total = sum(v.bytes for v in contents.versions)
        print(f"{root}: {len(contents.versions)} version(s), {_gb(total)} (most recently used first)")
        print("\n".join(_table(contents.versions, held)))
        for path in contents.other:
            print(f"  not an export or a plan, kept: {path}")
        return 0
    if args.keep < 0:
        p.error(f"keep must be >= 0, got {args.keep}")
    # Under the cache's lock from reading the leases to the last removal: an engine starting meanwhile
    # waits to take its lease (found in review: one that took it after the read lost its plans).
    with exclusive(root) as locked:
        if not locked:
            print(
                f"{root}: cannot take {root / INUSE / '.lock'} (a read-only cache?); nothing removed",
                file=sys.stderr,
            )
            return 1
        contents, held = scan(root), _leases(root)
        try:
            old = to_prune(contents, args.keep, args.unused_days, held=held)
        except ValueError as err:
            p.error(str(err))
        kept = [v for v in contents.versions if not any(v is o for o in old)]
        print(f"{root}: keeping {len(kept)} version(s)")
        print("\n".join(_table(kept, held)))
        verb = "would remove" if args.dry_run else "removing"
        print(f"{verb} {len(old)} version(s) or plan set(s), {_gb(sum(v.bytes for v in old))}")
        print("\n".join(_table(old)))
        if not args.dry_run:  # what writers killed mid-write left (found in review: only an export or a
            # plan's store removed them, and none comes once the export is made, so 6.5 GB stayed)
            gone = [
                e for sub in (EXPORTS, PLANS) for e in onnx_export.remove_dead_writers_leftovers(root / sub)
            ]
            if gone:
                print(
                    f"removed {len(gone)} leftover(s) of writers that are gone: {', '.join(e.name for e in gone)}"
                )
        if args.dry_run or not old:
            return 0
        freed, failed = prune(old)
    print(f"freed {_gb(freed)}")
    for problem in failed:
        print(f"could not remove {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
