"""One writer per reference library: the lock a `ReferenceLibrary` takes at open and gives up at close.

Why it exists: a library's index lives in its opener's memory and is rewritten whole at each add or
remove. Two openers given the same folder (two nodes, or a node and `python -m rmuscle_ros.cache.library
remove`) would each write their own index and drop the other's episodes. So an opener takes the library's
lock first, before it reads the index, and a second one is refused (`LibraryBusy`).

The surface: `LibraryLock.take(root)` holds the lock, or is read-only with the reason (`read_only`), or
raises; `LibraryLock.release()` gives it up; `holder(root)` names the process that holds a library, for
the command line. library.py re-exports the exceptions and file names defined here: import them from there.

Design:
- **A kernel lock (`flock`) on `.lock` (`LOCK_FILE`).** The kernel gives it up when its process ends,
  however it ends, so nothing stale can block a library after a crash, a reboot or a new container (a
  marker file naming a pid cannot promise that). The lock file is never deleted; it holds "<host> <pid>"
  of its holder, for others' messages only.
- **The earlier versions' open marker (`.open`, `OPEN_MARKER`) is still written and honoured.** Earlier
  versions guarded a library with that marker alone. While a library is open this version writes it too,
  so that an earlier version's node started beside it refuses the library; and it refuses a library whose
  marker a live earlier version's node holds (one of this host whose process exists, written since the
  host booted: `_examine_marker`). Any other marker is removed, saying whose it was. A draft of the
  marker (`.open.tmp-<pid>`) is an earlier version's node taking it while its process lives
  (`marker_draft_alive`), never a leftover to delete.
- **One opener per process.** This process's locks are kept in a registry (`_LOCKS`) by their lock file's
  (device, inode), so that a second opener in the same process is refused as another process is, even at
  another path to the same folder (a library renamed while open). flock alone would not refuse it: the
  lock belongs to an open file, and each open of the lock file is another.
- **Fork.** A fork child (multiprocessing's fork start method) inherits the lock's descriptor and the
  registry, but the lock is its parent's: the child starts with an empty registry
  (`_forget_inherited_locks`), is refused the library its parent holds, and a `LibraryLock` it inherited
  gives nothing up (`release` is the parent's to do).
- **Read-only.** An existing folder where the lock file cannot be created for want of permission (a
  read-only mount) opens read-only: its episodes are served, and `add` / `remove` are refused. Any other
  failure (a folder that does not exist and cannot be created, a full disk, a filesystem without locks)
  fails the open, since without the lock a second writer could drop this one's recordings.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# The library's logger: these lines are the library's ("reference library <root>: …"), and are filtered
# by that name.
log = logging.getLogger("rmuscle_ros.cache.library")

LOCK_FILE = ".lock"  # flock()ed while the library is open; holds "<host> <pid>" of its holder, for messages
OPEN_MARKER = ".open"  # "<host> <pid>": earlier versions' guard (no lock), still written for them


# The library's errors are defined here, below library.py, which raises them too and re-exports them.
class LibraryError(RuntimeError):
    """A library that cannot be used (corrupt index, unknown version)."""


class LibraryBusy(LibraryError):
    """The library is open in another live process (a running node), which owns its index."""


@dataclass
class LibraryLock:
    """This process's hold on one library's lock file (`take`): `fd` holds the flock. One per library and
    process: a second opener in this process is refused, as another process is (nothing in the package
    opens a library twice; two objects would each write their own index). A library opened read-only
    holds no lock: `read_only` says why."""

    root: Path  # the path it was opened at (messages, the open marker)
    read_only: str = ""  # why add/remove are refused ("" if they are not): the lock file could not be created
    fd: int = -1  # the lock file, flock()ed (-1: none held)
    identity: tuple[int, int] | None = None  # the lock file's (device, inode): the registry's key
    # The process that took it: a fork child holds a copy of this object, not the lock.
    pid: int = field(default_factory=os.getpid)
    marker: str = ""  # the earlier versions' open marker this process wrote ("" if none), removed at release

    @classmethod
    def take(cls, root: Path) -> LibraryLock:
        """Take the library's lock (`LOCK_FILE`), or LibraryBusy if another process holds it, or another
        ReferenceLibrary of this process. The kernel gives it up when its holder ends, so nothing stale is
        left to block the library. A folder that exists but where the lock file cannot be created for want
        of permission (a read-only mount) opens read-only (`read_only`); any other failure (a folder that
        does not exist and cannot be created, a full disk, a path through a file) fails the open, since
        without the lock a second writer could drop this one's recordings."""
        root = Path(root)
        path = root / LOCK_FILE
        try:
            if root.is_symlink() and not root.exists():
                raise LibraryError(
                    f"{root}: a symbolic link to {os.readlink(root)}, which does not exist (a drive that is "
                    "not mounted?); library_path must name a folder, or a path where one can be created"
                )
            if root.exists() and not root.is_dir():
                raise LibraryError(
                    f"{root}: a file, not a folder; library_path must name a folder, or a path where one "
                    "can be created"
                )
            if not root.is_dir():
                root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # before (found in review) this opened an empty library read-only: a typo
            raise LibraryError(
                f"{root}: the library's folder does not exist and cannot be created ({e}); library_path must "
                "name a folder, or a path where one can be created"
            ) from None
        with _LOCKS_GUARD:
            try:
                # Not through a symbolic link: its name is written into the file (found in review: a .lock
                # linked to another file emptied that file).
                fd = _open_lock_file(path, root)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise LibraryError(
                        f"{path}: the library's lock file is a symbolic link; remove it (the library makes its "
                        "own)"
                    ) from None
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise LibraryError(f"{path}: cannot open the library's lock file ({e})") from None
                why = f"its lock file {path} cannot be opened for writing: {e.strerror}"
                log.warning("reference library %s: opened read-only (%s): its episodes are served, none is "
                            "recorded or removed", root, why)  # fmt: skip
                return cls(root, read_only=why)
            try:
                stat = os.fstat(fd)
                identity = (stat.st_dev, stat.st_ino)
                mine = _LOCKS.get(identity)
                if mine is not None and mine.pid == os.getpid():
                    raise LibraryBusy(
                        f"{root}: the library is already open in this process (opened at {mine.root}, not "
                        "closed yet): two openers would each rewrite the index from their own memory and drop "
                        "the other's episodes; close the other first"
                    )
                held = _lock_fd(root, fd, path, identity)
            except BaseException:
                os.close(fd)  # a lock `_lock_fd` took is given back before it raises
                raise
            _LOCKS[identity] = held
        return held

    def release(self) -> None:
        """Give up this process's lock on a library (`ReferenceLibrary.close`, or the library collected
        unclosed): the open marker first, if it is still this process's, then the lock file's name, then
        the lock. Nothing for a read-only library (it holds no lock), nor in a fork child: the lock is its
        parent's (`_forget_inherited_locks`)."""
        if self.fd < 0 or self.pid != os.getpid():
            return
        with _LOCKS_GUARD:
            if _LOCKS.get(self.identity) is self:  # type: ignore[arg-type]
                del _LOCKS[self.identity]  # type: ignore[arg-type]
            if self.marker:
                marker = self.root / OPEN_MARKER
                with contextlib.suppress(OSError):  # gone, or the folder renamed: the next opener removes it
                    if marker.read_text() == self.marker:
                        marker.unlink()
            try:
                with contextlib.suppress(OSError):  # the name only: the lock file itself stays
                    os.ftruncate(self.fd, 0)
                with contextlib.suppress(OSError):  # for every copy of the descriptor (a fork that kept one)
                    fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:  # an interrupt above (Ctrl-C) kept the lock for the process's life before (review)
                os.close(self.fd)
                self.fd = -1


