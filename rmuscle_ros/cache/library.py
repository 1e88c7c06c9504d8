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
  disk does not have. A write that fails (a full disk) deletes its partial file; the partial files of a
  writer that died are deleted at the next open, and an episode file the index does not name is
  reported there and kept (its id is never reused).
- **Checked.** Every episode file's sha256 is verified on open; a corrupt or missing episode is reported
  and left out (its file is kept for inspection), never silently used. A corrupt index is an error; it is
  moved aside (not deleted) before a new library is saved in its place.
- **Bounded.** `max_bytes` / `max_episodes`, evicting the least recently used episode of the task that
  holds the most (episodes recorded without a task, which are never served, go first): a job the cell
  runs all day does not evict another job's episodes, only its own oldest. An episode is used when a call
  is served from it (`touch`) or its file is read; that time is kept in the index (written at the next
  add or remove, and at `close`), so it survives a restart.
- **One writer.** An open library holds a marker (`.open`: host and pid, removed by `close`). Opening a
  library another live process has open is refused (`LibraryBusy`): two nodes given the same folder
  would each rewrite the index from their own memory and drop the other's episodes. The command line
  below refuses to remove episodes from a library a live process has open, for the same reason.
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
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

log = logging.getLogger(__name__)

LIBRARY_VERSION = 1
INDEX = "index.json"
OPEN_MARKER = ".open"  # "<host> <pid>" of the process that has the library open for writing
TMP_INFIX = ".tmp-"  # ".<name>.tmp-<pid>": a file being written, renamed to <name> once it is on disk
EPISODE_FILE = re.compile(r"episode_(\d{6,})\.safetensors")
EPISODE_TENSORS = ("descriptors", "images", "tokens", "token_mask")
OPTIONAL_TENSORS = ("action_masks", "image_masks")


class LibraryError(RuntimeError):
    """A library that cannot be used (corrupt index, unknown version)."""


class LibraryMismatch(LibraryError):
    """A library recorded with other weights or shapes. `fields` names what differs ("weights", or the
    shapes' keys such as "mask_steps"), each with both values in `detail`; `recorded_under` says which of
    the caller's settings those are (`with_settings`), so that a cell knows what to set back."""

    def __init__(self, path: Path, fields: tuple[str, ...], detail: str, recorded_under: str = "") -> None:
        self.path, self.fields, self.detail, self.recorded_under = path, fields, detail, recorded_under
        what = "weights" if fields == ("weights",) else "shapes"
        under = (
            f"; it was recorded under other {recorded_under}: set them back to serve it, or"
            if recorded_under
            else ";"
        )
        super().__init__(
            f"{path}: recorded with other {what} than the loaded model ({detail}){under} point library_path "
            "elsewhere or delete it to record a new library"
        )

    def with_settings(self, recorded_under: str) -> LibraryMismatch:
        return LibraryMismatch(self.path, self.fields, self.detail, recorded_under)


class LibraryBusy(LibraryError):
    """The library is open in another live process (a running node), which owns its index."""


class EpisodeUnreadable(LibraryError):
    """An episode whose file could not be read after open checked it (damaged or removed since)."""


@dataclass(frozen=True)
class LibraryKey:
    """What a library must match: the model's weights fingerprint and the shapes it stores."""

    weights: str  # rmuscle_ros.models.checkpoint.weights_fingerprint(model)
    shapes: Mapping[str, int | list[int]]  # e.g. cameras, descriptor_dim, image_size, max_tokens

    def to_json(self) -> dict:
        return {"weights": self.weights, "shapes": dict(self.shapes)}


def _mismatch(index_path: Path, stored: Any, key: LibraryKey) -> LibraryMismatch:
    """What differs between a library's key and the model's, each field named with both values."""
    stored = stored if isinstance(stored, dict) else {}
    stored_shapes = stored.get("shapes") if isinstance(stored.get("shapes"), dict) else {}
    if stored.get("weights") != key.weights:
        fields: tuple[str, ...] = ("weights",)
        detail = f"library {stored.get('weights')!r}, model {key.weights!r}"
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
    return LibraryMismatch(index_path, fields, detail)


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


