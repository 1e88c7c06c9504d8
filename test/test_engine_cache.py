"""`python -m rmuscle_ros.engine.engine_cache`: what engine_cache_dir holds, and pruning old model versions.

Plans are written by the real `PlanCache.store` (TensorRT is not needed to store bytes); exports are
folders with a manifest as `onnx_export.export_model` writes it (the ONNX files are stand-in bytes: a
real export is `test_onnx_export.py`'s, which checks that reusing one marks it used).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rmuscle_ros.engine import engine_cache, onnx_export
from rmuscle_ros.engine.tensorrt import PlanCache, PlanKey
from rmuscle_ros.models.config import get_preset

DAY = 86400.0


def _export(cache: Path, digest: str, preset: str, mtime: float, size: int = 1000) -> Path:
    folder = cache / "onnx" / digest
    folder.mkdir(parents=True)
    (folder / "vision.onnx.data").write_bytes(b"w" * size)
    key = {"config": get_preset(preset).to_dict(), "dtype": "bfloat16", "weights": "f" * 64, "code": "c" * 64}
    (folder / onnx_export.MANIFEST).write_text(json.dumps({"key": key, "digest": digest, "files": {}}))
    os.utime(folder / onnx_export.MANIFEST, (mtime, mtime))
    return folder


def _plans(cache: Path, export: str, mtime: float, size: int = 500) -> list[Path]:
    store, out = PlanCache(cache / "tensorrt"), []
    for stage in ("vision", "prefill", "denoise"):
        key = PlanKey(2, export, stage, "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16)
        plan = store.store(key, b"p" * size, 1.0)
        os.utime(plan.with_suffix(".json"), (mtime, mtime))
        out.append(plan)
    return out


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """Three versions used 40, 10 and 0 days ago (the newest has no export: its plans were built and the
    export pruned, or the export removed by hand), a plan whose sidecar is gone, a file someone left and
    a writer's staging file."""
    now = time.time()
    root = tmp_path / "engines"
    _export(root, "a" * 16, "tiny", now - 40 * DAY)
    _plans(root, "a" * 16, now - 41 * DAY)
    _export(root, "b" * 16, "pi05", now - 12 * DAY)
    _plans(root, "b" * 16, now - 10 * DAY)
    _plans(root, "c" * 16, now)
    orphan = PlanCache(root / "tensorrt").store(
        PlanKey(2, "d" * 16, "vision", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16), b"x", 1.0
    )
    orphan.with_suffix(".json").unlink()
    os.utime(orphan, (now - 2 * DAY, now - 2 * DAY))
    (root / "onnx" / "notes.txt").write_text("the cell's notes")
    (root / "tensorrt" / f".prefill-{'e' * 20}.plan.{os.getpid()}.tmp").write_bytes(b"half")
    return root


def test_each_version_is_listed_with_its_plans_size_and_last_use(cache: Path) -> None:
    contents = engine_cache.scan(cache)
    assert [v.export for v in contents.versions] == ["c" * 16, engine_cache.UNKNOWN, "b" * 16, "a" * 16]
    c, unknown, b, a = contents.versions
    assert c.export_dir is None and len(c.plans) == 3 and c.about == "TensorRT 10.13.0 on NVIDIA Thor"
    assert b.export_dir == cache / "onnx" / ("b" * 16) and len(b.plans) == 3
    assert b.about.startswith("pi05 bfloat16, weights ffffffffffff")
    assert a.about.startswith("tiny bfloat16") and a.last_used == pytest.approx(
        time.time() - 40 * DAY, abs=60
    )
    # The newest of its export's and its plans' marks: b's plans were loaded 10 days ago.
    assert b.last_used == pytest.approx(time.time() - 10 * DAY, abs=60)
    assert b.bytes > 1000 + 3 * 500 and len(unknown.plans) == 1
    assert contents.other == [cache / "onnx" / "notes.txt"], "kept, named; staging files are not listed"