def remove_if_abandoned(root: Path, min_age_s: float) -> bool:
    """Remove a library folder nobody holds: its lock file exists, was last written over `min_age_s` ago,
    and no process holds its lock (the kernel gave it up when its holder ended, however it ended). Its lock
    is held while the folder goes, so no opener can take it meanwhile; a folder just being opened (its lock
    file fresh, not locked yet) is left alone by the age. Returns whether it was removed. For temporary
    libraries only: `RMuscle` removes only folders it marked as its temporary ones (no library_path)."""
    path = root / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # no lock file (not a library, or an earlier version's), or not ours to open
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < min_age_s:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live process's library (this one's included: another open file)
            return False
        shutil.rmtree(root, ignore_errors=True)
        return not root.exists()
    finally:
        os.close(fd)


def holder(root: Path) -> str | None:
    """The process that has the library at `root` open ("<host> <pid>", as it wrote into the lock file),
    None if none does: answered by trying its lock without waiting, and giving it back at once. With the
    lock free, a live earlier version's node that holds the library's open marker (`_examine_marker`; those
    wrote no lock file) is named, saying so. No lock file and no such marker (no folder, or never opened)
    is no holder."""
    root = Path(root)
    if _held_here(root) is not None:
        return _this_process()
    previous = ""
    try:
        fd = os.open(root / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            # Shared: it conflicts with a holder's exclusive lock, and another `holder` runs beside it.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_named(fd)
        except OSError:  # a filesystem without locks: nobody can hold it there
            pass
        else:
            previous = _named_in(fd)
        finally:
            os.close(fd)  # gives the lock back
    found = _examine_marker(root, previous)
    if found is not None and not found.stale:
        return f"{found.named}, a node of an earlier version (its open marker {root / OPEN_MARKER})"
    return None


# ── the lock file ────────────────────────────────────────────────────────────────────────────────────────


def _open_lock_file(path: Path, root: Path) -> int:
    """The lock file, opened for writing (created if need be) or, where it is another user's (a `sudo`
    run of the command line made it) in a folder this process may write, for reading: flock takes either,
    and the episodes and the index are written to the folder, not to it (found in review: such a library
    opened read-only and recorded nothing, its folder writable). Not through a symbolic link."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM) or not path.exists() or not os.access(root, os.W_OK):
            raise
        return os.open(path, os.O_RDONLY | flags)


def _lock_fd(root: Path, fd: int, path: Path, identity: tuple[int, int]) -> LibraryLock:
    """flock the lock file open at `fd`, make way for this process in the open marker of earlier
    versions (`_clear_marker`), write this process's name into the lock file (for others' messages),
    then the marker (`_mark_open`). A few tries: `holder` (the command line) holds it for an instant
    to see whether it is free."""
    for attempt in range(5):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt == 4:
                raise LibraryBusy(
                    f"{root}: the library is open in process {_holder_named(fd)} (another node?): "
                    "two writers would drop each other's episodes from its index; give each node its own "
                    "library_path, or stop that process (its lock is given up when it ends)"
                ) from None
            time.sleep(0.02)
        except OSError as e:  # ENOLCK: a network filesystem without locks
            raise _no_lock(path, e) from None
    me = _this_process()
    try:
        # Whom the lock file named before this open: a marker naming the same is that holder's, left.
        previous = _named_in(fd)
        clear = _clear_marker(root, previous)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
        except OSError as e:  # the lock is held: only others' messages lack this process's name
            log.warning("reference library %s: cannot write this process's name into %s (%s)",
                        root, path, e)  # fmt: skip
        marker = _mark_open(root, me, previous) if clear else ""
    except BaseException:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        raise
    return LibraryLock(root, fd=fd, identity=identity, pid=os.getpid(), marker=marker)


def _this_process() -> str:
    return f"{socket.gethostname()} {os.getpid()}"


def _named_in(fd: int) -> str:
    """Whom the lock file open at `fd` names ("<host> <pid>"; "" if nobody)."""
    try:
        return os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        return ""


def _holder_named(fd: int) -> str:
    """Who the lock file open at `fd` names ("<host> <pid>"), for messages only."""
    return (
        _named_in(fd) or "(its lock file does not name it: it has just taken the lock, or its disk is full)"
    )


def _no_lock(path: Path, e: OSError) -> LibraryError:
    """The open's error for a lock file that cannot be locked at all."""
    if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
        return LibraryError(
            f"{path}: cannot lock the library ({e}): its filesystem keeps no locks (NFS without lockd?), "
            "and without one a second writer would drop this one's recordings. Mount it with locking "
            "(lockd running, or local_lock=flock on a mount only this host uses), or point library_path "
            "at a local folder"
        )
    return LibraryError(f"{path}: cannot lock the library ({e})")


