"""One writer at a time per output directory: the lock file ``.<name>.lock`` beside it.

Owns the lock a checkpoint writer holds from before it stages anything until its staging
directory is swapped in or abandoned (``checkpoints.publish``). The lock is ``flock(LOCK_EX)`` on
``.<name>.lock`` in the output's parent directory (so it is on the same filesystem; on NFS
Linux emulates flock with byte-range locks the server sees from every host). The file records
its holder (pid, host, since when) so a second writer can name it.

Why flock and not only an ``O_EXCL`` file: the kernel (or the NFS server) drops the lock when
its holder dies, so a killed writer never blocks the next one. A file left by a killed holder is
stale by construction: the next writer locks it, logs that it takes over from the dead holder,
and writes its own record. Releasing unlinks the file while still holding the lock; a writer
that locked the file just before it was unlinked finds the path gone or holding another file,
and tries again, so two writers never both hold "the" lock.

Where flock is unsupported (``ENOLCK``, ``EOPNOTSUPP``: some FUSE or NFS mounts without a lock
service) the write goes ahead unlocked with a warning that says so.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from mbridge_refit.checkpoints.regular_files import open_if_regular
from mbridge_refit.errors import InputError

__all__ = [
    "LOCK_SUFFIX",
    "LockFileError",
    "LockHeld",
    "LockHolder",
    "OutputLock",
    "UNKNOWN_HOLDER",
    "held_by",
    "lock_path",
]

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EBADF)
# A lock held this briefly is another writer's look (``held_by``) or the moment between a
# holder's lock and its record: worth another try before saying "busy".
_RETRY_SECONDS = 1.0
_RETRY_STEP = 0.02


def lock_path(target: Path) -> Path:
    """The lock file of output directory ``target``: ``.<name>.lock`` beside it."""
    return target.parent / f".{target.name}{LOCK_SUFFIX}"


@dataclass(frozen=True, kw_only=True, slots=True)
class LockHolder:
    """Who holds (or last held) an output's lock, as its lock file records it."""

    pid: int | None
    host: str | None
    since: str | None

    @classmethod
    def this_process(cls) -> LockHolder:
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(pid=os.getpid(), host=socket.gethostname(), since=now)

    @classmethod
    def parse(cls, data: bytes) -> LockHolder | None:
        try:
            record = json.loads(data.decode())
            return cls(pid=int(record["pid"]), host=str(record["host"]), since=str(record["since"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    def to_bytes(self) -> bytes:
        return json.dumps({"pid": self.pid, "host": self.host, "since": self.since}).encode() + b"\n"

    def describe(self) -> str:
        if self.pid is None:
            return "a writer whose record is not readable yet"
        return f"pid {self.pid} on host {self.host} since {self.since}"


UNKNOWN_HOLDER = LockHolder(pid=None, host=None, since=None)


class LockFileError(InputError):
    """What lies at an output's lock path is not a lock file (a link, a FIFO, a directory): never written
    through, never waited on."""


def _open_lock(path: Path, flags: int) -> int:
    """``path`` opened with ``flags``, never through a symlink (a planted link would have us truncate the
    file it names) and never blocking (a FIFO); raises ``LockFileError`` unless it is a regular file."""
    fd, kind = open_if_regular(path, flags, follow_links=False, mode=0o644)
    if fd is None:
        raise LockFileError(
            f"{path} is where this output's lock file goes, but it is a {kind}, not a regular file: "
            "remove it, or choose another output directory"
        )
    return fd


class LockHeld(InputError):
    """Another writer holds the lock of an output directory."""

    def __init__(self, path: Path, holder: LockHolder) -> None:
        super().__init__(f"{path} is held by {holder.describe()}")
        self.path = path
        self.holder = holder


class OutputLock:
    """The held lock of one output directory; ``release()`` gives it up (idempotent)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd  # None: the filesystem has no flock, nothing is held

    @classmethod
    def acquire(cls, target: Path) -> OutputLock:
        """Lock output directory ``target`` (its parent must exist); raises ``LockHeld``."""
        path = lock_path(target)
        deadline = time.monotonic() + _RETRY_SECONDS
        while True:
            fd = _open_lock(path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() < deadline:
                    os.close(fd)
                    time.sleep(_RETRY_STEP)
                    continue
                holder = _read_holder(fd)
                os.close(fd)
                raise LockHeld(path, holder) from None
            except OSError as err:
                os.close(fd)
                if err.errno not in _UNSUPPORTED:
                    raise
                logger.warning(
                    "cannot lock %s (%s): this filesystem has no flock, so another writer into %s is not excluded",
                    path,
                    os.strerror(err.errno),
                    target,
                )
                return cls(path, None)
            if not _is_at(fd, path):  # its holder unlinked it before we locked: lock the new file
                os.close(fd)
                continue
            _record(fd, path)
            return cls(path, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if _is_at(fd, self.path):
                self.path.unlink()
        finally:
            os.close(fd)  # unlinked first, so a writer waiting on this file finds it gone and retries


def held_by(target: Path) -> LockHolder | None:
    """Who holds ``target``'s lock now, or None: a look that creates and changes nothing.

    Takes a shared lock for an instant (an exclusive one would need write access on NFS);
    a writer that tries its exclusive lock in that instant tries again (``_RETRY_SECONDS``)."""
    try:
        fd = _open_lock(lock_path(target), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:  # shared locks never conflict with each other: a writer holds it
        return _read_holder(fd)
    except OSError as err:
        if err.errno in _UNSUPPORTED:
            return None
        raise
    finally:
        os.close(fd)  # also drops the shared lock if taken
    return None


def _read_holder(fd: int) -> LockHolder:
    """The record in the lock file, waiting a moment for a holder that has just locked it."""
    deadline = time.monotonic() + _RETRY_SECONDS / 2
    while True:
        holder = LockHolder.parse(os.pread(fd, 4096, 0))
        if holder is not None:
            return holder
        if time.monotonic() >= deadline:
            return UNKNOWN_HOLDER
        time.sleep(_RETRY_STEP)


def _record(fd: int, path: Path) -> None:
    """Log the dead holder this lock is taken from, if the file names one; write ours."""
    previous = LockHolder.parse(os.pread(fd, 4096, 0))
    if previous is not None:
        logger.warning(
            "taking over %s: its holder, %s, is gone (killed before it could release it)", path, previous.describe()
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, LockHolder.this_process().to_bytes(), 0)


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (at_path.st_dev, at_path.st_ino) == (mine.st_dev, mine.st_ino)
