"""rMuscle reference library (persistence) and retrieval/alignment, on CPU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import SafetensorError

from rmuscle_ros.cache.library import (
    Episode,
    LibraryError,
    LibraryKey,
    LibraryMismatch,
    RecordingFailed,
    ReferenceLibrary,
)
from rmuscle_ros.cache.retrieval import RetrievalConfig, Retriever

KEY = LibraryKey(
    weights="abc123", shapes={"cameras": 2, "descriptor_dim": 8, "image_size": 16, "max_tokens": 12}
)


def episode(calls: int = 5, seed: int = 0, masks: bool = True) -> Episode:
    rng = np.random.default_rng(seed)
    return Episode(
        descriptors=rng.standard_normal((calls, 2, 8)).astype(np.float32),
        images=rng.integers(0, 256, (calls, 2, 16, 16, 3), dtype=np.uint8),
        tokens=rng.integers(0, 300, (calls, 12)),
        token_mask=np.ones((calls, 12), dtype=bool),
        action_masks=rng.integers(0, 64, (calls, 3, 2, 32)).astype(np.int16) if masks else None,
    )


def test_round_trip(tmp_path: Path) -> None:
    lib = ReferenceLibrary.open(tmp_path, KEY)
    ids = [lib.add(episode(seed=s), {"prompt": "fold"}) for s in range(3)]
    lib.close()
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.entries) == ids and again.problems == []
    loaded, original = again.load(ids[1]), episode(seed=1)
    for name in ("descriptors", "images", "tokens", "token_mask", "action_masks"):
        assert np.array_equal(getattr(loaded, name), getattr(original, name)), name
    assert again.entries[ids[0]].meta == {"prompt": "fold"}


def test_one_call_is_read_without_the_rest_of_its_episode(tmp_path: Path) -> None:
    """A window entry's rebuild reads one call (load_call): the same rows as the whole episode's, with or
    without the optional tensors; a call the episode lacks, or a file damaged since open, says so."""
    from rmuscle_ros.cache.library import EpisodeUnreadable

    lib = ReferenceLibrary.open(tmp_path, KEY)
    cameras = dataclasses.replace(episode(seed=3), image_masks=np.arange(10).reshape(5, 2) % 3 != 0)
    with_masks, without = lib.add(episode(seed=1), {}), lib.add(episode(seed=2, masks=False), {})
    with_cameras = lib.add(cameras, {})  # a camera missing in some calls: image_masks (bool) in the file
    assert lib.load(with_cameras).image_masks is not None
    for episode_id in (with_masks, without, with_cameras):
        whole = lib.load(episode_id)
        for call in (0, 4):
            row = lib.load_call(episode_id, call)
            assert row.calls == 1 and (row.action_masks is None) == (whole.action_masks is None)
            for name in ("descriptors", "images", "tokens", "token_mask", "action_masks", "image_masks"):
                got, want = getattr(row, name), getattr(whole, name)
                assert (got is None and want is None) or np.array_equal(got[0], want[call]), name
    with pytest.raises(IndexError, match="episode 0 has 5 calls: no call 5"):
        lib.load_call(with_masks, 5)
    (tmp_path / lib.entries[with_masks].file).write_bytes(b"overwritten")
    with pytest.raises(EpisodeUnreadable, match=r"episode 0: .* could not be read"):
        lib.load_call(with_masks, 0)


def test_each_file_and_its_rename_reach_the_disk_before_the_index_names_it(
    tmp_path: Path, monkeypatch
) -> None:
    """A cell can lose power mid-write: the episode file, then the folder (its rename), are fsynced before
    the index that names the episode is written, and the index's own rename is fsynced too."""
    import os

    from rmuscle_ros.cache import library as library_module

    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(library_module.os, "fsync", spy)
    lib = ReferenceLibrary.open(tmp_path, KEY)
    synced.clear()  # the open marker's
    lib.add(episode())
    names = [Path(p).name for p in synced]
    episode_file, folder = names.index(".episode_000000.safetensors.tmp-" + str(os.getpid())), tmp_path.name
    assert names[episode_file + 1] == folder, names  # the episode's rename
    index = next(i for i, n in enumerate(names) if n.startswith(".index.json.tmp-"))
    assert episode_file < index and names[index + 1] == folder and len(names) == index + 2, names


def test_other_weights_are_refused(tmp_path: Path) -> None:
    ReferenceLibrary.open(tmp_path, KEY).add(episode())
    other = LibraryKey(weights="def456", shapes=KEY.shapes)
    with pytest.raises(LibraryMismatch, match="other weights"):
        ReferenceLibrary.open(tmp_path, other)


def test_a_library_keyed_by_an_earlier_builds_sampled_fingerprint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Earlier builds keyed libraries on a fingerprint of sampled weights (16 bare hex digits); the model's
    is now "sha256:…" over every byte, so such a library is refused, saying why and what to do."""
    earlier = LibraryKey(weights="0123456789abcdef", shapes=KEY.shapes)
    ReferenceLibrary.open(tmp_path, earlier).add(episode())
    with pytest.raises(LibraryMismatch, match="earlier build's fingerprint") as e:
        ReferenceLibrary.open(tmp_path, LibraryKey(weights="sha256:0123456789abcdef", shapes=KEY.shapes))
    assert "delete it to record a new library" in str(e.value)
    # what the runtime adds (the setting behind the key) is no advice here: no checkpoint serves it
    advised = str(e.value.with_settings("weights (model.checkpoint)"))
    assert "no setting serves it" in advised and "set them back" not in advised, advised
    from rmuscle_ros.cache.library import main

    for command in ("list", "verify"):  # an operator's check after an upgrade says so too
        assert main([command, str(tmp_path)]) == (1 if command == "verify" else 0)
        assert "an earlier build's fingerprint" in capsys.readouterr().out
    with pytest.raises(LibraryMismatch) as e:
        ReferenceLibrary.open(tmp_path / "other", KEY).add(episode())
        ReferenceLibrary.open(
            tmp_path / "other", LibraryKey(weights="sha256:fedcba9876543210", shapes=KEY.shapes)
        )
    assert "earlier build" not in str(e.value)


def test_other_shapes_are_refused_naming_each_difference(tmp_path: Path) -> None:
    """A library whose shapes differ from the model's (another camera count, masks of another schedule) is
    refused, and the message names each differing field with both values, and only those."""
    ReferenceLibrary.open(tmp_path, KEY).add(episode())
    other = LibraryKey(weights=KEY.weights, shapes={**KEY.shapes, "cameras": 3, "mask_steps": [0, 4]})
    with pytest.raises(LibraryMismatch, match="other shapes") as e:
        ReferenceLibrary.open(tmp_path, other)
    assert e.value.fields == ("cameras", "mask_steps")
    assert "cameras: library 2, model 3; mask_steps: library absent, model [0, 4]" in str(e.value)
    assert "descriptor_dim" not in str(e.value) and "delete it to record a new library" in str(e.value)
    assert len(ReferenceLibrary.open(tmp_path, KEY).entries) == 1, "the refused library is left as it was"


def with_a_corrupt_episode(root: Path) -> tuple[int, int, Path, bytes]:
    """A library of two episodes, the second one's file damaged: (good id, bad id, its file, its bytes)."""
    lib = ReferenceLibrary.open(root, KEY)
    good, bad = lib.add(episode(seed=1)), lib.add(episode(seed=2))
    path = root / lib.entries[bad].file
    damaged = bytearray(path.read_bytes())
    damaged[-10] ^= 0xFF
    path.write_bytes(bytes(damaged))
    return good, bad, path, bytes(damaged)


def test_corrupt_episode_is_reported_and_left_out_not_deleted(tmp_path: Path) -> None:
    good, _, path, _ = with_a_corrupt_episode(tmp_path)
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert list(again.entries) == [good]
    assert any("corrupt" in p for p in again.problems) and path.exists()


def test_a_corrupt_episode_stays_reported_and_its_file_intact_while_the_library_records_on(
    tmp_path: Path,
) -> None:
    """Recording goes on beside a corrupt episode: the index keeps naming it (every open reports it, and
    `remove` can take it out), and no new episode takes its id, whose file would overwrite the evidence."""
    good, bad, path, damaged = with_a_corrupt_episode(tmp_path)
    new = ReferenceLibrary.open(tmp_path, KEY).add(episode(seed=3))
    assert new not in (good, bad) and path.read_bytes() == damaged
    third = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(third.entries) == [good, new] and list(third.left_out) == [bad]
    assert any(f"episode {bad}" in p and "corrupt" in p for p in third.problems)
    assert third.total_bytes == sum(e.bytes for e in third.entries.values()), "the budget counts usable ones"
    third.remove([bad])
    third.close()
    assert not path.exists() and ReferenceLibrary.open(tmp_path, KEY).problems == []


def test_corrupt_index_is_an_error_and_is_kept_when_a_new_library_is_saved(tmp_path: Path) -> None:
    ReferenceLibrary.open(tmp_path, KEY).add(episode())
    (tmp_path / "index.json").write_text('{"version": 1, "key": ')  # a partial write
    with pytest.raises(LibraryError, match="unreadable library index"):
        ReferenceLibrary.open(tmp_path, KEY)
    fresh = ReferenceLibrary(tmp_path, KEY)
    kept = (tmp_path / "episode_000000.safetensors").read_bytes()
    with pytest.raises(LibraryError, match="exists already"):  # its id is the unreadable index's episode's
        fresh.add(episode(seed=3))
    assert (tmp_path / "episode_000000.safetensors").read_bytes() == kept, "never written over"
    assert fresh.add(episode(seed=3)) == 1
    assert list(tmp_path.glob("index.json.corrupt-*")), "the unreadable index was not kept"
    assert json.loads((tmp_path / "index.json").read_text())["version"] == 1


@pytest.mark.parametrize(
    ("malformed", "what"),
    [
        (lambda episodes: episodes[0].pop("sha256"), "missing 1 required positional argument: 'sha256'"),
        (lambda episodes: episodes[0].update(extra=1), "unexpected keyword argument 'extra'"),
        (lambda episodes: episodes.append([1, 2]), "episode entry 1: "),
    ],
    ids=["missing field", "unknown field", "not an object"],
)
def test_an_index_whose_episode_entries_are_malformed_is_a_library_error(
    tmp_path: Path, capsys, malformed, what: str
) -> None:
    """An index that parses as JSON but whose entries are not the library's (edited by hand, another tool)
    is a LibraryError naming the index and the entry, which the node reports and the command line prints;
    never a TypeError from deep inside."""
    from rmuscle_ros.cache.library import main

    ReferenceLibrary.open(tmp_path, KEY).add(episode())
    index = json.loads((tmp_path / "index.json").read_text())
    malformed(index["episodes"])
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match=r"index\.json: unreadable library index") as e:
        ReferenceLibrary.open(tmp_path, KEY)
    assert what in str(e.value)
    for command in ("list", "verify"):
        assert main([command, str(tmp_path)]) == 2
        assert "unreadable library index" in capsys.readouterr().err
    index["episodes"] = {"0": index["episodes"][0]}  # not a list at all
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match="episodes is not a list"):
        ReferenceLibrary.open(tmp_path, KEY)