# ── this process's locks ─────────────────────────────────────────────────────────────────────────────────

# This process's locks, by their lock file's (device, inode): a library renamed while open is still found.
_LOCKS: dict[tuple[int, int], LibraryLock] = {}
# Reentrant: a ReferenceLibrary collected unclosed while this thread holds it gives its lock up (`release`).
_LOCKS_GUARD = threading.RLock()


def _forget_inherited_locks() -> None:
    """In a fork child (multiprocessing's fork start method): its parent's locks are its parent's. The
    child's copies of their descriptors are closed (which does not give the lock up: it belongs to the open
    file, which the parent's descriptor keeps), and the registry starts empty, so that the child is refused
    a library its parent holds and holds nothing once the parent closes it."""
    global _LOCKS_GUARD
    _LOCKS_GUARD = threading.RLock()  # another thread may have held it at the fork: never released here
    for held in _LOCKS.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _LOCKS.clear()


os.register_at_fork(after_in_child=_forget_inherited_locks)


def _held_here(root: Path) -> LibraryLock | None:
    """This process's lock on the library at `root`, if it holds one (found by its lock file)."""
    try:
        stat = (Path(root) / LOCK_FILE).stat()
    except OSError:
        return None
    held = _LOCKS.get((stat.st_dev, stat.st_ino))
    return held if held is not None and held.pid == os.getpid() else None


