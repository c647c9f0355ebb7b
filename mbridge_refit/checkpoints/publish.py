"""Publishing a checkpoint directory crash-safely: build beside, fsync, swap in atomically.

Owns the protocol both checkpoint writers follow (``sinks.safetensors`` for HF checkpoints,
``checkpoints.megatron`` for Megatron ones):

1. Build the whole checkpoint in ``staging_dir(out)`` (``.<name>.partial`` beside ``out``, so on
   the same filesystem) and fsync every file and the directory.
2. ``swap_in(staging, out)``: exchange the two directories in one atomic step
   (``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere two renames, with a window in which
   ``out`` is missing but ``.<name>.old`` is complete), then remove the old content and fsync the
   parent. Whenever the process dies, ``out`` holds the complete old or the complete new content.
3. ``carry_over(old, new, is_checkpoint_file)``: with overwrite, entries of the old directory that
   are not checkpoint files (notes, folders of the user's) are hard-linked (or copied) into the
   new one before the swap; the old directory is never changed before the swap.

A staging directory found when a write starts is the leftover of a killed run
(``leftover_error`` names it; overwrite removes it).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

STAGING_SUFFIX = ".partial"


def staging_dir(out_dir: Path) -> Path:
    """Where a checkpoint for ``out_dir`` is built before it is swapped in: ``.<name>.partial``
    beside it (same filesystem, so the swap is a rename)."""
    return out_dir.parent / f".{out_dir.name}{STAGING_SUFFIX}"


def leftover_error(out_dir: Path) -> str | None:
    """The message for a killed run's staging directory beside ``out_dir``, if there is one."""
    staging = staging_dir(out_dir)
    if not staging.exists():
        return None
    return (f"{staging} is left from an interrupted write into {out_dir}; pass overwrite=True "
            "(--overwrite) to remove it, or delete it")


def fresh_staging_dir(out_dir: Path) -> Path:
    """Create ``out_dir`` if missing (its parent must be writable) and an empty staging
    directory, removing a leftover one."""
    staging = staging_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def carry_over(old: Path, new: Path, is_checkpoint_file: Callable[[Path], bool]) -> None:
    """Hard-link (or copy) the entries of ``old`` that are not checkpoint files into ``new``;
    ``old`` is not changed."""
    for entry in sorted(old.iterdir()):
        if is_checkpoint_file(entry) or (new / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def swap_in(staging: Path, out_dir: Path) -> None:
    """Make ``staging`` the content of ``out_dir`` atomically, then remove the old content."""
    if exchange(staging, out_dir):
        shutil.rmtree(staging)  # now the old content
    else:
        old = out_dir.parent / f".{out_dir.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old)
    fsync_dir(out_dir.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``: True when done, False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} into {b}: {os.strerror(err)}")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, deepest first."""
    directories = [root]
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            directories.append(path)
        else:
            fsync_file(path)
    for directory in sorted(directories, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(directory)


def _link_or_copy(source: str | Path, target: str | Path) -> None:
    if Path(source).is_symlink():
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