def test_an_episode_file_that_cannot_be_read_is_left_out_not_fatal(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A bad sector under one episode (EIO on read) costs that episode, as a corrupt one does: open()
    reports it and serves the others, and `verify` names it and exits 1, without a traceback."""
    import errno

    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    good, bad = lib.add(episode(seed=1)), lib.add(episode(seed=2))
    lib.close()
    real_sha256 = library_module._sha256

    def bad_sector(path: Path) -> str:
        if path.name == f"episode_{bad:06d}.safetensors":
            raise OSError(errno.EIO, "Input/output error")
        return real_sha256(path)

    monkeypatch.setattr(library_module, "_sha256", bad_sector)
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert list(again.entries) == [good] and list(again.left_out) == [bad]
    assert again.problems == [
        f"episode {bad}: episode_{bad:06d}.safetensors could not be read ([Errno 5] Input/output error); left out"
    ]
    again.close()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "could not be read" in out and "1 of 2 episode(s) intact" in out


def test_bounded_size_evicts_the_least_recently_used(tmp_path: Path) -> None:
    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=2)
    first, second = lib.add(episode(seed=1)), lib.add(episode(seed=2))
    lib.touch(first)  # served from more recently than `second` (reading it for a refill is no use)
    third = lib.add(episode(seed=3))
    assert sorted(lib.entries) == [first, third]
    assert not list(tmp_path.glob(f"episode_{second:06d}*")), "evicted episode file still on disk"


def test_a_library_evicting_all_day_keeps_no_record_of_files_it_deleted(tmp_path: Path) -> None:
    """Evicted episodes whose files are gone leave nothing behind (found in review: their ids piled up for
    the life of the process, each index write checking every one on disk), and the index lists none."""
    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=2)
    for seed in range(6):
        lib.add(episode(seed=seed))
    assert sorted(lib.entries) == [4, 5] and lib._removed == set()
    # the index is written before the files go: it names only the latest eviction's, still on disk then
    assert json.loads((tmp_path / "index.json").read_text())["removed"] == [3]


def test_retrieval_needs_a_lookahead() -> None:
    """lookahead 0 froze the alignment at the reference's first call (found in review)."""
    with pytest.raises(ValueError, match="lookahead >= 1"):
        RetrievalConfig(lookahead=0)


def test_one_busy_task_evicts_its_own_episodes_not_another_tasks(tmp_path: Path) -> None:
    """A cell that runs one job all day and another now and then: past the bound, the task holding the
    most episodes gives up its least recently used one; the other job keeps its episodes, even older
    ones. Episodes recorded without a task (never served) go before any task's."""
    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=4)
    legacy = lib.add(episode(seed=0))  # no task: from before episodes carried theirs
    towel = lib.add(episode(seed=1), {"task": "fold the towel"})
    cups = [lib.add(episode(seed=s), {"task": "stack the cups"}) for s in (2, 3)]
    assert sorted(lib.entries) == [legacy, towel, *cups]
    cups.append(lib.add(episode(seed=4), {"task": "stack the cups"}))
    assert sorted(lib.entries) == [towel, *cups], "the untasked episode goes first"
    lib.touch(cups[0])  # served from: used more recently than cups[1]
    newest = lib.add(episode(seed=5), {"task": "stack the cups"})
    assert sorted(lib.entries) == [towel, cups[0], cups[2], newest], (
        "the cups' least recently used episode goes, not the towel's older one"
    )
    assert not list(tmp_path.glob(f"episode_{cups[1]:06d}*")), "evicted episode file still on disk"
    # Tasks holding as many episodes: the one whose least recent use is oldest gives one up.
    fair = ReferenceLibrary(tmp_path / "fair", KEY, max_episodes=2)
    a, b = fair.add(episode(seed=6), {"task": "a"}), fair.add(episode(seed=7), {"task": "b"})
    fair.touch(a)
    fair.add(episode(seed=8), {"task": "c"})
    assert a in fair.entries and b not in fair.entries


def test_an_episodes_last_use_survives_a_restart(tmp_path: Path) -> None:
    """Serving from an episode marks it used in memory; closing the library writes that to the index, so
    the next start evicts by the same order."""
    lib = ReferenceLibrary.open(tmp_path, KEY)
    first = lib.add(episode(seed=1), {"task": "t"})
    recorded = lib.entries[first].last_used
    lib.load(first)  # a window refill reads it: not a use (found in review: it was)
    assert lib.entries[first].last_used == recorded
    lib.touch(first)
    used = lib.entries[first].last_used
    assert json.loads((tmp_path / "index.json").read_text())["episodes"][0]["last_used"] < used
    lib.close()
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert again.entries[first].last_used == used
    again.close()


def test_a_full_disk_leaves_the_library_as_it_was_and_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    """A disk that fills mid-recording: the add fails (RecordingFailed, naming the library), the partial file is deleted (it
    would keep holding the space every later recording needs), and the library is as it was."""

    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY)
    kept = lib.add(episode(seed=1), {"task": "t"})
    index_before = (tmp_path / "index.json").read_bytes()

    def full_disk(tensors, filename, metadata=None) -> None:
        Path(filename).write_bytes(b"\0" * 4096)  # part of it reached the disk
        # what safetensors raises on a full disk (found in review: not an OSError)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(library_module, "save_file", full_disk)
    monkeypatch.setattr(ReferenceLibrary, "disk_free_bytes", lambda self: 4096)
    with pytest.raises(RecordingFailed, match="No space left") as failed:
        lib.add(episode(seed=2), {"task": "t"})
    message = str(failed.value)  # names the library, and what makes room
    empty = ReferenceLibrary.open(tmp_path.with_name(f"{tmp_path.name}_empty"), KEY)
    with pytest.raises(RecordingFailed) as nothing_held:  # no bound to lower: the library holds nothing
        empty.add(episode(seed=2), {"task": "t"})
    assert "free space on that disk" in str(nothing_held.value)
    assert "max_library_mb" not in str(nothing_held.value)
    assert (
        message.startswith(f"reference library {tmp_path}:")
        and "free space on that disk" in message
        and "max_library_mb" in message
    ), message
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".lock", ".open", "episode_000000.safetensors", "index.json"
    ]  # fmt: skip
    assert (tmp_path / "index.json").read_bytes() == index_before
    monkeypatch.undo()
    assert sorted(lib.entries) == [kept] and lib.add(episode(seed=3), {"task": "t"}) not in (kept,)
    assert np.array_equal(lib.load(kept).images, episode(seed=1).images)


def test_a_lock_file_of_another_user_in_a_writable_folder_still_locks_and_records(
    tmp_path: Path, monkeypatch
) -> None:
    """A `.lock` left by another user (a `sudo` run of the command line) cannot be opened for writing, but
    the folder can be written: the library opened read-only and recorded nothing (found in review). It now
    takes the lock through a read-only descriptor (flock needs none other) and records; another process is
    still kept out."""
    import errno

    ReferenceLibrary.open(tmp_path, KEY).close()  # the lock file exists
    real_open = os.open

    def not_mine(path, flags, *args, **kwargs):
        if str(path).endswith(".lock") and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", not_mine)
    lib = ReferenceLibrary.open(tmp_path, KEY)
    assert not lib.read_only
    assert lib.add(episode(seed=1), {"task": "t"}) == 0
    script = f"""
import sys
from pathlib import Path
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
from test_cache_library import KEY
from rmuscle_ros.cache.library import LibraryBusy, ReferenceLibrary
try:
    ReferenceLibrary.open(Path({str(tmp_path)!r}), KEY)
except LibraryBusy:
    raise SystemExit(0)
raise SystemExit("opened a library another process holds")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lib.close()
    monkeypatch.undo()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [0]


def test_files_are_not_deleted_while_the_index_dropping_them_may_not_survive_a_power_cut(
    tmp_path: Path, monkeypatch
) -> None:
    """The folder's sync after the index's rename failed: a power cut could bring back the index naming the
    removed episode, whose file was deleted (found in review: deleted anyway). The file stays until the next
    open, which deletes it from the index's `removed`."""
    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(seed=1), {"task": "t"})
    lib.add(episode(seed=2), {"task": "t"})
    monkeypatch.setattr(library_module, "_fsync_dir", lambda folder: False)
    lib.remove([0])
    assert (tmp_path / "episode_000000.safetensors").exists(), "deleted before the index was durable"
    assert json.loads((tmp_path / "index.json").read_text())["removed"] == [0]
    lib.close()
    monkeypatch.undo()
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.entries) == [1] and again.problems == []
    assert not (tmp_path / "episode_000000.safetensors").exists()
    again.close()


@pytest.mark.parametrize("how", ["moved", "removed"])
def test_a_library_folder_moved_or_removed_while_open_is_not_recreated_unlocked(
    tmp_path: Path, how: str
) -> None:
    """An operator archives (`mv`) or wipes (`rm -rf`) the library while the node holds it: the next
    recording recreated the folder at the old path, with no lock and an index naming episodes that were not
    there (found in review). The recording now fails as a failed write does (the runtime keeps it and
    tries again), naming the folder, and nothing is written there."""
    import shutil

    root = tmp_path / "library"
    lib = ReferenceLibrary.open(root, KEY)
    lib.add(episode(seed=1), {"task": "t"})
    if how == "moved":
        root.rename(tmp_path / "archived")
    else:
        shutil.rmtree(root)
    with pytest.raises(RecordingFailed, match=r"was removed or moved since this process opened it"):
        lib.add(episode(seed=2), {"task": "t"})
    assert not root.exists(), "recreated"
    lib.close()  # its last-use write is refused the same way, logged
    assert not root.exists()
    if how == "moved":
        archived = ReferenceLibrary.open(tmp_path / "archived", KEY)
        assert sorted(archived.entries) == [0] and archived.problems == []
        archived.close()


def test_a_write_the_kernel_refuses_raises_recording_failed_and_leaves_the_library(tmp_path: Path) -> None:
    """A real failed write, not a patched one: a child process whose file size limit (RLIMIT_FSIZE) is
    below an episode's size gets EFBIG from the kernel mid-write, as a full disk gives ENOSPC. The add
    raises RecordingFailed naming the library, no partial file is left, and the library opens as it was."""
    script = f"""
import resource, signal, sys
from pathlib import Path
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
from test_cache_library import KEY, episode
from rmuscle_ros.cache.library import RecordingFailed, ReferenceLibrary

lib = ReferenceLibrary.open(Path({str(tmp_path)!r}), KEY)
lib.add(episode(seed=1), {{"task": "t"}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG, not the process
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    lib.add(episode(calls=40, seed=2), {{"task": "t"}})  # ~80 KiB
except RecordingFailed as e:
    print(type(e.__cause__).__name__, e)
    raise SystemExit(0)
raise SystemExit("the add did not fail")
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"reference library {tmp_path}: the episode could not be recorded" in run.stdout, run.stdout
    assert "File too large" in run.stdout or "os error 27" in run.stdout, run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "episode_000000.safetensors", "index.json"]
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.entries) == [0] and again.problems == []
    assert np.array_equal(again.load(0).images, episode(seed=1).images)
    again.close()


def test_an_index_write_that_fails_undoes_the_recording_and_its_evictions(
    tmp_path: Path, monkeypatch
) -> None:
    """The disk fills between the episode file and the index: the index on disk is the previous one, so
    the library in memory must be too (the episode it would have evicted still there, the new one not),
    and the new episode's file goes, since nothing names it."""
    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=1)
    kept = lib.add(episode(seed=1), {"task": "t"})

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(library_module, "_write_atomic", full_disk)
    with pytest.raises(RecordingFailed, match="No space left"):
        lib.add(episode(seed=2), {"task": "t"})
    assert sorted(lib.entries) == [kept]
    assert sorted(p.name for p in tmp_path.glob("episode_*")) == ["episode_000000.safetensors"]
    lib.touch(99)  # not in the library (evicted since it served a call): ignored
    monkeypatch.undo()
    lib.close()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [kept]


def test_an_interrupt_during_the_eviction_leaves_the_library_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C after the new episode's file is placed, while eviction picks what goes, before the index is
    written: the index on disk is the previous one, so the library in memory must be too (found in
    review: the new episode stayed in memory, unindexed on disk, and the runtime took it as recorded)."""
    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=1)
    kept = lib.add(episode(seed=1), {"task": "t"})
    real = ReferenceLibrary._evict

    def interrupted(self, keep):
        real(self, keep)
        raise KeyboardInterrupt

    monkeypatch.setattr(ReferenceLibrary, "_evict", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lib.add(episode(seed=2), {"task": "t"})
    monkeypatch.undo()
    assert sorted(lib.entries) == [kept]
    assert sorted(p.name for p in tmp_path.glob("episode_*")) == ["episode_000000.safetensors"]
    lib.close()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [kept]


def test_a_failure_after_the_index_is_renamed_is_a_recording(tmp_path: Path, monkeypatch, caplog) -> None:
    """A step after the new index took its place fails (the folder's sync): the episode is in the index on
    disk, so add returns its id, with a warning, rather than RecordingFailed (whose caller would write
    it again)."""
    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY)
    real_replace = library_module._replace_durably

    def sync_fails(tmp: Path, path: Path) -> None:
        real_replace(tmp, path)
        if path.name == "index.json":
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(library_module, "_replace_durably", sync_fails)
    added = lib.add(episode(seed=1), {"task": "t"})
    monkeypatch.undo()
    assert "a step after its index was written failed" in caplog.text
    lib.close()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [added]


def test_an_interrupt_after_the_index_is_renamed_keeps_the_recording(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C at shutdown can land after the new index is renamed into place, while the folder syncs: the
    index on disk then names the new episode, so its file stays and the library in memory keeps the new
    state (the evicted episode is not put back), to be written again at close."""
    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=1)
    lib.add(episode(seed=1), {"task": "t"})
    real_replace = library_module._replace_durably

    def interrupted(tmp: Path, path: Path) -> None:
        real_replace(tmp, path)
        if path.name == "index.json":
            raise KeyboardInterrupt

    monkeypatch.setattr(library_module, "_replace_durably", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lib.add(episode(seed=2), {"task": "t"})
    monkeypatch.undo()
    assert sorted(lib.entries) == [1] and (tmp_path / "episode_000001.safetensors").exists()
    lib.close()
    again = ReferenceLibrary.open(tmp_path, KEY, max_episodes=1)
    assert sorted(again.entries) == [1] and again.problems == []
    assert np.array_equal(again.load(1).images, episode(seed=2).images)
    again.close()


def test_add_never_evicts_the_episode_it_is_recording(tmp_path: Path) -> None:
    """A cell without a real-time clock can use episodes before NTP sets its clock back: their last use then
    lies in the future of the next recording. Eviction still takes one of them, never the new episode
    (which add() returns as recorded)."""
    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=2)
    old = [lib.add(episode(seed=s), {"task": "t"}) for s in (1, 2)]
    for i in old:
        lib.entries[i].last_used += 3600  # used while the clock was an hour ahead
    new = lib.add(episode(seed=3), {"task": "t"})
    assert sorted(lib.entries) == [old[1], new] and (tmp_path / lib.entries[new].file).exists()
    lib.close()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY, max_episodes=2).entries) == [old[1], new]