# ── the earlier versions' open marker ────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class _Marker:
    """An open marker found in a library folder (`OPEN_MARKER`, `_examine_marker`)."""

    named: str  # "<host> <pid>", as written
    stale: str  # why it is no live earlier version's node's; "" if it is one (it holds the library)
    ours: bool = False  # this version's, left by a holder that is gone: removed without a warning


def _examine_marker(root: Path, previous: str) -> _Marker | None:
    """The open marker at `root`, if there is one. `previous`: whom the lock file named before this opener
    took the lock (or while nobody holds it). A marker naming the same, or this process, is this version's,
    left behind (its holder is gone: the lock was free). Any other is an earlier version's (those wrote no
    lock file), and counts as live as earlier versions count it, but not across a reboot: it names this
    host and a pid that exists, and was written since this host booted. One naming another host counts as
    stale here (earlier versions took it for alive: a container since recreated blocked its library)."""
    marker = root / OPEN_MARKER
    try:
        named = marker.read_text(errors="replace").strip()
        written = marker.stat().st_mtime
    except FileNotFoundError:
        return None
    except OSError as e:  # a folder of that name, a marker this user cannot read: garbled, as it was
        return _Marker(f"(unreadable: {e.strerror})", "it cannot be read")
    if named and named in (previous, _this_process()):
        return _Marker(named, "left by a process of this version that no longer holds the library", ours=True)
    fields = named.split()
    if len(fields) != 2 or not fields[1].isdigit():
        return _Marker(named, "it is garbled (earlier versions take such a marker for stale too)")
    host, pid = fields[0], int(fields[1])
    if host != socket.gethostname():
        return _Marker(named, f"it names another host ({host}; a container since recreated?)")
    if not pid_exists(pid):
        return _Marker(named, f"its process {pid} is gone")
    if written < boot_time():
        return _Marker(
            named, f"it was written before this host last booted (pid {pid} is another process now)"
        )
    return _Marker(named, "")