def test_prune_keeps_the_most_recently_used_and_removes_the_rest_plans_first(cache: Path) -> None:
    contents = engine_cache.scan(cache)
    old = engine_cache.to_prune(contents, keep=1)
    assert [v.export for v in old] == ["b" * 16, "a" * 16, engine_cache.UNKNOWN]
    assert old[0].paths()[-1] == cache / "onnx" / ("b" * 16), "the export goes last"
    assert [v.export for v in engine_cache.to_prune(contents, keep=1, unused_days=30)] == [
        "a" * 16,
        engine_cache.UNKNOWN,
    ]
    assert [v.export for v in engine_cache.to_prune(contents, keep=3)] == [engine_cache.UNKNOWN]
    with pytest.raises(ValueError, match="keep must be >= 0"):
        engine_cache.to_prune(contents, keep=-1)

    freed, failed = engine_cache.prune(old)
    assert failed == [] and freed == sum(v.bytes for v in old)
    left = engine_cache.scan(cache)
    assert [v.export for v in left.versions] == ["c" * 16] and len(left.versions[0].plans) == 3
    assert sorted(p.name for p in (cache / "onnx").iterdir()) == ["notes.txt"]
    assert len(list((cache / "tensorrt").glob(".*.tmp"))) == 1, "a writer's staging file is not ours"
    # What is kept still loads: the sidecars beside the plans, untouched.
    key = PlanKey(2, "c" * 16, "prefill", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16)
    assert PlanCache(cache / "tensorrt").load(key) == b"p" * 500


def test_a_plans_load_marks_its_version_used(cache: Path) -> None:
    """PlanCache.load touches the sidecar, so a version in use is the most recent one and is kept."""
    key = PlanKey(2, "a" * 16, "denoise", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16)
    assert PlanCache(cache / "tensorrt").load(key) == b"p" * 500
    versions = engine_cache.scan(cache).versions
    assert versions[0].export == "a" * 16 and versions[0].last_used == pytest.approx(time.time(), abs=60)


def test_the_command_line_lists_dry_runs_and_prunes(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert engine_cache.main(["--cache-dir", str(cache), "list"]) == 0
    out = capsys.readouterr().out
    assert (
        f"{cache}: 4 version(s)" in out
        and "tiny bfloat16" in out
        and "plans: denoise, prefill, vision" in out
    )
    assert f"not an export or a plan, kept: {cache / 'onnx' / 'notes.txt'}" in out

    assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove 2 version(s)" in out and len(engine_cache.scan(cache).versions) == 4

    assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert "removing 2 version(s)" in out and "freed" in out
    assert [v.export for v in engine_cache.scan(cache).versions] == ["c" * 16, "b" * 16]

    with pytest.raises(SystemExit):
        engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "-1"])
    assert "keep must be >= 0" in capsys.readouterr().err
    missing = cache.parent / "nowhere"
    assert engine_cache.main(["--cache-dir", str(missing), "prune"]) == 1
    assert "no such folder (engine_cache_dir)" in capsys.readouterr().err


def test_what_cannot_be_removed_is_named_and_the_rest_goes(cache: Path, monkeypatch) -> None:
    old = engine_cache.to_prune(engine_cache.scan(cache), keep=1)
    stuck = old[0].plans[0]
    unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == stuck:
            raise PermissionError(13, "Permission denied")
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    freed, failed = engine_cache.prune(old)
    assert failed == [f"{stuck}: [Errno 13] Permission denied"] and freed > 0
    assert stuck.exists() and not (cache / "onnx" / ("a" * 16)).exists()