def test_a_remove_whose_index_write_fails_leaves_the_library_as_it_was(tmp_path: Path, monkeypatch) -> None:
    """A full disk fails `remove` before its index is written: the episodes are still in the index on disk,
    so they stay in the library in memory too, each where it was (served, or left out as damaged), and the
    next write does not drop them from the index while their files stay on disk."""
    import errno

    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY)
    served, damaged, other = (lib.add(episode(seed=s), {"task": "t"}) for s in (1, 2, 3))
    lib.leave_out(damaged, f"episode {damaged}: damaged")

    def full_disk(path: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(library_module, "_write_atomic", full_disk)
    with pytest.raises(OSError, match="No space left"):
        lib.remove([served, damaged])
    monkeypatch.undo()
    assert list(lib.entries) == [served, other] and list(lib.left_out) == [damaged]
    lib.add(episode(seed=4), {"task": "t"})
    lib.close()
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert {served, damaged} <= {*again.entries, *again.left_out}, "the index still names both"
    again.close()


def test_a_file_that_cannot_be_deleted_once_the_index_is_written_is_logged_not_raised(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Once the new index is in place the recording or removal is done: an evicted or removed episode's
    file that cannot be deleted (a read-only mount, a file held open) is a warning naming it, the other
    files are still deleted, and the next open tries its delete again (the index keeps the removed ids
    while their files remain), as the one after the fault deletes it."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY, max_episodes=2)
    second = [lib.add(episode(seed=s), {"task": "t"}) for s in (1, 2)][1]
    stuck = {tmp_path / "episode_000000.safetensors", tmp_path / "episode_000002.safetensors"}
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self in stuck:
            raise PermissionError(13, "Permission denied")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.library")
    third = lib.add(episode(seed=3), {"task": "t"})  # evicts episode 0, whose file is stuck
    assert sorted(lib.entries) == [second, third] and (tmp_path / "episode_000000.safetensors").exists()
    assert "cannot delete episode_000000.safetensors, which the index no longer names" in caplog.text
    lib.close()
    caplog.clear()
    ReferenceLibrary.open(tmp_path, KEY, max_episodes=2).close()
    assert "cannot delete episode_000000.safetensors, of removed episode 0" in caplog.text
    assert "kept and never used" not in caplog.text, "not an orphan: the index says it was evicted"
    assert main(["remove", str(tmp_path), str(third), str(second)]) == 0  # `third`'s file is stuck
    assert "cannot delete episode_000002.safetensors" in caplog.text
    assert not (tmp_path / "episode_000001.safetensors").exists(), "the next file is still deleted"
    monkeypatch.undo()
    caplog.clear()
    ReferenceLibrary.open(tmp_path, KEY).close()
    assert "deleted episode_000000.safetensors, of removed episode 0 (its delete had failed)" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("episode_*")) == [], "both stuck files deleted at last"


def test_what_an_interrupted_write_left_is_cleaned_up_or_kept_at_open(tmp_path: Path, caplog, capsys) -> None:
    """A writer killed mid-write (or a power cut) leaves temporary files: the next open deletes them and
    says so, and an earlier version's open marker whose process is gone and its drafts with them (the
    marker is replaced by this process's, saying whose it was). An
    episode file the index does not name (its index write failed) is named and kept, and no new episode
    is written over it. Files that are not the library's are left alone."""
    import socket
    import subprocess
    import sys

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(seed=1), {"task": "t"})
    lib.close()
    (tmp_path / ".episode_000001.safetensors.tmp-99999").write_bytes(b"\0" * (1 << 20))
    (tmp_path / ".index.json.tmp-99999").write_text("{")
    (tmp_path / ".notes.tmp-1").write_text("the operator's")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / f".open.tmp-{int(gone.stdout)}").write_text("an earlier version's marker draft")
    (tmp_path / ".open").write_text(f"{socket.gethostname()} {int(gone.stdout)}")  # and its marker
    unnamed = tmp_path / "episode_000004.safetensors"
    unnamed.write_bytes(b"a whole episode whose index write failed")
    from rmuscle_ros.cache.library import main

    assert main(["verify", str(tmp_path)]) == 0, "read only: what is indexed is intact"
    out = capsys.readouterr().out
    assert "episode_000004.safetensors: not named by the index" in out
    assert ".episode_000001.safetensors.tmp-99999: a write that never finished" in out
    assert ".notes.tmp-1" not in out
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.library")
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert "removed 3 partial file(s) of writes that never finished (1.0 MiB)" in caplog.text
    assert "episode_000004.safetensors" in caplog.text and "kept and never used" in caplog.text
    assert (
        f"the open marker of {socket.gethostname()} {int(gone.stdout)}, an earlier version's" in caplog.text
    )
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [
        ".lock", ".notes.tmp-1", ".open"
    ]  # fmt: skip
    assert (tmp_path / ".open").read_text() == f"{socket.gethostname()} {os.getpid()}", "this process's now"
    assert sorted(again.entries) == [0] and again.problems == []
    assert again.add(episode(seed=2), {"task": "t"}) == 5, "the unnamed file's id is not reused"
    assert unnamed.read_bytes() == b"a whole episode whose index write failed"
    again.close()


def test_an_episode_damaged_after_open_fails_its_load_by_name_and_can_be_left_out(tmp_path: Path) -> None:
    from rmuscle_ros.cache.library import EpisodeUnreadable

    lib = ReferenceLibrary.open(tmp_path, KEY)
    first, second = lib.add(episode(seed=1), {"task": "t"}), lib.add(episode(seed=2), {"task": "t"})
    (tmp_path / lib.entries[first].file).write_bytes(b"garbage")
    with pytest.raises(EpisodeUnreadable, match=r"episode 0: episode_000000\.safetensors could not be read"):
        lib.load(first)
    lib.leave_out(first, "episode 0: damaged")
    assert sorted(lib.entries) == [second] and lib.problems == ["episode 0: damaged"]
    lib.add(episode(seed=3), {"task": "t"})  # the index still names it, as open() keeps a corrupt one
    lib.close()
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.left_out) == [first] and "corrupt" in again.problems[0]
    again.close()


def test_the_library_says_when_its_disk_could_not_take_another_episode(tmp_path: Path, monkeypatch) -> None:
    """Free space where it writes, and whether another episode as large as its largest would still fit:
    the node warns on /diagnostics before a recording fails."""
    import shutil

    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path / "lib", KEY)
    free = lib.disk_free_bytes()
    assert free is not None and abs(free - shutil.disk_usage(tmp_path).free) < 64 << 20  # others write too
    assert not lib.disk_low(free), "no episode yet: nothing to compare with"
    lib.add(episode(seed=1), {"task": "t"})
    size = lib.entries[0].bytes
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(library_module.shutil, "disk_usage", lambda _: usage._replace(free=size))
    assert lib.disk_free_bytes() == size and lib.disk_low(size)
    assert not lib.disk_low(size + (2 << 20)) and not lib.disk_low(None)
    # A disk that cannot be read (a stale network mount: even exists() raises) is "unknown", not an
    # exception (found in review: the node's status read raised), and the reason is kept
    import errno

    def stale(self: Path) -> bool:
        raise OSError(errno.ESTALE, "Stale file handle", str(self))

    with monkeypatch.context() as patched:
        patched.setattr(Path, "exists", stale)
        assert lib.disk_free_bytes() is None and "Stale file handle" in lib.disk_error, lib.disk_error
    assert lib.disk_free_bytes() is not None and lib.disk_error == "", "read again once the disk answers"


def test_episode_shapes_are_validated() -> None:
    with pytest.raises(ValueError, match="images"):
        Episode(
            descriptors=np.zeros((2, 2, 8), np.float32),
            images=np.zeros((3, 2, 16, 16, 3), np.uint8),
            tokens=np.zeros((2, 12), np.int64),
            token_mask=np.ones((2, 12), bool),
        )