def _entries(index_path: Path, episodes: Any) -> list[EpisodeEntry]:
    """The index's episode entries. An index that parses but whose entries are not the library's (not a
    list of objects, a field missing or unknown) is a LibraryError naming the index and the entry."""
    if not isinstance(episodes, list):
        raise LibraryError(f"{index_path}: unreadable library index (episodes is not a list)")
    entries = []
    for i, raw in enumerate(episodes):
        try:
            entries.append(EpisodeEntry(**raw))
        except TypeError as e:  # not a mapping, or a missing or unexpected field: e names it
            raise LibraryError(f"{index_path}: unreadable library index (episode entry {i}: {e})") from None
    return entries


def _identity(path: Path) -> tuple[int, int] | None:
    """Which file is at `path` (device, inode), None if none: a rename onto `path` makes it another."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_dev, stat.st_ino


def _fsync_dir(folder: Path) -> None:
    """Make the renames in `folder` durable: a rename is an entry of the folder, which its own fsync
    writes (on Linux; elsewhere a folder cannot be opened for it, and this does nothing)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # the rename is done: say that it may not survive a power cut, do not undo it
        log.warning("reference library %s: the folder could not be synced (%s): its latest rename may not "
                    "survive a power cut", folder, e)  # fmt: skip
    finally:
        os.close(fd)


