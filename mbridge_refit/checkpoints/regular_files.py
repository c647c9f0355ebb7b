"""Opening a file only when it is a regular file, without ever blocking: ``open_if_regular`` and
``open_regular_file``.

Whatever names a file we read (a checkpoint's index, a shard, a side file) or create (an output's
lock) may name a FIFO, a device, a socket or a directory instead: a FIFO with no writer blocks a
plain ``open`` for ever, ``/dev/zero`` never ends, and a link planted where we write makes us
truncate the file it names. So these open with ``O_NONBLOCK`` (and ``O_NOFOLLOW`` where links are
refused), then check the open descriptor with ``fstat``: a file swapped after an earlier check of
its name is caught on what is actually open. Each caller words the refusal for its own input
(``file_kind`` names what was found). Lowest layer of ``checkpoints``: imports nothing of ours
but the error root.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from mbridge_refit.errors import InputError

__all__ = ["NotARegularFile", "file_kind", "open_if_regular", "open_regular_file"]

_KINDS = (
    (stat.S_ISREG, "regular file"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)  # no link: fstat and stat see what a link leads to (a refused link is os.open's ELOOP, below)
# what os.open says when, with O_NOFOLLOW / O_NONBLOCK, the name is not a regular file it may open
_REFUSALS = {errno.ELOOP: "symbolic link", errno.EISDIR: "directory", errno.ENXIO: "FIFO"}


class NotARegularFile(InputError):
    """A path that had to name a regular file names something else (``kind``)."""

    def __init__(self, path: Path, kind: str) -> None:
        super().__init__(f"{path} is a {kind}, not a regular file (reading a FIFO or a device may never end)")
        self.path, self.kind = Path(path), kind


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words."""
    return next((kind for test, kind in _KINDS if test(mode)), "special file")


def open_if_regular(
    path: Path | str, flags: int = os.O_RDONLY, *, follow_links: bool = True, mode: int = 0o644
) -> tuple[int | None, str]:
    """``(descriptor, "regular file")`` when ``path`` opens as a regular file with ``flags`` (plus
    non-blocking, close-on-exec, and no following a final link unless ``follow_links``), else
    ``(None, what it is)``; other failures (no such file, no permission) raise ``OSError``. The
    caller owns the descriptor (blocking mode is left on: reads of a regular file never block)."""
    extra = os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as err:
        if err.errno in _REFUSALS:
            return None, _REFUSALS[err.errno]
        raise
    kind = file_kind(os.fstat(fd).st_mode)
    if kind != "regular file":
        os.close(fd)
        return None, kind
    return fd, kind


def open_regular_file(path: Path | str, *, follow_links: bool = True) -> BinaryIO:
    """``path`` opened for reading in binary, if it is a regular file; else ``NotARegularFile``."""
    fd, kind = open_if_regular(path, follow_links=follow_links)
    if fd is None:
        raise NotARegularFile(Path(path), kind)
    return os.fdopen(fd, "rb")
