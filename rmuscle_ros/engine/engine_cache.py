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
those not used for that long. Plans of a version are removed before its export, so an interrupted prune
leaves an export that the next warmup reuses rather than plans without one. A running engine is not
affected (it holds its plans in memory), and staging files of writers still at work are never touched
(hidden names; those of dead writers go as the engines remove them, `remove_dead_writers_leftovers`).
Entries that are neither (other files someone put there) are listed and kept.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rmuscle_ros.engine import onnx_export
from rmuscle_ros.models.config import PRESETS

log = logging.getLogger(__name__)

EXPORTS, PLANS = "onnx", "tensorrt"
EXPORT_NAME = re.compile(r"^[0-9a-f]{16}$")  # onnx_export.ExportKey.digest()
PLAN_NAME = re.compile(r"^(?P<stage>[a-z_]+)-(?P<digest>[0-9a-f]{20})\.plan$")  # tensorrt.PlanCache.path
UNKNOWN = "?"  # the version of a plan whose sidecar cannot be read


@dataclass
class Version:
    """One export digest and what was built from it."""

    export: str  # the export's digest, or UNKNOWN for plans whose sidecar cannot be read
    export_dir: Path | None = None
    plans: list[Path] = field(default_factory=list)  # .plan files; each sidecar beside it
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
        v.last_used = max(v.last_used, _mtime(entry.with_suffix(".json")) or _mtime(entry))
        if not v.about and key is not None:
            v.about = f"TensorRT {key.get('tensorrt', '?')} on {key.get('gpu', '?')}"
    ordered = sorted(versions.values(), key=lambda v: (v.last_used, v.export), reverse=True)
    return Contents(ordered, other)


def to_prune(
    contents: Contents, keep: int, unused_days: float | None = None, now: float | None = None
) -> list[Version]:
    """The versions `prune` removes: all but the `keep` most recently used, and with `unused_days` only
    those not used for that long; and plans whose sidecar cannot be read, an hour after their last write."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    if unused_days is not None and not unused_days >= 0:
        raise ValueError(f"unused_days must be >= 0, got {unused_days}")
    now = time.time() if now is None else now
    known = [v for v in contents.versions if v.export != UNKNOWN]
    old = known[keep:]
    if unused_days is not None:
        old = [v for v in old if now - v.last_used >= unused_days * 86400.0]
    # Plans without a readable sidecar are never loaded (a rebuild writes over them); the quiet period
    # spares a plan whose sidecar is being renamed into place right now (PlanCache.store).
    unknown = [v for v in contents.versions if v.export == UNKNOWN]
    return old + [v for v in unknown if now - v.last_used >= onnx_export.LEFTOVER_QUIET_S]


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


def _table(versions: Sequence[Version]) -> list[str]:
    lines = []
    for v in versions:
        stages = ", ".join(sorted(PLAN_NAME.match(p.name)["stage"] for p in v.plans)) or "none"  # type: ignore[index]
        export = "export" if v.export_dir is not None else "no export"
        lines.append(
            f"  {v.export}  last used {_when(v.last_used)}  {_gb(v.bytes):>9}  {export}; plans: {stages}  ({v.about})"
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
    contents = scan(root)
    if args.command == "list":
        total = sum(v.bytes for v in contents.versions)
        print(f"{root}: {len(contents.versions)} version(s), {_gb(total)} (most recently used first)")
        print("\n".join(_table(contents.versions)))
        for path in contents.other:
            print(f"  not an export or a plan, kept: {path}")
        return 0
    try:
        old = to_prune(contents, args.keep, args.unused_days)
    except ValueError as err:
        p.error(str(err))
    kept = [v for v in contents.versions if v not in old]
    print(f"{root}: keeping {len(kept)} version(s)")
    print("\n".join(_table(kept)))
    verb = "would remove" if args.dry_run else "removing"
    print(f"{verb} {len(old)} version(s), {_gb(sum(v.bytes for v in old))}")
    print("\n".join(_table(old)))
    if args.dry_run or not old:
        return 0
    freed, failed = prune(old)
    print(f"freed {_gb(freed)}")
    for problem in failed:
        print(f"could not remove {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