def _replace_durably(tmp: Path, path: Path) -> None:
    """Rename `tmp` onto `path` and sync the folder. Once this returns or raises, the rename either
    happened (the folder's sync only logs a failure) or did not (os.replace raised)."""
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _temporary(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (see `_leftovers`)."""
    return path.with_name(f".{path.name}{TMP_INFIX}{os.getpid()}")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _replace_durably(tmp, path)
    except BaseException:  # a full disk: the partial file must not keep holding the space
        tmp.unlink(missing_ok=True)
        raise


def _unnamed(root: Path, indexed: set[int]) -> dict[int, str]:
    """Episode files in `root` whose id the index does not hold: id -> file name."""
    files = root.glob("episode_*.safetensors") if root.is_dir() else ()
    return {
        int(m.group(1)): path.name
        for path in files
        if (m := EPISODE_FILE.fullmatch(path.name)) and int(m.group(1)) not in indexed
    }


def _marker_draft(root: Path, suffix: str) -> Path:
    """A file of one process's own beside the open marker (`_mark_open`, `_remove_stale_marker`), named
    by its pid (last, after a '-')."""
    return root / f"{OPEN_MARKER}{TMP_INFIX}{suffix}"


def _leftovers(root: Path) -> list[Path]:
    """Temporary files of writes that never finished (a process killed mid-write, a power cut). The open
    marker's drafts count only once their process is gone: a live one may be taking the marker."""
    ours = (f".{INDEX}{TMP_INFIX}*", f".{OPEN_MARKER}{TMP_INFIX}*", f".episode_*.safetensors{TMP_INFIX}*")
    found = [p for pattern in ours for p in root.glob(pattern) if p.is_file()]
    for draft in root.glob(_marker_draft(root, "*").name):
        pid = draft.name.rsplit("-", 1)[-1]
        if draft.is_file() and pid.isdigit() and not holder_of(socket.gethostname(), pid):
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
        self.left_out: dict[int, EpisodeEntry] = {}  # the index's episodes whose files open() refused
        self._next_id = 0
        self._unsaved_use = False  # touch() since the index was last written

    # ── open / save ──────────────────────────────────────────────────────────────────────────────────────

    @classmethod
    def open(cls, root: Path, key: LibraryKey, **bounds: int) -> ReferenceLibrary:
        """Load the index at `root` (empty library if there is none) and verify every episode file.
        LibraryBusy if another live process has it open (a marker left by a process that is gone is not).
        The marker is taken first, before the index is read: a `remove` or a second node that comes while
        this one reads and verifies (seconds, for gigabytes of episodes) finds the library busy (before,
        found in review, it did not, and this one's index in memory put a removed episode back)."""
        lib = cls(root, key, **bounds)
        lib._mark_open()
        try:
            lib._load()
        except BaseException:
            lib._unmark()
            raise
        return lib

    def _load(self) -> None:
        """Read the index at the root and verify every episode file (`open`)."""
        lib, key = self, self.key
        index_path = lib.root / INDEX
        if not index_path.exists():
            lib._tidy()
            return
        try:
            index = json.loads(index_path.read_text())
            version, stored_key, episodes = index["version"], index["key"], index["episodes"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LibraryError(
                f"{index_path}: unreadable library index ({e}); it was left untouched"
            ) from None
        if version != LIBRARY_VERSION:
            raise LibraryError(f"{index_path}: library version {version}, this build reads {LIBRARY_VERSION}")
        if stored_key != key.to_json():
            raise _mismatch(index_path, stored_key, key)
        entries = _entries(index_path, episodes)
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
        lib._tidy()

    def _tidy(self) -> None:
        """What writes that never finished left behind: their partial files are deleted, and episode files
        the index does not name are reported and kept, their ids never reused."""
        self._remove_leftovers()
        unnamed = _unnamed(self.root, set(self.entries) | set(self.left_out))
        if unnamed:
            log.warning(
                "reference library %s: episode file(s) the index does not name, kept and never used: %s "
                "(a recording whose index write failed, or an eviction whose delete did; delete them by hand)",
                self.root,
                ", ".join(unnamed[i] for i in sorted(unnamed)),
            )
            self._next_id = max(self._next_id, max(unnamed) + 1)  # never written over

    def _remove_leftovers(self) -> None:
        """Delete the partial files of writes that never finished: no live process has the library open
        (checked before this), so none is still writing them, and nothing names them. An episode written
        in full but not yet in the index when its writer died is one of them (its recording never
        finished: the index is written last)."""
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

    def _mark_open(self) -> None:
        """Take the open marker, or LibraryBusy if a live process holds it. The marker appears with its
        content at once (written to a file of this process's own, then hard-linked to the marker's name,
        which fails if the name exists), so of two processes opening at once one gets it and the other is
        refused, never sees it empty; a marker whose process is gone is taken over. A folder that cannot be
        written costs the marker, not the library: the node runs on and fails only where it records (its
        reset reports it)."""
        marker, me = self.root / OPEN_MARKER, _this_process()
        mine = _marker_draft(self.root, str(os.getpid()))
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # Written in place, not through _write_atomic: its temporary name is one a live holder's open
            # deletes as a leftover (`_leftovers`), which would leave this opener without a marker.
            with open(mine, "w") as out:
                out.write(me)
                out.flush()
                os.fsync(out.fileno())
            try:
                for _ in range(3):
                    try:
                        os.link(mine, marker)
                        return
                    except FileExistsError:
                        who = holder(self.root)
                        if who == me:  # this process has it open already (see `close`)
                            return
                        if who is not None:
                            raise LibraryBusy(
                                f"{self.root}: the library is open in process {who} (another node?): two "
                                "writers would drop each other's episodes from its index; give each node its "
                                "own library_path, or stop that process (if it is gone, e.g. on another host, "
                                f"delete {marker})"
                            ) from None
                        _remove_stale_marker(marker)  # its process is gone: take it over
                raise LibraryBusy(f"{self.root}: its open marker {marker} kept changing; try again")
            finally:
                mine.unlink(missing_ok=True)
        except OSError as e:
            log.warning(
                "reference library %s: cannot mark it open (%s); the command line will not see that it is",
                self.root,
                e,
            )

    def _unmark(self) -> None:
        """Remove the open marker if it is still this process's."""
        marker = self.root / OPEN_MARKER
        try:
            if marker.read_text() == _this_process():
                marker.unlink()
        except OSError:  # none (never written, or removed by hand)
            pass

    def close(self) -> None:
        """Give up the library: the episodes' last use is written to the index if it changed since the last
        write (a failed write is logged: the episodes are on disk already), then the marker is removed if it
        is still this process's."""
        if self._unsaved_use:
            try:
                self.save_index()
            except OSError as e:
                log.warning("reference library %s: its episodes' last use was not saved (%s)", self.root, e)
        self._unmark()

    def save_index(self) -> None:
        """Atomically replace index.json with the current entries (episode files are already on disk). The
        corrupt episodes open() left out stay in it: every open reports them until they are removed, and
        their ids stay taken, so that no new episode's file overwrites one kept for inspection."""
        self.root.mkdir(parents=True, exist_ok=True)
        index_path = self.root / INDEX
        if index_path.exists():
            try:
                json.loads(index_path.read_text())
            except ValueError:  # never overwrite what we could not read: keep it for inspection
                index_path.rename(index_path.with_name(f"{INDEX}.corrupt-{int(time.time())}"))
        index = {
            "version": LIBRARY_VERSION,
            "key": self.key.to_json(),
            "episodes": [
                asdict(e)
                for e in sorted([*self.entries.values(), *self.left_out.values()], key=lambda e: e.id)
            ],
        }
        _write_atomic(index_path, json.dumps(index, indent=1).encode())
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
        logged, not raised: the change is done, and the next open reports the file as one it does not name."""
        for entry in entries:
            try:
                (self.root / entry.file).unlink(missing_ok=True)
            except OSError as e:
                log.warning("reference library %s: cannot delete %s, which the index no longer names (%s)",
                            self.root, entry.file, e)  # fmt: skip

    # ── episodes ─────────────────────────────────────────────────────────────────────────────────────────

    def add(self, episode: Episode, meta: Mapping[str, str] | None = None) -> int:
        """Write a recorded episode, update the index atomically, evict LRU episodes past the bounds."""
        self.root.mkdir(parents=True, exist_ok=True)
        episode_id = self._next_id
        self._next_id += 1
        name = f"episode_{episode_id:06d}.safetensors"
        tmp = _temporary(self.root / name)
        try:
            save_file(episode.tensors(), str(tmp), metadata={"episode": str(episode_id)})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            _replace_durably(tmp, self.root / name)  # on disk before the index that names it
        except BaseException:  # a full disk: the partial file must not keep holding the space
            tmp.unlink(missing_ok=True)
            raise
        now = time.time()
        path = self.root / name
        self.entries[episode_id] = EpisodeEntry(
            episode_id, name, _sha256(path), episode.calls, path.stat().st_size, now, now, dict(meta or {})
        )
        evicted = self._evict(keep=episode_id)

        def undo() -> None:  # the index on disk is the previous one: so is the library, here too
            self.entries.pop(episode_id)
            self.entries.update((entry.id, entry) for entry in evicted)
            path.unlink(missing_ok=True)

        self._commit_index(undo)
        self._delete_files(evicted)  # only once the index no longer names them
        return episode_id

    def load(self, episode_id: int) -> Episode:
        """Read an episode (checksum verified on open; marks it used for LRU eviction)."""
        entry = self.entries[episode_id]
        try:
            tensors = load_file(str(self.root / entry.file))
            episode = Episode(
                **{k: tensors[k] for k in EPISODE_TENSORS}, **{k: tensors.get(k) for k in OPTIONAL_TENSORS}
            )
        except (OSError, SafetensorError, KeyError, ValueError) as e:
            raise EpisodeUnreadable(
                f"episode {episode_id}: {entry.file} could not be read ({type(e).__name__}: {e})"
            ) from e
        entry.last_used = time.time()
        self._unsaved_use = True
        return episode

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
        is removed."""
        unknown = sorted(set(episode_ids) - set(self.entries) - set(self.left_out))
        if unknown:
            held = sorted([*self.entries, *self.left_out])
            raise KeyError(f"no episode {unknown} in {self.root} (it holds {held})")
        before = dict(self.entries), dict(self.left_out)
        removed = [self.entries.pop(i, None) or self.left_out.pop(i) for i in dict.fromkeys(episode_ids)]

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
        it before the first recording creates it); None if that cannot be read."""
        folder = self.root.absolute()
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            return None

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
            log.info(
                "reference library %s: evicted episode %d (task %r: the least recently used of its %d)",
                self.root,
                victim.id,
                task,
                len(by_task[task]),
            )
        return evicted


# ── command line ─────────────────────────────────────────────────────────────────────────────────────────


def _this_process() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def _remove_stale_marker(marker: Path) -> None:
    """Take away a marker whose process is gone. It is first moved to a name of this process's own (one
    process wins the move), and put back if it turns out to be another's fresh marker after all."""
    taken = _marker_draft(marker.parent, f"stale-{os.getpid()}")
    try:
        os.rename(marker, taken)
    except OSError:  # gone already: another opener took it over first
        return
    try:
        host, pid = taken.read_text().split()
        alive = holder_of(host, pid)
    except (OSError, ValueError):  # garbled: nobody's
        alive = False
    if alive:
        with contextlib.suppress(OSError):  # a live process's marker: back, unless a new one is there
            os.link(taken, marker)
    taken.unlink(missing_ok=True)