def _clear_marker(root: Path, previous: str) -> bool:
    """Make way for this process's open marker (`_mark_open`): LibraryBusy if an earlier version's
    node that is alive holds the library (`_examine_marker`); any other marker is removed, with a
    warning saying whose it was unless it was this version's. `previous`: whom the lock file named
    before this open. False if a marker stays that could not be removed."""
    found = _examine_marker(root, previous)
    if found is None:
        return True
    marker = root / OPEN_MARKER
    if not found.stale:
        raise LibraryBusy(
            f"{root}: the library is open in process {found.named}, a node of an earlier version of "
            f"rmuscle_ros (its open marker {marker}): two writers would drop each other's episodes from "
            f"its index; stop that node, or, if that process is gone, delete {marker}"
        )
    try:
        marker.unlink()
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("reference library %s: cannot remove %s, the open marker of %s (%s; %s): an earlier "
                    "version's node would not see that this process has the library open", root,
                    marker, found.named, found.stale, e)  # fmt: skip
        return False
    if found.ours:
        log.info("reference library %s: removed %s, the open marker of %s (%s)", root, marker,
                 found.named, found.stale)  # fmt: skip
    else:
        log.warning("reference library %s: removed %s, the open marker of %s, an earlier version's node "
                    "that no longer has it open: %s", root, marker, found.named, found.stale)  # fmt: skip
    return True


def _mark_open(root: Path, me: str, previous: str) -> str:
    """Write the open marker earlier versions read and write (`OPEN_MARKER`: exactly "<host> <pid>"), so
    that one started beside this process refuses the library instead of writing into it. Written to a
    draft of this process's own (named as earlier versions named theirs, which they keep while its pid
    lives), then linked to the marker's name, which fails if an earlier version's node took it
    meanwhile: that one is examined as at open. The lock guards this version; a marker that cannot be
    written is logged, not fatal. Returns what was written ("" if nothing)."""
    # At call time: library.py imports this module, and writes its own files with the same primitive.
    from rmuscle_ros.cache.library import TMP_INFIX, _place_new

    marker, draft = root / OPEN_MARKER, root / f"{OPEN_MARKER}{TMP_INFIX}{os.getpid()}"
    try:
        with open(draft, "w") as out:
            out.write(me)
            out.flush()
            os.fsync(out.fileno())
        for _ in range(3):
            try:
                _place_new(draft, marker)
                return me
            except FileExistsError:
                if not _clear_marker(root, previous):  # LibraryBusy for a live earlier version's
                    return ""
        raise LibraryBusy(f"{root}: its open marker {marker} kept changing (nodes of an earlier "
                          "version opening it?); try again")  # fmt: skip
    except OSError as e:
        log.warning("reference library %s: cannot write %s (%s): an earlier version's node would not see "
                    "that this process has the library open", root, marker, e)  # fmt: skip
        return ""
    finally:
        with contextlib.suppress(OSError):
            draft.unlink()


def marker_draft_alive(draft: Path) -> bool:
    """Whether the process that names a marker draft (its pid, last, after a '-': earlier versions also
    wrote `.open.tmp-stale-<pid>`) may still be writing it: it exists and wrote it since this host booted.
    A draft whose process is gone is a leftover (library.py's `_leftovers`)."""
    pid = draft.name.rsplit("-", 1)[-1]
    try:
        written = draft.stat().st_mtime
    except OSError:
        return False
    return pid.isdigit() and pid_exists(int(pid)) and written >= boot_time()


def pid_exists(pid: int) -> bool:
    """Whether process `pid` of this host exists (another user's counts)."""
    if pid <= 0:  # os.kill(0, ...) would ask about this process's group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    except (OverflowError, OSError):  # no such pid can exist
        return False
    return True


def boot_time() -> float:
    """When this host last booted (seconds since the epoch, /proc/stat's btime): a pid written before it is
    another process's now. 0 if it cannot be read (every file then counts as written since)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0.0