def test_what_a_running_engine_leases_is_kept_however_old(cache: Path) -> None:
    """A node that loaded its plans 40 days ago and runs on: its lease (engine_cache.hold, a file locked
    for the engine's life) keeps its version from the prune (found in review: ranked by last use alone, it
    went once a developer ran another model). A lease whose process is gone (a crash) is cleared."""
    import subprocess
    import sys

    lease = engine_cache.hold(cache, "a" * 16)
    assert lease is not None
    held = engine_cache.leases(cache)
    assert held == {("a" * 16, engine_cache.EXPORT_ONLY)}
    old = engine_cache.to_prune(engine_cache.scan(cache), keep=1, held=held)
    assert "a" * 16 not in [v.export for v in old] and "b" * 16 in [v.export for v in old]
    lease.close()
    assert engine_cache.leases(cache) == set()
    assert [p.name for p in (cache / engine_cache.INUSE).iterdir()] == [".lock"], "the mark went with it"

    # While a prune holds the cache's lock, an engine's lease waits for it (so no prune reads the leases,
    # then removes what a lease taken after that names).
    import threading

    taken: list[object] = []
    with engine_cache.exclusive(cache):
        waiting = threading.Thread(target=lambda: taken.append(engine_cache.hold(cache, "c" * 16)))
        waiting.start()
        waiting.join(timeout=0.3)
        assert waiting.is_alive() and not taken
    waiting.join(timeout=10)
    assert (
        taken
        and taken[0] is not None
        and engine_cache.leases(cache) == {("c" * 16, engine_cache.EXPORT_ONLY)}
    )
    taken[0].close()  # type: ignore[attr-defined]
    # A stale lease that cannot be removed (a read-only volume) is kept and counted, not an error.
    stale = engine_cache.hold(cache, "e" * 16)
    assert stale is not None
    stale.close()
    unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith("e" * 16):
            raise PermissionError(30, "Read-only file system")
        unlink(self, missing_ok=missing_ok)

    Path.unlink = refuse  # type: ignore[method-assign]
    try:
        assert engine_cache.leases(cache) == {("e" * 16, engine_cache.EXPORT_ONLY)}
    finally:
        Path.unlink = unlink  # type: ignore[method-assign]
    assert engine_cache.leases(cache) == set()
    # A link planted in the leases' folder is not followed (nothing outside the cache is created).
    (cache / engine_cache.INUSE / f"{'d' * 16}.export.1").symlink_to(cache.parent / "elsewhere")
    assert engine_cache.leases(cache) == set() and not (cache.parent / "elsewhere").exists()

    # Another process's lease, then that process killed: held while it lives, cleared after.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rmuscle_ros.engine import engine_cache as c; "
         "l = c.hold(sys.argv[1], 'b' * 16, 'abc'); print('held', flush=True); time.sleep(60)", str(cache)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert engine_cache.leases(cache) == {("b" * 16, "abc")}
    finally:
        holder.kill()
        holder.wait()
    assert engine_cache.leases(cache) == set()


def test_a_plan_set_a_newer_one_replaced_goes_and_the_rest_of_its_version_stays(cache: Path) -> None:
    """A TensorRT upgrade (or a change to tensorrt.py) builds a new plan set under the same export; the
    old set is never loaded again. Prune removes it from the version it keeps (found in review: only
    whole versions went, so the old plans stayed as long as the export), unless a lease names it; a set
    for another GPU is not replaced by this one's."""
    store = PlanCache(cache / "tensorrt")
    now = time.time()

    def build(tensorrt: str, gpu: str, age_days: float) -> list[Path]:
        out = []
        for stage in ("vision", "prefill", "denoise"):
            key = PlanKey(2, "c" * 16, stage, tensorrt, gpu, "11.0", 64, 1 << 32, "b" * 16)
            plan = store.store(key, b"q" * 100, 1.0)
            os.utime(plan.with_suffix(".json"), (now - age_days * DAY, now - age_days * DAY))
            out.append(plan)
        return out

    upgraded = build("10.3.0", "NVIDIA Thor", 90)  # before the JetPack upgrade
    other_gpu = build("10.3.0", "NVIDIA RTX 4090", 90)
    contents = engine_cache.scan(cache)
    c = contents.versions[0]
    assert c.export == "c" * 16 and len(c.plan_sets) == 3
    old = engine_cache.to_prune(contents, keep=3)
    replaced = [v for v in old if v.export == "c" * 16]
    assert len(replaced) == 1 and sorted(replaced[0].plans) == sorted(upgraded)
    assert replaced[0].export_dir is None, "the export stays"
    set_id = engine_cache.plan_set(json.loads(upgraded[0].with_suffix(".json").read_text())["key"])
    assert not [
        v for v in engine_cache.to_prune(contents, keep=3, held={("c" * 16, set_id)}) if v.export == "c" * 16
    ]
    assert not [v for v in engine_cache.to_prune(contents, keep=3, unused_days=100) if v.export == "c" * 16]
    # Through the command: listed as a plan set replaced, removed, the export and the other sets kept.
    assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "3"]) == 0
    left = engine_cache.scan(cache).versions[0]
    assert len(left.plan_sets) == 2 and all(p.exists() for p in other_gpu)
    assert not any(p.exists() for p in upgraded)

    # Another profile (opt_prompt_len 32) on the same GPU is not a replacement: both sets stay.
    for stage in ("vision", "prefill", "denoise"):
        store.store(
            PlanKey(2, "c" * 16, stage, "10.13.0", "NVIDIA Thor", "11.0", 32, 1 << 32, "b" * 16), b"r", 1.0
        )
    assert not [v for v in engine_cache.to_prune(engine_cache.scan(cache), keep=3) if v.export == "c" * 16]