def walk(seed: int, calls: int = 30) -> np.ndarray:
    """Descriptors of a repetitive episode: a smooth path through descriptor space."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((2, 8))
    drift = rng.standard_normal((2, 8)) * 0.15
    return np.stack([base + t * drift for t in range(calls)]).astype(np.float32)


def test_retrieval_finds_and_follows_the_same_task() -> None:
    library = {0: walk(0), 1: walk(1), 2: walk(2)}
    r = Retriever(RetrievalConfig(top_k=2, lookahead=4, threshold=0.8), library)
    live = walk(1) + np.random.default_rng(9).standard_normal((30, 2, 8)).astype(np.float32) * 0.01
    for t in range(0, 30, 3):  # the live episode advances 3 calls between queries: within the lookahead
        matches = r.query(live[t])
        assert matches[0].episode == 1 and matches[0].position == t and matches[0].similarity > 0.99
        assert len(matches) == 2 and matches[0].similarity >= matches[1].similarity


def test_a_restricted_search_matches_only_the_episodes_it_is_given() -> None:
    """`restrict` (rMuscle: the current task's episodes) masks the others out of every query, the best
    similarity reported included; with none left it serves nothing and reports 0, as an empty library."""
    library = {0: walk(0), 1: walk(1), 2: walk(2)}
    r = Retriever(RetrievalConfig(top_k=3, lookahead=4, threshold=-1.0), library)  # every query matches
    assert r.query(walk(1)[0] + 0.01)[0].episode == 1
    r.restrict([0, 2])
    assert r.episodes == 2 and r.positions == {}, "alignment starts over"
    matches = r.query(walk(1)[0] + 0.01)
    assert {m.episode for m in matches} <= {0, 2} and set(r.positions) == {0, 2}
    assert r.last_similarity == max(m.similarity for m in matches) < 0.99
    # in fallback too (found by mutation testing: another task's scene reported as a near match)
    r.fallback = True
    assert r.query(walk(1)[0] + 0.01) == [] and r.last_similarity < 0.99
    r.fallback = False
    r.restrict([])
    assert r.query(walk(0)[0]) == [] and r.last_similarity == 0.0 and not r.fallback and r.episodes == 0
    r.restrict(None)
    assert r.episodes == 3 and r.query(walk(2)[3])[0].episode == 2


def test_alignment_only_looks_ahead() -> None:
    r = Retriever(RetrievalConfig(top_k=1, lookahead=4, threshold=-1.0), {0: walk(0)})
    assert r.query(walk(0)[3])[0].position == 3
    assert r.query(walk(0)[1])[0].position == 3  # never aligns backwards
    assert r.query(walk(0)[20])[0].position == 7  # at most `lookahead` ahead per call


def test_an_episodes_first_call_is_matched_at_the_references_start() -> None:
    """The first call after a reset searches positions 0 to lookahead, as the window's start entries hold
    (DESIGN §4). Searched whole (before, found in review), a task that ends where it began matched its first
    call to the reference's end, and alignment, which only moves forward, stayed there."""
    there = walk(0, calls=15)
    out_and_back = np.concatenate([there, there[::-1]])  # home, the work, home again
    r = Retriever(RetrievalConfig(top_k=1, lookahead=4, threshold=0.8), {0: out_and_back})
    start = out_and_back[-1] + 1e-4  # home: as like the reference's last call as its first
    assert r.query(start)[0].position == 0
    assert r.query(out_and_back[3])[0].position == 3, "and it follows the episode from there"


def test_equal_matches_rank_by_episode_id_and_every_episode_stays_aligned() -> None:
    r = Retriever(RetrievalConfig(top_k=2, lookahead=2, threshold=0.5), {7: walk(0), 3: walk(0), 5: walk(4)})
    matches = r.query(walk(0)[2])
    assert [(m.episode, m.position) for m in matches] == [(3, 2), (7, 2)]  # a tie: the lower id first
    assert set(r.positions) == {3, 5, 7}  # the episode outside the top k is aligned too


def test_a_descriptor_that_is_not_finite_falls_back() -> None:
    """A NaN similarity is no match (found in review: argmax picked it and NaN < threshold is False)."""
    r = Retriever(RetrievalConfig(threshold=0.8), {0: walk(0)})
    assert r.query(np.full((2, 8), np.nan, np.float32)) == [] and r.fallback


def test_a_nan_in_a_library_episode_does_not_hide_its_good_matches() -> None:
    """np.argmax takes a NaN as the maximum: an episode with a NaN call within its lookahead was aligned to
    it and ranked last, and a weaker episode served instead (found in review). A NaN call never wins, as
    on the GPU's pick."""
    e = np.eye(8, dtype=np.float32)
    nan_at_2 = np.stack([e[0], e[0], np.full(8, np.nan, np.float32)])[:, None, :]
    weaker = np.stack([e[0] * 0.95 + e[1] * 0.31] * 3)[:, None, :]
    r = Retriever(RetrievalConfig(threshold=0.8), {0: nan_at_2, 1: weaker})
    matches = r.query(e[0][None])
    assert (matches[0].episode, matches[0].position) == (0, 0)
    assert matches[0].similarity == pytest.approx(1.0)
    assert r.positions[0] == 0 and not r.fallback


def test_a_nan_live_descriptor_falls_back_reporting_nan_beside_other_tasks_episodes() -> None:
    """Other tasks' episodes rank -inf; a NaN live descriptor reported that -inf instead of NaN (found in
    review). It falls back either way."""
    e = np.eye(8, dtype=np.float32)
    r = Retriever(RetrievalConfig(threshold=0.8), {0: e[:3, None, :], 1: e[3:6, None, :]})
    r.restrict([0])
    assert r.query(np.full((1, 8), np.nan, np.float32)) == [] and r.fallback
    assert math.isnan(r.last_similarity)


def test_an_episode_left_out_mid_episode_keeps_the_others_aligned() -> None:
    """The runtime leaves out an episode whose file can no longer be read (RMuscle._leave_out): the live
    episode stays aligned with the others, instead of searching their starts again (found in review: at
    call 16 it matched episode 0 at position 4 with 0.87, instead of 16 with 1.0)."""
    r = Retriever(RetrievalConfig(threshold=0.8), {0: walk(0), 1: walk(0) + 0.01})
    for t in range(0, 16, 3):
        r.query(walk(0)[t])
    r.restrict([0], keep_alignment=True)
    matches = r.query(walk(0)[16])
    assert [(m.episode, m.position) for m in matches] == [(0, 16)] and matches[0].similarity == pytest.approx(
        1.0
    )
    r.restrict([0])  # a new task: alignment starts over
    assert r.query(walk(0)[16]) == [] or r.positions[0] <= 4


def test_fallback_is_sticky_until_reset() -> None:
    r = Retriever(RetrievalConfig(threshold=0.8), {0: walk(0)})
    assert r.query(walk(0)[5])
    assert r.query(-walk(0)[6]) == [] and r.fallback  # the scene left the repertoire
    assert r.query(walk(0)[7]) == []  # stays dense for the rest of the episode
    r.reset()
    assert r.query(walk(0)[0])[0].position == 0


@pytest.mark.parametrize("threshold, x, y", [(0.8, 4.0, 3.0), (0.6, 3.0, 4.0), (0.7, 7.0, math.sqrt(51.0))])
def test_a_similarity_exactly_at_the_threshold_serves_on_the_host_and_in_the_gpu_pick(
    threshold: float, x: float, y: float
) -> None:
    """A cosine exactly at the threshold is no fallback, whichever the threshold: compared in float32, as
    the similarity is computed (found in review: 0.7 is 0.699999988 in float32, below the float 0.7, and
    sent the episode dense for good, where 0.8 and 0.6 passed). The GPU's pick (`window_match`, run here
    in its PyTorch definition) computes a similarity that reaches it too; `RMuscle._pick`'s comparison
    is tested in test_rmuscle_runtime."""
    from rmuscle_ros.cache.retrieval import reaches
    from rmuscle_ros.engine import ops

    reference = np.zeros((1, 3, 16), np.float32)
    reference[0, 0, 0] = 1.0
    live = np.zeros((3, 16), np.float32)
    live[0, :2] = x, y  # cosine x / |(x, y)| with the reference: 0.8, 0.6, 0.7
    r = Retriever(RetrievalConfig(threshold=threshold), {0: reference})
    assert r.query(live) and not r.fallback, r.last_similarity
    picked = torch.zeros(2)
    keys, usable = torch.from_numpy(reference.reshape(1, -1)), torch.ones(1, dtype=torch.bool)
    ops.window_match(torch.from_numpy(live), keys, usable, torch.zeros(1, dtype=torch.int64), picked)
    assert reaches(float(picked[1]), threshold)
    assert not reaches(float(np.nextafter(np.float32(threshold), np.float32(0))), threshold)
    assert not reaches(math.nan, threshold)


def _reference_query(library: dict, aligned: dict, descriptor: np.ndarray, cfg: RetrievalConfig):
    """Retrieval as DESIGN §4 words it, one episode at a time: (sorted [(similarity, id, position)], new
    alignment). The Retriever computes the same for the whole library at once."""
    q = descriptor.reshape(-1) / np.linalg.norm(descriptor)
    best = []
    for eid, d in library.items():
        rows = d.reshape(len(d), -1) / np.linalg.norm(d.reshape(len(d), -1), axis=1, keepdims=True)
        lo = aligned.get(eid, 0)  # an episode's first call: its start
        hi = min(lo + cfg.lookahead + 1, len(d))
        sims = rows[lo:hi] @ q
        best.append((float(sims.max()), eid, lo + int(sims.argmax())))
    return sorted(best, key=lambda b: (-b[0], b[1])), {eid: pos for _, eid, pos in best}


def test_retrieval_equals_the_episode_by_episode_definition() -> None:
    # Episodes of different lengths (the one-call episode, alignment clipped at an episode's end), many
    # queries of a drifting scene: the same candidates, positions and similarities as the definition.
    rng = np.random.default_rng(5)
    cfg = RetrievalConfig(top_k=3, lookahead=2, threshold=-1.0)
    library = {eid: walk(eid, calls=n) for eid, n in zip((4, 9, 1, 6), (1, 7, 12, 30), strict=True)}
    r, aligned = Retriever(cfg, library), {}
    for t in range(20):
        query = walk(6)[min(2 * t, 29)] + 0.05 * rng.standard_normal((2, 8)).astype(np.float32)
        want, aligned = _reference_query(library, aligned, query, cfg)
        got = r.query(query)
        assert [(m.episode, m.position) for m in got] == [(eid, pos) for _, eid, pos in want[:3]]
        assert [m.similarity for m in got] == pytest.approx([s for s, _, _ in want[:3]], abs=1e-5)
        assert r.positions == aligned


def test_similarities_from_the_gpu_need_a_gpu_retriever_and_a_queued_call() -> None:
    r = Retriever(RetrievalConfig(), {0: walk(0)})
    assert not r.on_device
    with pytest.raises(RuntimeError, match="computes similarities on the host"):
        r.queue(torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="needs similarities queued"):
        r.query()


def test_command_line_lists_verifies_and_removes_episodes(tmp_path: Path, capsys) -> None:
    """`python -m rmuscle_ros.cache.library`: list (the index), verify (every file's checksum; exit 1 on a
    problem), remove (the index first, then the files; an unknown id removes nothing)."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    for seed in range(3):
        task = {"task": "stack the cups"} if seed < 2 else {}  # episode 2 as recorded before tasks were kept
        lib.add(episode(seed=seed), meta={"session_episode": str(seed)} | task)
    lib.close()
    assert main(["list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3 episode(s), 0.0 MiB, weights abc123" in out and "not open in any live process" in out
    assert "episode 1: 5 calls" in out and "(task 'stack the cups', session_episode 1)" in out
    assert "(no task recorded: served to none, session_episode 2)" in out
    assert out.index("  task 'stack the cups': 2 episode(s)") < out.index(
        "  no task recorded (served to none"
    )
    assert (
        "  task 'stack the cups': 2 episode(s), " in out and " MiB, last used 20" in out
    )  # a retired job shows

    (tmp_path / lib.entries[1].file).write_bytes(b"damaged")
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "episode 1: episode_000001.safetensors is corrupt" in out and "2 of 3 episode(s) intact" in out

    assert main(["remove", str(tmp_path), "1", "9"]) == 2
    assert "no episode [9]" in capsys.readouterr().err
    assert (tmp_path / "episode_000001.safetensors").exists(), "nothing removed"
    assert main(["remove", str(tmp_path), "1"]) == 0
    assert "removed episode(s) [1]; 2 left" in capsys.readouterr().out
    assert not (tmp_path / "episode_000001.safetensors").exists()
    reopened = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(reopened.entries) == [0, 2] and reopened.problems == []
    reopened.close()
    assert main(["verify", str(tmp_path)]) == 0
    # A retired job: every episode of its task at once.
    assert main(["remove", str(tmp_path), "--task", "sort the screws"]) == 2
    err = capsys.readouterr().err
    assert "no episode of task 'sort the screws' in" in err and "(its tasks: ['stack the cups'])" in err
    assert main(["remove", str(tmp_path), "--task", "stack the cups"]) == 0
    assert "removed episode(s) [0]; 1 left" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["remove", str(tmp_path), "2", "--task", "stack the cups"])
    assert "episode ids, or --task, not both" in capsys.readouterr().err
    assert main(["list", str(tmp_path / "nothing")]) == 2
    assert "no library here" in capsys.readouterr().err


def test_a_removed_episodes_id_is_never_given_again(tmp_path: Path, capsys) -> None:
    """The index keeps the next id: after `remove` of the newest episode, the next recording takes a new
    id, so a `remove` of the old id run again (shell history, yesterday's notes) cannot take it (before,
    found in review, ids were the highest held + 1, and the new recording got the removed one's)."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    for seed in range(3):
        lib.add(episode(seed=seed))
    lib.close()
    assert main(["remove", str(tmp_path), "2"]) == 0
    lib = ReferenceLibrary.open(tmp_path, KEY)
    assert lib.add(episode(seed=3)) == 3
    lib.close()
    assert main(["remove", str(tmp_path), "2"]) == 2 and "no episode [2]" in capsys.readouterr().err
    assert json.loads((tmp_path / "index.json").read_text())["next_id"] == 4
    index = json.loads((tmp_path / "index.json").read_text())
    del index["next_id"]  # an earlier build's index: the highest id + 1, as before
    (tmp_path / "index.json").write_text(json.dumps(index))
    lib = ReferenceLibrary.open(tmp_path, KEY)
    assert lib.add(episode(seed=4)) == 4
    lib.close()
    index["next_id"] = -1
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match="next_id is -1, not an integer >= 0"):
        ReferenceLibrary.open(tmp_path, KEY)


@pytest.mark.parametrize("field", ["next_id", "removed", "id"])
def test_an_index_holding_a_huge_id_is_refused_at_open_not_at_every_recording(
    tmp_path: Path, field: str
) -> None:
    """An index edited to hold an id of 10**300 opened without a problem, then failed every recording (its
    file name too long) while `verify` passed (found in review). Ids stay below ID_LIMIT (10**12)."""
    from rmuscle_ros.cache.library import ID_LIMIT, main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(), {"task": "t"})
    lib.close()
    index = json.loads((tmp_path / "index.json").read_text())
    if field == "id":
        index["episodes"][0]["id"] = 10**300
    else:
        index[field] = 10**300 if field == "next_id" else [ID_LIMIT]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match=r"an integer >= 0 and < 10\*\*12"):
        ReferenceLibrary.open(tmp_path, KEY)
    assert main(["verify", str(tmp_path)]) != 0


def test_episode_files_are_created_under_the_umask_as_the_index_is(tmp_path: Path) -> None:
    """An engineer's `verify` under another user than the node's reads them (safetensors' own writer made
    them 0600: 'could not be read (Permission denied)' for intact files; found in review)."""
    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode())
    lib.close()
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("episode_000000.safetensors") == mode("index.json")