def holder(root: Path) -> str | None:
    """The process that has the library at `root` open ("<host> <pid>"), if it is alive; None if none
    does, or the marker is stale (its process on this host is gone). A process on another host cannot be
    checked and counts as alive."""
    try:
        host, pid = (Path(root) / OPEN_MARKER).read_text().split()
    except (OSError, ValueError):  # no marker (or no folder, or a path through a file), or a garbled one
        return None
    return f"{host} {pid}" if holder_of(host, pid) else None


def holder_of(host: str, pid: str) -> bool:
    """Whether the process `pid` on `host` may be alive: one on this host is checked, one on another host
    cannot be and counts as alive."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _stored(root: Path) -> tuple[LibraryKey, list[dict]]:
    index_path = Path(root) / INDEX
    if not index_path.exists():
        raise LibraryError(f"{root}: no library here (no {INDEX})")
    try:
        index = json.loads(index_path.read_text())
        key = LibraryKey(index["key"]["weights"], index["key"]["shapes"])
        return key, [asdict(e) for e in _entries(index_path, index["episodes"])]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise LibraryError(f"{index_path}: unreadable library index ({e})") from None


def _when(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _descriptors(root: Path, episodes: list[dict]) -> tuple[dict[int, np.ndarray], list[str]]:
    """Each readable episode's descriptors as unit rows (as retrieval holds them), and what could not be
    read. Only the descriptors are read from each file, not its images."""
    # The runtime's own normalisation; imported here, as retrieval imports torch, which the other commands
    # do not need.
    from rmuscle_ros.cache.retrieval import unit_rows

    rows: dict[int, np.ndarray] = {}
    problems = []
    for e in episodes:
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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rmuscle_ros.cache.library",
        description="Inspect a reference library, check its files, or take episodes out of it.",
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
        key, episodes = _stored(args.root)
        if args.command == "list":
            print(f"library {args.root}: {len(episodes)} episode(s), weights {key.weights[:16]}, "
                  f"shapes {dict(key.shapes)}")  # fmt: skip
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
                print(f"  {name}: not named by the index (kept; never used)")
            for path in _leftovers(args.root):
                print(f"  {path.name}: a write that never finished (the next open deletes it)")
            for problem in problems:
                print(f"  {problem}")
            print(f"{len(episodes) - len(problems)} of {len(episodes)} episode(s) intact")
            return 1 if problems else 0
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
    except (LibraryError, KeyError, OSError) as e:  # OSError: a disk error, a full disk
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