def test_a_sidecar_whose_plan_is_gone_is_pruned_not_kept_as_another_file(cache: Path) -> None:
    """Found in review: a sidecar left without its plan (a prune interrupted between the two) was listed as
    "not an export or a plan, kept" and never removed. It goes as a plan without a readable sidecar does,
    once quiet (a store writes the plan before its sidecar, so none is being written)."""
    stale = time.time() - 2 * DAY
    plan = PlanCache(cache / "tensorrt").store(
        PlanKey(2, "e" * 16, "denoise", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16), b"y", 1.0
    )
    plan.unlink()
    os.utime(plan.with_suffix(".json"), (stale, stale))
    contents = engine_cache.scan(cache)
    assert contents.other == [cache / "onnx" / "notes.txt"]
    unknown = next(v for v in contents.versions if v.export == engine_cache.UNKNOWN)
    assert plan in unknown.plans
    old = engine_cache.to_prune(contents, keep=3)
    assert [v.export for v in old] == [engine_cache.UNKNOWN]
    _, failed = engine_cache.prune(old)
    assert failed == [] and not plan.with_suffix(".json").exists()


def test_the_command_lines_prune_keeps_what_a_running_engine_leases_and_holds_the_lock_throughout(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node on the Jetson runs on version a (40 days old) while someone types `engine_cache prune`:
    the command reads the leases and keeps a, and holds the cache's lock exclusively until its last
    removal, so no engine takes a lease between the read and the removal. Found by a mutation review: the
    command's own lease read and lock mode were untested (to_prune's were)."""
    import fcntl

    lease = engine_cache.hold(cache, "a" * 16)
    assert lease is not None
    seen: list[str] = []
    remove = engine_cache.prune

    def prune_checking_the_lock(versions):  # an engine's hold() takes the lock shared: it must wait now
        fd = os.open(cache / engine_cache.INUSE / ".lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            seen.append("a lease could be taken mid-prune")
        except BlockingIOError:
            seen.append("locked")
        finally:
            os.close(fd)
        return remove(versions)

    monkeypatch.setattr(engine_cache, "prune", prune_checking_the_lock)
    try:
        assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "1"]) == 0
    finally:
        lease.close()
    assert seen == ["locked"]
    left = [v.export for v in engine_cache.scan(cache).versions]
    assert left == ["c" * 16, "a" * 16], "the leased version stays, the unleased b goes"


def test_the_command_line_says_when_it_cannot_prune(
    cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit status 1, and why, when a file could not be removed (a script or cron job running the prune
    sees the failure), and when the cache's lock cannot be taken (nothing is removed then: the leases of
    running engines cannot be read safely). Found by a mutation review."""
    unlink = Path.unlink
    doomed = next(p for p in (cache / "tensorrt").glob("*.plan") if (
        json.loads(p.with_suffix(".json").read_text())["key"]["export"] == "a" * 16
    ))  # fmt: skip

    def refuse_one(self: Path, missing_ok: bool = False) -> None:
        if self == doomed:
            raise PermissionError(13, "Permission denied")
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse_one)
    assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "2"]) == 1
    assert f"could not remove {doomed}: [Errno 13] Permission denied" in capsys.readouterr().err
    monkeypatch.setattr(Path, "unlink", unlink)

    # The leases' folder cannot be made (here a file sits at its name, as on a read-only volume it
    # cannot be created): nothing is removed.
    for entry in (cache / engine_cache.INUSE).iterdir():
        entry.unlink()
    (cache / engine_cache.INUSE).rmdir()
    (cache / engine_cache.INUSE).write_text("")
    before = [v.export for v in engine_cache.scan(cache).versions]
    assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "1"]) == 1
    assert "nothing removed" in capsys.readouterr().err
    assert [v.export for v in engine_cache.scan(cache).versions] == before