def test_list_piped_into_head_ends_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    lib = ReferenceLibrary.open(tmp_path, KEY)
    for seed in range(40):
        lib.add(episode(seed=seed))
    lib.close()
    run = subprocess.run(
        f"{sys.executable} -m rmuscle_ros.cache.library list {tmp_path} | head -1",
        shell=True, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert run.stdout.startswith("library ") and run.stderr == ""


def test_reindex_rebuilds_a_lost_or_damaged_index_from_the_episode_files(tmp_path: Path, capsys) -> None:
    """The index is the library's only record of its episodes' key, tasks and times; lost or damaged (a
    hand edit, a disk fault), every recording became an orphan that a new index never used (found in
    review). Episode files now carry them, and `reindex` rebuilds the index from the files: what it held
    comes back, an unreadable index is set aside for inspection, and a file it cannot vouch for is named
    and left out."""
    from safetensors.numpy import save_file

    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    for seed, task in enumerate(("fold", "fold", "stack")):
        lib.add(episode(seed=seed), {"task": task, "session_episode": str(seed)})
    before = {i: (e.sha256, e.calls, e.bytes, e.created, e.meta) for i, e in lib.entries.items()}
    lib.close()
    (tmp_path / "index.json").write_text('{"version": 1, "key": {"weights": "abc123", "sha')  # cut short
    with pytest.raises(LibraryError, match="reindex <library>`, with no node holding it"):
        ReferenceLibrary.open(tmp_path, KEY)
    assert main(["reindex", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "index.json: " in out
        and "set aside as index.json.corrupt-" in out
        and "indexed episode(s) [0, 1, 2]" in out
    )
    assert len(list(tmp_path.glob("index.json.corrupt-*"))) == 1
    lib = ReferenceLibrary.open(tmp_path, KEY)
    assert {i: (e.sha256, e.calls, e.bytes, e.created, e.meta) for i, e in lib.entries.items()} == before
    assert np.array_equal(lib.load(2).images, episode(seed=2).images) and lib.problems == []
    lib.close()

    # Lost outright; and beside the files, one of another library and one from before files carried a key.
    (tmp_path / "index.json").unlink()
    other = ReferenceLibrary.open(tmp_path / "other", LibraryKey(weights="def456", shapes=KEY.shapes))
    other.add(episode(seed=7))
    other.close()
    os.replace(tmp_path / "other" / "episode_000000.safetensors", tmp_path / "episode_000007.safetensors")
    save_file(
        episode(seed=8).tensors(), str(tmp_path / "episode_000008.safetensors"), metadata={"episode": "8"}
    )
    assert main(["reindex", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert (
        "episode_000007.safetensors: recorded under another key (library 'def456', model 'abc123'); skipped"
        in out
    )
    assert (
        "episode_000008.safetensors: recorded before episode files carried their library's key; skipped"
        in out
    )
    assert "indexed episode(s) [0, 1, 2]" in out
    lib = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(lib.entries) == [0, 1, 2] and lib.add(episode(seed=9)) == 9, (
        "the skipped files' ids stay taken"
    )
    lib.close()
    # A recording whose index write failed: its file, unnamed beside a good index (which still gives its id
    # as the next), is indexed too; an episode removed whose file stayed (its id below the next) is not:
    # the operator took it out (found in review: reindex served it again).
    index = json.loads((tmp_path / "index.json").read_text())
    index["episodes"] = [e for e in index["episodes"] if e["id"] != 9]
    (tmp_path / "index.json").write_text(json.dumps(index | {"next_id": 9}))
    os.link(tmp_path / "episode_000001.safetensors", tmp_path / "kept.safetensors")
    assert main(["remove", str(tmp_path), "1"]) == 0
    os.replace(tmp_path / "kept.safetensors", tmp_path / "episode_000001.safetensors")  # its delete failed
    capsys.readouterr()
    assert main(["reindex", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "indexed episode(s) [9]" in out
    assert "episode_000001.safetensors: of episode 1, removed or evicted (the index says so)" in out
    lib = ReferenceLibrary.open(tmp_path, KEY)  # which deletes the removed episode's file, as remove meant to
    assert sorted(lib.entries) == [0, 2, 9] and not (tmp_path / "episode_000001.safetensors").exists()
    lib.close()
    # An index whose next id is not one: the node says to reindex, which rebuilds it.
    index = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps(index | {"next_id": -1}))
    with pytest.raises(LibraryError, match=r"next_id is -1, not an integer >= 0.*reindex <library>"):
        ReferenceLibrary.open(tmp_path, KEY)
    assert main(["verify", str(tmp_path)]) == 2
    assert main(["reindex", str(tmp_path)]) == 1  # rebuilt; the files of other keys, or none, named
    assert "set aside as index.json.corrupt-" in capsys.readouterr().out
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [0, 2, 9]
    # Not while a node has it open (exit 75, busy); not a newer build's index, which stays as it was.
    held = ReferenceLibrary.open(tmp_path, KEY)
    assert (
        main(["reindex", str(tmp_path)]) == 75 and "already open in this process" in capsys.readouterr().err
    )
    held.close()
    index = json.loads((tmp_path / "index.json").read_text())
    (tmp_path / "index.json").write_text(json.dumps(index | {"version": 2}))
    assert (
        main(["reindex", str(tmp_path)]) == 2 and "written by a newer rmuscle_ros" in capsys.readouterr().err
    )
    assert json.loads((tmp_path / "index.json").read_text())["version"] == 2
    assert main(["reindex", str(tmp_path / "nothing")]) == 2 and "no library here" in capsys.readouterr().err
    (tmp_path / "index.json").write_text(json.dumps(index | {"version": 0}))  # another format: left alone
    assert (
        main(["reindex", str(tmp_path)]) == 2
        and "library version 0, this build reads 1" in capsys.readouterr().err
    )
    assert json.loads((tmp_path / "index.json").read_text())["version"] == 0
    bare = tmp_path / "bare"  # an unreadable index and no file to rebuild it from: left as it was
    bare.mkdir()
    (bare / "index.json").write_text("{")
    assert main(["reindex", str(bare)]) == 1
    assert "no episode file can rebuild it: left as it was" in capsys.readouterr().out
    assert (bare / "index.json").read_text() == "{"


def test_command_line_similarity_shows_whether_a_threshold_separates_repeats_from_other_scenes(
    tmp_path: Path, capsys
) -> None:
    """`similarity`: what cache.similarity_threshold must tell apart, from the library's own descriptors:
    each call's best match among its task's other episodes (a repeat) and among other tasks' (another
    scene). A damaged file is named and left out, not a crash."""
    from rmuscle_ros.cache.library import main

    rng = np.random.default_rng(0)
    bench = {"stack the cups": rng.standard_normal((2, 8)), "sort the screws": rng.standard_normal((2, 8))}
    lib = ReferenceLibrary.open(tmp_path, KEY)
    for task, look in bench.items():
        for seed in range(3):  # three repeats of each job: its scene, with a little noise per call
            ep = episode(seed=seed)
            ep.descriptors[:] = look + 0.05 * rng.standard_normal(ep.descriptors.shape)
            lib.add(ep, meta={"task": task})
    lone = episode(seed=9)
    lib.add(lone)  # recorded before tasks were kept: one episode, no repeat
    lib.close()
    assert main(["similarity", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "task 'stack the cups': 3 episode(s), 15 calls" in out and "no task recorded: 1 episode(s)" in out
    assert "repeats: none (one episode)" in out
    assert out.count("0 of 15 below 0.8 (would run dense)") == 2
    assert "separated: every repeat scored above every other task's scene" in out and "(0.8 does)" in out
    # A threshold above the repeats' similarity would send them dense: the report says so.
    assert main(["similarity", str(tmp_path), "--threshold", "0.9999"]) == 0
    assert "15 of 15 below 0.9999" in capsys.readouterr().out

    (tmp_path / "episode_000001.safetensors").write_bytes(b"damaged")
    assert main(["similarity", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (
        "episode 1: episode_000001.safetensors is corrupt (checksum mismatch); left out, see verify" in out
        and "task 'stack the cups': 2 episode(s), 10 calls" in out
    )
    with pytest.raises(SystemExit):
        main(["similarity", str(tmp_path), "--threshold", "2"])
    assert "--threshold is a cosine similarity in [-1, 1], got 2" in capsys.readouterr().err

    # Two jobs on one bench look alike to retrieval: no threshold separates them, and the report says
    # what keeps them apart instead.
    same_bench = tmp_path / "same_bench"
    lib = ReferenceLibrary.open(same_bench, KEY)
    for task in ("stack the cups", "sort the screws"):
        for seed in range(2):
            ep = episode(seed=seed)
            ep.descriptors[:] = bench["stack the cups"] + 0.05 * rng.standard_normal(ep.descriptors.shape)
            lib.add(ep, meta={"task": task})
    lib.close()
    assert main(["similarity", str(same_bench)]) == 0
    out = capsys.readouterr().out
    assert (
        "not separated: a repeat scored as low as" in out
        and "apart by name (cache.task or the prompt)" in out
    )


def hold_in_another_process(root: Path, prelude: str = ""):
    """A process (a node) that opens the library at `root` and keeps it open until it is killed; returned
    once it holds it. `prelude`: Python it runs first (e.g. to fill its disk)."""
    import subprocess
    import sys

    holder = (
        "import sys, time\n"
        f"{prelude}\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_cache_library import KEY\n"
        "from rmuscle_ros.cache.library import ReferenceLibrary\n"
        "lib = ReferenceLibrary.open(sys.argv[1], KEY)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(root), str(Path(__file__).parent)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_library_another_live_process_has_open_is_refused_and_a_stale_marker_is_not(tmp_path: Path) -> None:
    """Two writers would each rewrite the index from memory and drop the other's episodes: opening a
    library whose lock another process holds is refused, naming it; once that process is gone, however it
    ended (killed here), the kernel has given the lock up. A second opener in this process is refused as
    well (before, found in review, it shared the lock and became a second writer; nothing in the package
    opens a library twice: a node closes it at cleanup before its next configure opens it)."""
    import socket

    from rmuscle_ros.cache.library import LibraryBusy

    mine = ReferenceLibrary.open(tmp_path, KEY)
    mine.add(episode())
    with pytest.raises(LibraryBusy, match=r"already open in this process \(opened at .*, not closed yet\)"):
        ReferenceLibrary.open(tmp_path, KEY)
    assert mine.add(episode(seed=1)) == 1, "still this process's after the refused opener"
    mine.close()
    other = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(
            LibraryBusy, match=rf"open in process {socket.gethostname()} {other.pid} \(another node\?\)"
        ) as e:
            ReferenceLibrary.open(tmp_path, KEY)
        assert "give each node its own library_path" in str(e.value)
    finally:
        other.kill()
        other.wait()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [0, 1], "its process is gone"


def test_command_line_does_not_remove_from_a_library_a_live_process_has_open(tmp_path: Path, capsys) -> None:
    """An open library holds its lock: while its process lives, `remove` refuses, naming it (its index in
    memory would put the episodes back); `holder` tries the lock, so an earlier version's marker left by a
    process that is gone is ignored."""
    import socket
    import subprocess
    import sys

    from rmuscle_ros.cache.library import OPEN_MARKER, holder, main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode())
    lib.add(episode(seed=1))
    assert holder(tmp_path) is not None
    assert main(["remove", str(tmp_path), "0"]) == 75, "busy (EX_TEMPFAIL): a script may retry later"
    assert "is open in process" in capsys.readouterr().err
    assert sorted(ReferenceLibrary.open(tmp_path / "other", KEY).entries) == []  # an unrelated library
    lib.close()
    assert holder(tmp_path) is None and not (tmp_path / OPEN_MARKER).exists()
    other = hold_in_another_process(tmp_path)
    try:
        assert holder(tmp_path) == f"{socket.gethostname()} {other.pid}"
        assert main(["remove", str(tmp_path), "0"]) == 75
        assert f"is open in process {socket.gethostname()} {other.pid}" in capsys.readouterr().err
    finally:
        other.kill()
        other.wait()
    assert holder(tmp_path) is None, "the kernel gave its lock up"

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / OPEN_MARKER).write_text(f"{socket.gethostname()} {int(gone.stdout)}")
    assert holder(tmp_path) is None, "the process that wrote the marker has exited"
    assert main(["remove", str(tmp_path), "0"]) == 0
    out = subprocess.run(
        [sys.executable, "-m", "rmuscle_ros.cache.library", "list", str(tmp_path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "1 episode(s)" in out and "episode 1: 5 calls" in out


def test_a_remove_while_a_node_opens_the_library_is_refused(tmp_path: Path, monkeypatch) -> None:
    """The open marker is taken before the index is read: a `remove` run while a node is still reading
    and verifying the library (seconds, for gigabytes of episodes) finds it busy. Before (found in review)
    it removed the episode, and the node's index in memory put it back into the index at its next write."""
    import subprocess
    import sys

    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY)
    first, second = lib.add(episode(seed=1)), lib.add(episode(seed=2))
    lib.close()
    verify, during = library_module._file_problem, {}

    def verifying(root: Path, entry) -> str | None:  # the node checks its files; the operator runs `remove`
        if entry.id == second and "rc" not in during:
            during["rc"] = subprocess.run(
                [sys.executable, "-m", "rmuscle_ros.cache.library", "remove", str(root), str(first)],
                capture_output=True, text=True,
            ).returncode  # fmt: skip
        return verify(root, entry)

    monkeypatch.setattr(library_module, "_file_problem", verifying)
    node = ReferenceLibrary.open(tmp_path, KEY)
    monkeypatch.undo()
    assert during["rc"] == 75, "remove was not refused (busy) while the library was being opened"
    node.add(episode(seed=3))
    node.close()
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert again.problems == [] and sorted(again.entries) == [first, second, 2]


def test_of_processes_opening_one_library_at_once_exactly_one_holds_it(tmp_path: Path) -> None:
    """The marker appears with its content at once (hard-linked from a file written first), so openers
    racing each other never see it empty and take it for stale: one holds the library, the others are
    refused while it lives (before, found in review, an opener could find the marker created but not yet
    written, delete it as stale, and two processes wrote one index). The holder keeps it until every
    opener has answered: with a fixed hold, an opener whose imports outlasted it on a loaded machine held
    the library after it, rightly, and failed the test."""
    import subprocess
    import sys
    import time

    ReferenceLibrary.open(tmp_path, KEY).close()
    opener = (
        "import sys, time\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_cache_library import KEY\n"
        "from rmuscle_ros.cache.library import LibraryBusy, ReferenceLibrary\n"
        "start = float(sys.argv[3])\n"
        "time.sleep(max(0.0, start - time.time()))\n"
        "try:\n"
        "    lib = ReferenceLibrary.open(sys.argv[1], KEY)\n"
        "    print('held', flush=True)\n"
        "    deadline = time.time() + 60\n"
        "    while not os.path.exists(sys.argv[4]) and time.time() < deadline:\n"
        "        time.sleep(0.02)\n"
        "except LibraryBusy:\n"
        "    print('busy', flush=True)\n"
    ).replace("import sys, time", "import os, sys, time")

    for round_ in range(3):
        release = tmp_path.parent / f"{tmp_path.name}_release_{round_}"  # beside the library, not in it
        start = time.time() + 2.0  # every process imports first, then all open at this instant
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    opener,
                    str(tmp_path),
                    str(Path(__file__).parent),
                    str(start),
                    str(release),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        try:
            assert all(p.stdout is not None for p in procs)
            said = sorted(p.stdout.readline().strip() for p in procs)  # type: ignore[union-attr]
        finally:
            release.touch()
            for p in procs:
                p.communicate(timeout=60)
        assert said == ["busy", "busy", "busy", "held"], said


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def test_an_episode_larger_than_the_whole_library_is_refused_and_nothing_is_evicted(tmp_path: Path) -> None:
    """One long episode (no reset for a while) larger than max_bytes on its own: before (found in review)
    it evicted every other episode, of every task, and the bound was still exceeded. It is refused before
    anything is written or evicted, saying its size and the bound; the library stays as it was, records on,
    and the node reports the failed recording (a LibraryError, as a full disk's OSError)."""
    from rmuscle_ros.cache.library import EpisodeTooLarge

    lib = ReferenceLibrary.open(tmp_path, KEY, max_bytes=200_000, max_episodes=64)
    held = [lib.add(episode(seed=s), {"task": t}) for t in ("pick", "fold") for s in range(3)]
    before = _files(tmp_path)
    with pytest.raises(
        EpisodeTooLarge, match=r"150 calls takes 0\.[0-9] MiB, more than the whole library"
    ) as e:
        lib.add(episode(calls=150, seed=99), {"task": "wipe"})
    assert "(0.2 MiB, max_library_mb)" in str(e.value) and "Raise max_library_mb" in str(e.value)
    assert sorted(lib.entries) == held and _files(tmp_path) == before
    # Its tensors fit but its file, with the header, does not: refused once written, its file deleted.
    small = episode(seed=7)
    lib.max_bytes = sum(t.nbytes for t in small.tensors().values()) + 1
    with pytest.raises(EpisodeTooLarge):
        lib.add(small, {"task": "wipe"})
    assert sorted(lib.entries) == held and _files(tmp_path) == before
    lib.max_bytes = 200_000
    assert lib.add(episode(seed=8), {"task": "pick"}) not in held and len(lib.entries) == 7
    lib.close()


def test_bounds_are_inclusive_an_episode_of_exactly_max_bytes_is_recorded(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    """The bounds are what the library may hold: an episode whose file takes exactly max_bytes is recorded
    (refused only above it), and a library holding exactly max_episodes or max_bytes evicts nothing, at a
    recording or at open, and warns of nothing; one more evicts the least recently used. Found by a mutation
    review: each `>` read as `>=` passed the suite."""
    import rmuscle_ros.cache.library as library

    # A file's header carries its recording time, whose digits (and so the file's size, to 8 bytes) vary:
    # one clock reading for all, so that the same episode makes the same file here (found in CI).
    monkeypatch.setattr(library.time, "time", lambda: 1_764_900_000.25)
    scratch = ReferenceLibrary.open(tmp_path / "scratch", KEY)
    sizes = [scratch.entries[scratch.add(episode(seed=s), {"task": "pick"})].bytes for s in (7, 8)]
    scratch.close()
    lib = ReferenceLibrary.open(tmp_path / "one", KEY, max_bytes=sizes[0])
    first = lib.add(episode(seed=7), {"task": "pick"})  # the same file, byte for byte: exactly the bound
    assert sorted(lib.entries) == [first] and lib.total_bytes == sizes[0]
    lib.close()
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.library")
    lib = ReferenceLibrary.open(tmp_path / "two", KEY, max_bytes=sum(sizes), max_episodes=2)
    ids = [lib.add(episode(seed=s), {"task": "pick"}) for s in (7, 8)]  # ids as in scratch: the same files
    assert sorted(lib.entries) == ids and lib.total_bytes == sum(sizes)  # both bounds met exactly
    lib.close()
    again = ReferenceLibrary.open(tmp_path / "two", KEY, max_bytes=sum(sizes), max_episodes=2)
    assert sorted(again.entries) == ids  # nothing evicted at open either
    third = again.add(episode(seed=9), {"task": "pick"})  # one more: the least recently used goes
    assert sorted(again.entries) == [ids[1], third]
    again.close()
    assert caplog.text == ""


def test_a_library_opened_on_a_full_disk_still_keeps_a_second_writer_out(tmp_path: Path, monkeypatch) -> None:
    """A disk full (here: no file may grow) when a node opens its library: before (found in review) the
    marker was not written, only logged, and a second node opened the library too, both writing the same
    episode ids. The kernel lock needs no space: the second opener is refused. A lock that cannot be taken
    at all (its file not created for a full disk) fails the open, naming the lock file and the error."""
    import errno

    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.library import LibraryBusy

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(seed=1), {"task": "a"})
    lib.close()
    full = (  # no file of this process may grow: each write fails as on a full disk
        "import resource, signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))"
    )
    node = hold_in_another_process(tmp_path, prelude=full)
    try:
        with pytest.raises(LibraryBusy, match="the library is open in process"):
            ReferenceLibrary.open(tmp_path, KEY)
    finally:
        node.kill()
        node.wait()

    real_open = library_module.os.open

    def full_disk(path, flags, *args, **kwargs):
        if Path(path).name == ".lock" and flags & library_module.os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *args, **kwargs)

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(library_module.os, "open", full_disk)
    with pytest.raises(
        LibraryError, match=r"fresh/\.lock: cannot open the library's lock file \(.*No space left"
    ):
        ReferenceLibrary.open(fresh, KEY)


def test_an_episode_file_is_never_written_over(tmp_path: Path) -> None:
    """A second line of defence behind the lock: a writer whose next id's file exists already (another
    writer's, that got past the lock) is refused, that file intact, its own library as it was; its next
    recording takes the next id."""
    lib = ReferenceLibrary.open(tmp_path, KEY)
    first = lib.add(episode(seed=1), {"task": "t"})
    theirs = tmp_path / "episode_000001.safetensors"
    theirs.write_bytes(b"another writer's episode")
    index = (tmp_path / "index.json").read_bytes()
    with pytest.raises(LibraryError, match=r"episode_000001\.safetensors: an episode file of this id exists"):
        lib.add(episode(seed=2), {"task": "t"})
    assert (
        theirs.read_bytes() == b"another writer's episode" and (tmp_path / "index.json").read_bytes() == index
    )
    assert sorted(lib.entries) == [first] and not list(tmp_path.glob(".episode_*"))
    assert lib.add(episode(seed=2), {"task": "t"}) == 2
    lib.close()


@pytest.mark.parametrize(
    ("marker", "whose"),
    [
        ("{host} 1", "written before this host last booted"),
        ("3f2a9c1b7d4e 27", "it names another host (3f2a9c1b7d4e"),
        ("garbled", "it is garbled"),
    ],
    ids=["pid reused", "other host", "garbled"],
)
def test_an_earlier_versions_stale_marker_never_blocks_the_library(
    tmp_path: Path, caplog, marker: str, whose: str
) -> None:
    """A marker left by a power cut (its pid reused by a live process after the reboot: written before
    the boot) or by a container since recreated (another hostname): before (found in review) either
    blocked the library until it was deleted by hand. It is removed, saying whose it was, and this
    process's marker takes its place."""
    import socket

    from rmuscle_ros.cache.library import OPEN_MARKER, holder

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode())
    lib.close()
    (tmp_path / OPEN_MARKER).write_text(marker.format(host=socket.gethostname()))
    os.utime(tmp_path / OPEN_MARKER, (0, 0))  # 1970: before any boot
    assert holder(tmp_path) is None
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.library")
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.entries) == [0]
    assert (tmp_path / OPEN_MARKER).read_text() == f"{socket.gethostname()} {os.getpid()}"
    said = [r.getMessage() for r in caplog.records if "open marker of" in r.getMessage()]
    assert len(said) == 1 and marker.format(host=socket.gethostname()) in said[0] and whose in said[0], said
    again.close()
    assert not (tmp_path / OPEN_MARKER).exists(), "removed at close: it was this process's"


def test_a_folder_where_the_lock_cannot_be_created_opens_read_only(tmp_path: Path, monkeypatch) -> None:
    """A read-only mount: the library still serves its episodes, but recording and removing are refused
    by name (before, found in review, the open went on without any guard and a recording could be lost)."""
    import errno

    from rmuscle_ros.cache import library as library_module

    lib = ReferenceLibrary.open(tmp_path, KEY)
    kept = lib.add(episode(seed=1), {"task": "t"})
    lib.close()
    before = _files(tmp_path)
    real_open = library_module.os.open

    def read_only(path, flags, *args, **kwargs):
        if flags & (library_module.os.O_WRONLY | library_module.os.O_RDWR | library_module.os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(library_module.os, "open", read_only)
    ro = ReferenceLibrary.open(tmp_path, KEY, max_episodes=1)
    assert ro.read_only and sorted(ro.entries) == [kept]
    assert np.array_equal(ro.load(kept).images, episode(seed=1).images)
    with pytest.raises(
        LibraryError, match=r"cannot record an episode: the library was opened read-only \(its lock"
    ):
        ro.add(episode(seed=2), {"task": "t"})
    with pytest.raises(LibraryError, match="cannot remove episodes: the library was opened read-only"):
        ro.remove([kept])
    ro.close()
    monkeypatch.undo()
    assert _files(tmp_path) == before


@pytest.mark.parametrize("name", ["../precious.txt", "{victim}", "episode_000001.safetensors"])
def test_an_index_entry_naming_a_file_not_its_own_is_refused(tmp_path: Path, capsys, name: str) -> None:
    """An index entry whose file is a path (absolute, `../`) or another episode's: before (found in review)
    `remove` deleted that file, outside the library. The index is refused, naming the entry, and nothing
    is deleted."""
    from rmuscle_ros.cache.library import main

    root, victim = tmp_path / "lib", tmp_path / "precious.txt"
    victim.write_text("the operator's")
    lib = ReferenceLibrary.open(root, KEY)
    lib.add(episode(seed=1))
    lib.add(episode(seed=2))
    lib.close()
    index = json.loads((root / "index.json").read_text())
    index["episodes"][0]["file"] = name.format(victim=victim)
    (root / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match=r"episode entry 0: file .* is not episode 0's file"):
        ReferenceLibrary.open(root, KEY)
    assert main(["remove", str(root), "0"]) == 2
    assert "is not episode 0's file" in capsys.readouterr().err
    assert victim.exists() and (root / "episode_000001.safetensors").exists()


@pytest.mark.parametrize(
    ("malformed", "what"),
    [
        (lambda index: index["episodes"][0].update(meta=None), "meta is None, not an object of strings"),
        (lambda index: index["episodes"][0].update(bytes="5"), "bytes is '5', not an integer >= 0"),
        (lambda index: index["episodes"][0].update(id="0"), "id is '0', not an integer >= 0"),
        (lambda index: index["episodes"][0].update(file=7), "file is 7, not a file name"),
        (lambda index: index["episodes"][0].update(created="today"), "created is 'today', not a time"),
        (lambda index: index["key"].update(shapes=[1]), "key shapes is [1], not an object"),
        (lambda index: index["key"]["shapes"].update(cameras={"n": 2}), "key shapes ['cameras']"),
    ],
    ids=["meta null", "bytes string", "id string", "file number", "created string", "shapes list", "shape"],
)
def test_an_index_field_of_the_wrong_type_is_a_library_error(
    tmp_path: Path, capsys, malformed, what: str
) -> None:
    """Fields present but of another type (an index edited by hand): before (found in review) the command
    line and open failed with AttributeError / TypeError tracebacks. Each is a LibraryError naming the
    entry and the field, and the command line exits 2 with its message."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(), {"task": "t"})
    lib.close()
    index = json.loads((tmp_path / "index.json").read_text())
    malformed(index)
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match="unreadable library index") as e:
        ReferenceLibrary.open(tmp_path, KEY)
    assert what in str(e.value)
    for command in (["list"], ["verify"], ["similarity"], ["remove", "0"]):
        assert main([command[0], str(tmp_path), *command[1:]]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith("error: ") and what in err, (command, err)


@pytest.mark.parametrize("what", ["file", "dangling link"])
def test_a_library_path_that_is_no_folder_fails_the_open(tmp_path: Path, what: str) -> None:
    """A library_path that is a file, or a link to a drive not mounted: before (found in review) it opened
    as an empty library and failed only at the first recording. The open fails, naming what it is."""
    path = tmp_path / "library"
    if what == "file":
        path.write_text("notes")
        match = r"library: a file, not a folder"
    else:
        path.symlink_to(tmp_path / "media" / "lib")
        match = (
            r"library: a symbolic link to .*media/lib, which does not exist \(a drive that is not mounted\?\)"
        )
    with pytest.raises(LibraryError, match=match):
        ReferenceLibrary.open(path, KEY)
    assert not (tmp_path / "media").exists()


def test_bounds_lowered_since_recording_apply_at_open(tmp_path: Path, caplog, capsys) -> None:
    """A library reopened with a lower max_episodes or max_bytes: before (found in review) it served all its
    episodes until the next recording evicted many at once. A writer that passes bounds evicts at open, as
    a recording would (least recently used first), and says what and why; the command line's reads, an
    opener passing no bounds and one that records nothing delete nothing."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    ids = [lib.add(episode(seed=s), {"task": "pick"}) for s in range(6)]
    lib.touch(ids[0])  # served from last: kept
    size = lib.entries[ids[0]].bytes
    lib.close()
    assert main(["list", str(tmp_path)]) == 0 and main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    unbounded = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(unbounded.entries) == ids
    unbounded.close()
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.library")
    # An opener that records nothing (the node with cache.record off) deletes nothing at open (found in
    # review: a bring-up with recording off and a typo'd bound deleted other tasks' episodes)
    reader = ReferenceLibrary.open(tmp_path, KEY, max_episodes=3, evict_at_open=False)
    assert sorted(reader.entries) == ids and len(list(tmp_path.glob("episode_*"))) == 6
    reader.close()
    assert "evicted" not in caplog.text
    lowered = ReferenceLibrary.open(tmp_path, KEY, max_episodes=3)
    assert sorted(lowered.entries) == [ids[0], ids[4], ids[5]]
    assert "held 6 episode(s)" in caplog.text and "evicted episode(s) [1, 2, 3] at open" in caplog.text
    assert sorted(e["id"] for e in json.loads((tmp_path / "index.json").read_text())["episodes"]) == [0, 4, 5]
    assert sorted(p.name for p in tmp_path.glob("episode_*")) == [
        f"episode_{i:06d}.safetensors" for i in (0, 4, 5)
    ]
    # The two most recently used, by their own sizes: episode files differ by a few header bytes (their
    # metadata), so twice the first one's size failed the suite once (another seed's file was larger).
    two = lowered.entries[ids[0]].bytes + lowered.entries[ids[5]].bytes
    assert two < 3 * size
    lowered.close()
    smaller = ReferenceLibrary.open(tmp_path, KEY, max_bytes=two)
    assert sorted(smaller.entries) == [ids[0], ids[5]]
    smaller.close()


def test_the_command_line_refuses_a_library_of_another_version(tmp_path: Path, capsys) -> None:
    """`list` / `verify` on a library of another format: before (found in review) they reported success. They
    refuse it with the node's message."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(), {"task": "t"})
    lib.close()
    index = json.loads((tmp_path / "index.json").read_text())
    index["version"] = 2
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError) as e:
        ReferenceLibrary.open(tmp_path, KEY)
    for command in ("list", "verify", "similarity"):
        assert main([command, str(tmp_path)]) == 2
        assert capsys.readouterr().err.strip() == f"error: {e.value}"
    assert (
        "library version 2 was written by a newer rmuscle_ros than this one (it reads version 1); the "
        "library is left as it was: update rmuscle_ros to use it" in str(e.value)
    )
    index["version"] = True  # True == 1 in Python: not a version
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(LibraryError, match="library version True, this build reads 1"):
        ReferenceLibrary.open(tmp_path, KEY)


def _sleeper():
    """A live process of this host (an earlier version's node, for its open marker)."""
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def _lock_is_free(root: Path) -> bool:
    import fcntl

    fd = os.open(root / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_a_library_an_earlier_versions_live_node_has_open_is_refused_and_this_one_keeps_it_out(
    tmp_path: Path, caplog, capsys
) -> None:
    """Earlier versions guard a library by their open marker only (`.open`, "<host> <pid>", no lock).
    Before (found in review) this version deleted a live earlier node's marker at open and both wrote one
    index, and `holder` named nobody. The marker of a live process of this host, written since the boot,
    now refuses the open (naming it, the lock given back) and is named by the command line; once that
    process is gone it is removed, saying whose it was. While open, this version writes the marker too,
    exactly as earlier versions parse it, so that an earlier node refuses the library; close removes it."""
    import socket

    from rmuscle_ros.cache.library import OPEN_MARKER, LibraryBusy, holder, main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(), {"task": "t"})
    host, pid = (tmp_path / OPEN_MARKER).read_text().split()  # as an earlier version reads it
    assert (host, pid) == (socket.gethostname(), str(os.getpid()))
    lib.close()
    assert not (tmp_path / OPEN_MARKER).exists() and (tmp_path / ".lock").read_text() == ""

    old = _sleeper()
    try:
        (tmp_path / OPEN_MARKER).write_text(f"{socket.gethostname()} {old.pid}")
        assert holder(tmp_path) == (
            f"{socket.gethostname()} {old.pid}, a node of an earlier version (its open marker "
            f"{tmp_path / OPEN_MARKER})"
        )
        assert main(["remove", str(tmp_path), "0"]) == 75
        assert (
            f"is open in process {socket.gethostname()} {old.pid}, a node of an earlier"
            in capsys.readouterr().err
        )
        with pytest.raises(
            LibraryBusy,
            match=rf"open in process {socket.gethostname()} {old.pid}, a node of an earlier version",
        ) as e:
            ReferenceLibrary.open(tmp_path, KEY)
        assert "stop that node, or, if that process is gone, delete" in str(e.value)
        assert _lock_is_free(tmp_path), "the refused open gave the lock back"
        assert (tmp_path / OPEN_MARKER).read_text() == f"{socket.gethostname()} {old.pid}", "its marker stays"
    finally:
        old.kill()
        old.wait()
    assert holder(tmp_path) is None
    caplog.set_level("WARNING", logger="rmuscle_ros.cache.library")
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.entries) == [0]
    assert f"the open marker of {socket.gethostname()} {old.pid}, an earlier version's" in caplog.text
    assert f"its process {old.pid} is gone" in caplog.text
    assert (tmp_path / OPEN_MARKER).read_text() == f"{socket.gethostname()} {os.getpid()}"
    again.close()


def test_this_versions_marker_left_by_a_holder_that_is_gone_is_removed_quietly(
    tmp_path: Path, caplog
) -> None:
    """A holder of this version killed while open leaves its marker, naming what the lock file names: it
    is that holder's (the lock was free), removed without a warning even if its pid now names a live
    process. The lock file's name is read before this opener writes its own over it."""
    import socket

    from rmuscle_ros.cache.library import LOCK_FILE, OPEN_MARKER

    ReferenceLibrary.open(tmp_path, KEY).close()
    reused = _sleeper()
    try:
        named = f"{socket.gethostname()} {reused.pid}"
        (tmp_path / LOCK_FILE).write_text(named)
        (tmp_path / OPEN_MARKER).write_text(named)
        caplog.set_level("INFO", logger="rmuscle_ros.cache.library")
        lib = ReferenceLibrary.open(tmp_path, KEY)
    finally:
        reused.kill()
        reused.wait()
    assert (tmp_path / OPEN_MARKER).read_text() == f"{socket.gethostname()} {os.getpid()}"
    assert any(
        r.levelname == "INFO" and f"the open marker of {named}" in r.getMessage() for r in caplog.records
    )
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    lib.close()


def test_an_earlier_versions_marker_draft_is_kept_while_its_process_lives(tmp_path: Path) -> None:
    """An earlier version's node writes its marker to `.open.tmp-<pid>` first: before (found in review)
    this version's open deleted that draft as a leftover, and the node went on without its marker. A
    draft whose process is gone is still deleted."""
    import subprocess
    import sys

    ReferenceLibrary.open(tmp_path, KEY).close()
    gone = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout
    )
    old = _sleeper()
    try:
        live = tmp_path / f".open.tmp-{old.pid}"
        live.write_text("an earlier version's marker, being taken")
        for dead in (f".open.tmp-{gone}", f".open.tmp-stale-{gone}"):
            (tmp_path / dead).write_text("left")
        ReferenceLibrary.open(tmp_path, KEY).close()
        assert live.read_text() == "an earlier version's marker, being taken"
        assert sorted(p.name for p in tmp_path.glob(".open.tmp-*")) == [live.name]
    finally:
        old.kill()
        old.wait()


def test_a_library_folder_that_cannot_be_created_fails_the_open(tmp_path: Path, monkeypatch) -> None:
    """A library_path whose folder does not exist and cannot be created (a typo under a folder the node
    may not write): before (found in review) it opened as an empty read-only library. The open fails,
    naming the path and the error; an existing folder where the lock cannot be created still opens
    read-only (`test_a_folder_where_the_lock_cannot_be_created_opens_read_only`)."""
    import errno

    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(
        LibraryError,
        match=r"libary: the library's folder does not exist and cannot be created \(\[Errno 13\] Permission",
    ):
        ReferenceLibrary.open(tmp_path / "libary", KEY)


def test_a_fork_child_holds_none_of_its_parents_locks(tmp_path: Path) -> None:
    """A fork child (multiprocessing's fork start method) inherits the lock's descriptor and the registry:
    before (found in review) it opened the library its parent holds as a second writer, and kept the lock
    once the parent had closed it. The child is refused (the lock is its parent's), may not write through
    the library object it inherited, and holds nothing once the parent closes."""
    import socket

    from rmuscle_ros.cache import lock as lock_module
    from rmuscle_ros.cache.library import LibraryBusy, holder

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(), {"task": "t"})
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        try:
            os.close(said_r)
            os.close(go_w)
            said = ["registry empty" if not lock_module._LOCKS else "registry inherited"]
            try:
                ReferenceLibrary.open(tmp_path, KEY)
                said.append("opened")
            except LibraryBusy as e:
                said.append(
                    "busy" if f"open in process {socket.gethostname()} {os.getppid()}" in str(e) else str(e)
                )
            try:
                lib.add(episode(seed=1), {"task": "t"})
                said.append("added")
            except LibraryError as e:
                said.append("refused" if "of which this one is a fork" in str(e) else str(e))
            lib.close()  # the inherited object: the parent's lock stays the parent's
            os.write(said_w, ";".join(said).encode())
            os.close(said_w)
            os.read(go_r, 1)  # alive until the parent has looked
        finally:
            os._exit(0)
    os.close(said_w)
    os.close(go_r)
    try:
        assert os.read(said_r, 4096).decode() == "registry empty;busy;refused"
        assert holder(tmp_path) == f"{socket.gethostname()} {os.getpid()}", "the child's close kept it"
        assert lib.add(episode(seed=2), {"task": "t"}) == 1
        lib.close()
        assert holder(tmp_path) is None and _lock_is_free(tmp_path), "the live child holds no lock"
    finally:
        os.close(go_w)
        os.close(said_r)
        os.waitpid(child, 0)


def test_a_library_renamed_while_open_is_found_by_its_lock_file(tmp_path: Path) -> None:
    """This process's locks are found by their lock file (device, inode), not by path: before (found in
    review) a library renamed while open and opened at its new name was said to be open in "another"
    process, this one. It is refused as already open here, naming where; once closed it opens."""
    import socket

    from rmuscle_ros.cache.library import LibraryBusy, holder

    lib = ReferenceLibrary.open(tmp_path / "A", KEY)
    lib.add(episode(), {"task": "t"})
    (tmp_path / "A").rename(tmp_path / "B")
    with pytest.raises(LibraryBusy, match=r"already open in this process \(opened at .*/A, not closed yet\)"):
        ReferenceLibrary.open(tmp_path / "B", KEY)
    assert holder(tmp_path / "B") == f"{socket.gethostname()} {os.getpid()}"
    lib.close()
    again = ReferenceLibrary.open(tmp_path / "B", KEY)
    assert sorted(again.entries) == [0]
    again.close()
    assert not (tmp_path / "B" / ".open").exists()


def test_a_filesystem_without_locks_fails_the_open_saying_how_to_mount_it(
    tmp_path: Path, monkeypatch
) -> None:
    """NFS without lockd answers flock with ENOLCK: the open still fails (without the lock a second writer
    could drop this one's recordings), saying the cause and the remedy, not only the OS's words."""
    import errno

    from rmuscle_ros.cache import lock as lock_module

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_locks)
    with pytest.raises(LibraryError, match=r"No locks available\): its filesystem keeps no locks") as e:
        ReferenceLibrary.open(tmp_path, KEY)
    assert "local_lock=flock" in str(e.value) and "point library_path at a local folder" in str(e.value)


def test_a_closed_library_writes_nothing_and_a_damaged_index_is_refused_naming_it(tmp_path: Path) -> None:
    """Found in review, each reproduced: a closed library's remove() rewrote the index from its own memory
    without the lock, dropping the episode of the process that had opened it since; an index listing one
    episode twice served it and left it out at once, and a remove then lost its file; an unknown field in
    the key read as a shape mismatch naming no shape (and advising to delete a matching library); a lone
    surrogate in a task name (JSON's \\udc80) made `list` die; an index nested past Python's recursion
    limit escaped as a RecursionError."""
    first = ReferenceLibrary.open(tmp_path, KEY)
    first.add(episode(seed=0))
    first.add(episode(seed=1))
    first.close()
    second = ReferenceLibrary.open(tmp_path, KEY)
    kept = second.add(episode(seed=2))
    with pytest.raises(LibraryError, match="cannot remove episodes: the library was closed"):
        first.remove([0])
    with pytest.raises(LibraryError, match="cannot write its index: the library was closed"):
        first.save_index()
    first.touch(1)
    first.close()  # a second close: the use is not written either
    second.close()
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [0, 1, kept]

    def edited(change) -> str:  # the index edited by `change`, then opened: the error's text
        index_path = tmp_path / "index.json"
        good = index_path.read_text()
        index = json.loads(good)
        change(index)
        index_path.write_text(json.dumps(index))
        try:
            with pytest.raises(LibraryError) as refused:
                ReferenceLibrary.open(tmp_path, KEY)
            return str(refused.value)
        finally:
            index_path.write_text(good)

    said = edited(lambda index: index["episodes"].append(dict(index["episodes"][0], sha256="0" * 64)))
    assert "episode entry 3: episode 0 is listed twice" in said
    said = edited(lambda index: index["key"].update(note="x"))
    assert "unreadable library index (key has unknown field(s) ['note'])" in said
    said = edited(lambda index: index["episodes"][0].update(meta={"task": "\udc80"}))
    assert "meta is {'task': '\\udc80'}, not an object of strings (UTF-8)" in said
    good = (tmp_path / "index.json").read_text()
    (tmp_path / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LibraryError, match=r"unreadable library index .*recursion"):
        ReferenceLibrary.open(tmp_path, KEY)
    (tmp_path / "index.json").write_text(good)
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [0, 1, kept]


def test_reindex_does_not_take_a_file_damaged_since_its_index_recorded_it(tmp_path: Path, capsys) -> None:
    """A disk fault damages an episode file and the index: open leaves the file out (its checksum), but
    `reindex` rebuilt the index from the files with their checksums taken afresh, and the damaged episode
    was served as good (found in review). The checksums the damaged index still records are kept to."""
    from rmuscle_ros.cache.library import main

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(seed=1), {"task": "t"})
    lib.add(episode(seed=2), {"task": "t"})
    lib.close()
    victim = tmp_path / "episode_000001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF  # in its tensors' data
    victim.write_bytes(bytes(data))
    index = json.loads((tmp_path / "index.json").read_text())
    index["episodes"][0]["calls"] = -1  # the index damaged too, in another field
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert main(["reindex", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "episode_000001.safetensors: its checksum is not the one the unreadable index recorded" in out
    assert "indexed episode(s) [0]" in out
    again = ReferenceLibrary.open(tmp_path, KEY)
    assert sorted(again.entries) == [0]
    again.close()


def test_a_reindex_killed_before_its_new_index_is_in_place_leaves_the_old_one(tmp_path: Path) -> None:
    """Found in review: reindex renamed a refused index aside before writing the new one, so a kill between
    the two left no index.json, and the next open found an empty library, saying nothing. The index now
    stays in place (a copy is set aside) until the new one replaces it."""
    import subprocess
    import sys

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(seed=0))
    lib.add(episode(seed=1))
    lib.close()
    index = json.loads((tmp_path / "index.json").read_text())
    index["episodes"][0]["calls"] = -1  # a hand edit: refused at open, rebuilt by reindex
    (tmp_path / "index.json").write_text(json.dumps(index))
    killed = (
        "import os, sys\n"
        "from rmuscle_ros.cache.library import ReferenceLibrary\n"
        "real = os.replace\n"
        "def replace(src, dst, *a, **k):\n"
        "    if str(dst).endswith('index.json'):\n"
        "        os._exit(9)  # killed as the new index is renamed into place\n"
        "    real(src, dst, *a, **k)\n"
        "os.replace = replace\n"
        "ReferenceLibrary.reindex(sys.argv[1])\n"
    )
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path)], timeout=120).returncode == 9
    assert list(tmp_path.glob("index.json.corrupt-*")), "the refused index was not set aside"
    with pytest.raises(LibraryError, match="calls is -1"):  # still refused, never an empty library
        ReferenceLibrary.open(tmp_path, KEY)
    _, notes, ok = ReferenceLibrary.reindex(tmp_path)
    assert ok and "set aside as index.json.corrupt-" in " ".join(notes)
    assert len(list(tmp_path.glob("index.json.corrupt-*"))) == 1, "the same index set aside twice"
    assert sorted(ReferenceLibrary.open(tmp_path, KEY).entries) == [0, 1]


def test_reindex_names_episode_files_that_do_not_load_as_numbers(tmp_path: Path) -> None:
    """Found in review: a file whose descriptors were 0-d, or of bfloat16 (numpy has none), escaped reindex
    as an IndexError or a TypeError; each is now skipped, named."""
    import struct

    from safetensors.numpy import save_file

    ReferenceLibrary.open(tmp_path, KEY).add(episode())
    stamp = {"key": json.dumps(KEY.to_json())}
    tensors = episode().tensors()
    tensors["descriptors"] = np.array(1.0, np.float32)
    save_file(tensors, str(tmp_path / "episode_000005.safetensors"), metadata=stamp)
    header = json.dumps(
        {"descriptors": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}, "__metadata__": stamp}
    ).encode()
    (tmp_path / "episode_000007.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0\0")
    indexed, notes, ok = ReferenceLibrary.reindex(tmp_path)
    assert indexed == [] and not ok
    assert any(n.startswith("episode_000005.safetensors: does not load (IndexError") for n in notes), notes
    # numpy has no bfloat16 (TypeError) unless a package imported before registered one (ml_dtypes, by onnx):
    # then the file loads, and lacks the episode's other tensors (KeyError). Named either way.
    assert any(n.startswith("episode_000007.safetensors: does not load (") for n in notes), notes


def test_the_lock_is_never_followed_through_a_link_and_an_interrupted_close_gives_it_up(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """Found in review: a `.lock` that was a symbolic link had the file it named emptied (this process's
    name is written into the lock file); an interrupt (Ctrl-C) during close kept the lock for the rest of
    the process, so a lifecycle cleanup then configure could never open the library again. And a library
    whose one episode is larger than a lowered max bytes said "evicted []" and rewrote its index."""
    import logging

    from rmuscle_ros.cache import lock as lock_module

    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    root = tmp_path / "lib"
    root.mkdir()
    (root / ".lock").symlink_to(victim)
    with pytest.raises(LibraryError, match="lock file is a symbolic link; remove it"):
        ReferenceLibrary.open(root, KEY)
    assert victim.read_text() == "keep me"
    (root / ".lock").unlink()

    lib = ReferenceLibrary.open(root, KEY)
    lib.add(episode())

    def interrupted(fd: int, length: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(lock_module.os, "ftruncate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lib.close()
    monkeypatch.undo()
    size = (root / "episode_000000.safetensors").stat().st_size
    index_before = (root / "index.json").read_bytes()
    with caplog.at_level(logging.WARNING):
        again = ReferenceLibrary.open(root, KEY, max_bytes=size // 2)
    assert sorted(again.entries) == [0] and (root / "index.json").read_bytes() == index_before
    assert "its one episode" in caplog.text and "is larger than max bytes" in caplog.text
    assert "evicted episode(s) []" not in caplog.text


def test_an_interrupted_recording_leaves_no_file_the_index_does_not_name(tmp_path: Path, monkeypatch) -> None:
    """Found in review: an interrupt (Ctrl-C at a node's shutdown) after the episode's file took its name
    and before the index named it (hashing the file, ~34 MB at pi05, or syncing the folder) left the file
    unindexed; the runtime recorded the episode again under a new id, and `reindex` then adopted both. The
    file is hashed before it takes its name, and one placed then interrupted is removed. RMuscleConfig's
    counts are integers (top_k 2.5 failed at the first call)."""
    from rmuscle_ros.cache import library as library_module
    from rmuscle_ros.cache.runtime import RMuscleConfig

    lib = ReferenceLibrary.open(tmp_path, KEY)
    lib.add(episode(seed=0))
    index_before = (tmp_path / "index.json").read_bytes()

    def interrupted(path: Path) -> None:
        raise KeyboardInterrupt

    for where in ("_sha256", "_fsync_dir"):
        with monkeypatch.context() as patch:
            patch.setattr(library_module, where, interrupted)
            with pytest.raises(KeyboardInterrupt):
                lib.add(episode(seed=1))
        assert sorted(p.name for p in tmp_path.glob("episode_*")) == ["episode_000000.safetensors"], where
        assert (tmp_path / "index.json").read_bytes() == index_before and sorted(lib.entries) == [0]
    assert lib.add(episode(seed=1)) == 3  # ids are never given twice
    lib.close()
    assert ReferenceLibrary.reindex(tmp_path) == ([], [], True)
    for bad in ({"top_k": 2.5}, {"max_library_mb": 1.5}, {"rebuilds_per_tick": math.nan}, {"anchors": True}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer"):
            RMuscleConfig(**bad)


def test_whose_process_is_alive_another_users_pid_0_and_a_draft_from_before_the_boot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pid_exists decides whether a marker's or a writer's process lives: another user's process (kill
    answers EPERM) lives, so its marker blocks the library and its staging files stay; pid 0 (and below)
    names no process (kill(0) would ask about this process group). A marker draft written before this
    host booted is a leftover though its pid exists again. Found by a mutation review."""
    from rmuscle_ros.cache import lock

    assert not lock.pid_exists(0) and not lock.pid_exists(-5)
    draft = tmp_path / f".open.tmp-{os.getpid()}"
    draft.write_text("")
    assert lock.marker_draft_alive(draft)
    os.utime(draft, (1e9, 1e9))  # 2001: before this boot
    assert not lock.marker_draft_alive(draft)

    def another_users(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", another_users)
    assert lock.pid_exists(4242)