def test_a_plan_whose_sidecar_is_not_written_yet_is_left_and_another_users_lease_is_held(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PlanCache.store renames the plan into place, then its sidecar: a plan without one that was just
    written is a build finishing right now, and stays until the quiet period is over. And a lease this
    user cannot open (another user's engine sharing the cache) is taken as held: its version stays.
    Found by a mutation review."""
    fresh = cache / "tensorrt" / f"denoise-{'f' * 20}.plan"
    fresh.write_bytes(b"being stored")
    old = engine_cache.to_prune(engine_cache.scan(cache), keep=3)
    assert all(fresh not in v.plans for v in old)
    later = time.time() + onnx_export.LEFTOVER_QUIET_S + 60
    old = engine_cache.to_prune(engine_cache.scan(cache), keep=3, now=later)
    assert any(fresh in v.plans for v in old)

    lease = cache / engine_cache.INUSE / f"{'a' * 16}.{engine_cache.EXPORT_ONLY}.4242"
    lease.parent.mkdir(exist_ok=True)
    lease.write_text("")
    open_ = os.open

    def another_users(path, flags, *args):  # running as root here, so a mode cannot refuse it
        if Path(path) == lease:
            raise PermissionError(13, "Permission denied", str(path))
        return open_(path, flags, *args)

    monkeypatch.setattr(os, "open", another_users)
    held = engine_cache.leases(cache)
    assert held == {("a" * 16, engine_cache.EXPORT_ONLY)} and lease.exists()
    assert "a" * 16 not in [
        v.export for v in engine_cache.to_prune(engine_cache.scan(cache), keep=1, held=held)
    ]


def test_keep_zero_prunes_every_version_no_engine_leases(cache: Path) -> None:
    """`prune --keep 0` empties the cache of everything not in use (a full disk on the Jetson); a running
    engine's version stays. Found by a mutation review (keep 0 was untested)."""
    lease = engine_cache.hold(cache, "c" * 16)
    assert lease is not None
    try:
        assert engine_cache.main(["--cache-dir", str(cache), "prune", "--keep", "0"]) == 0
    finally:
        lease.close()
    assert [v.export for v in engine_cache.scan(cache).versions] == ["c" * 16]


def test_the_names_the_engines_write_are_the_names_prune_reads() -> None:
    """An export's folder (ExportKey.digest) and a plan's file (PlanCache.path) are named as scan expects
    (EXPORT_NAME, PLAN_NAME): otherwise exports would be listed as other files and kept for good, and
    plans taken for ones without a readable sidecar, pruned an hour after they were built, leases or not.
    Found by a mutation review: a 15-digit export digest passed the suite."""
    digest = onnx_export.export_key(get_preset("tiny"), "sha256:w", "bfloat16").digest()
    assert engine_cache.EXPORT_NAME.match(digest)
    key = PlanKey(2, digest, "prefill", "10.13.0", "NVIDIA Thor", "11.0", 64, 1 << 32, "b" * 16)
    assert engine_cache.PLAN_NAME.match(PlanCache(Path("/cache")).path(key).name)
