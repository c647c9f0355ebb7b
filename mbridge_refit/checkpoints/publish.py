"""Publishing a checkpoint directory crash-safely: lock, build beside, fsync, swap in atomically.

Owns the protocol both checkpoint writers follow (``sinks.safetensors`` for HF checkpoints,
``checkpoints.megatron`` for Megatron ones), in a ``Publication``:

0. ``begin_publication(out, ...)``: the first rank locks the output (``checkpoints.output_lock``:
   one writer at a time; a second one is refused naming the holder), then checks the output
   under the lock and creates this writer's own staging directory,
   ``.<name>.partial-<pid>-<token>`` beside it (same filesystem, so the swap is a rename). The
   other ranks learn the outcome and the staging path from one broadcast.
1. Every rank builds its part of the checkpoint in the staging directory; everything is fsynced.
2. ``carry_over(old, new, is_checkpoint_file)``: with overwrite, entries of the old directory
   that are not checkpoint files (notes, folders of the user's) are hard-linked (or copied) into
   the new one before the swap; the old directory is never changed before the swap.
3. ``Publication.swap_in()``: exchange the two directories in one atomic step
   (``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere two renames, with a window in which
   ``out`` is missing but ``<staging>.old`` is complete), fsync the parent, remove the old
   content, release the lock. Whenever the process dies, ``out`` holds the complete old or the
   complete new content. Old content that cannot be removed leaves a warning naming it: the new
   checkpoint is in place, so the write succeeded. ``abandon()`` removes the staging directory
   and releases the lock instead. SIGINT and SIGTERM wait while the swap's renames run and the
   publication records them (``interrupts_deferred``), so an interrupted write knows whether it
   swapped: ``abandon()`` after the swap removes only what is left of the old content.

Overwrite means the new checkpoint only: every old file a loader could read is dropped (see
``is_loader_file``); other entries are kept. An ``out`` that is a symlink is written through:
the link stays, the directory it points to is the one replaced (``output_target``), and the lock
and staging directory are beside that directory. A target that is a mount point cannot be swapped, and one holding
another filesystem would have it emptied by the removal of the old content: both are refused
before anything is written (``placement_problem``). Whatever lies at the lock's or a staging
directory's name must be what this protocol puts there (a regular file, a directory). A staging directory found under the lock is
the leftover of a killed run (``leftover_error`` names it; overwrite removes it).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fnmatch
import logging
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbridge_refit.checkpoints.output_lock import LockFileError, LockHeld, LockHolder, OutputLock
from mbridge_refit.errors import InputError

__all__ = [
    "LOADER_FILE_PATTERNS",
    "OutputRefused",
    "Publication",
    "STAGING_SUFFIX",
    "TMP_PREFIX",
    "begin_publication",
    "busy_error",
    "carry_over",
    "exchange",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "give_new_file_mode",
    "interrupts_deferred",
    "is_loader_file",
    "leftover_error",
    "leftovers",
    "new_file_mode",
    "output_target",
    "placement_problem",
    "swap_in",
]

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".partial"
TMP_PREFIX = ".tmp-"  # a file still being written (a shard, a metadata file): never one to read

# Files of a checkpoint a loader (transformers, vLLM, llama.cpp, Megatron-LM, torch) may read:
# weights in any format and their temporary or partial forms, indexes, model/generation/tokenizer/
# processor configs, tokenizer vocabularies and chat templates, and our own temporary files.
# Matched against the lower-cased file name; an overwrite drops every old file that matches.
LOADER_FILE_PATTERNS = (
    "*.safetensors",
    "*.safetensors.*",
    "*.bin",
    "*.bin.*",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.h5.*",
    "*.msgpack",
    "*.msgpack.*",
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "*.distcp",
    "*.index.json",
    "*config.json",
    "tokenizer*",
    "*.tiktoken",
    "*.model",
    "vocab.*",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.*",
    "*.jinja",
    f"{TMP_PREFIX}*",
)


class OutputRefused(InputError, FileExistsError):
    """The output directory cannot be written as asked (another writer holds it, it is not empty
    and overwrite is off, a killed run's staging directory lies beside it, it is not a directory);
    the message names the path and the fix."""


def output_target(out: Path) -> Path:
    """The directory a write into ``out`` replaces: ``out`` with every link and ``.``/``..`` resolved (a
    symlink is written through; the lock and the staging directory are named after the target, so
    ``out`` must resolve to a named directory, never to ``.``)."""
    return Path(os.path.realpath(out))


def placement_problem(target: Path, *, overwrite: bool) -> str | None:
    """Why a checkpoint cannot be built beside ``target`` and swapped in (None: it can): an entry at a
    staging directory's name must be a directory (a killed write's leftover, removed with ``overwrite``),
    a mount point cannot be renamed, and with ``overwrite`` the old content is carried over and removed,
    which must not cross into another filesystem mounted inside it."""
    stray = next((path for path in leftovers(target) if path.is_symlink() or not path.is_dir()), None)
    if stray is not None:
        return (
            f"{stray} is named like this output's staging directory but is not a directory a killed write left: "
            "remove it, or choose another output"
        )
    if not target.is_dir():
        return None
    if os.path.ismount(target):
        return (
            f"{target} is a mount point: a checkpoint is built beside its output and swapped in by a rename, "
            f"which a mount point refuses; write into a directory inside it (e.g. {target / 'model'})"
        )
    if overwrite:
        device = target.stat().st_dev
        for folder, subfolders, _ in os.walk(target):
            for name in subfolders:
                path = Path(folder) / name
                if not path.is_symlink() and path.stat().st_dev != device:
                    return (
                        f"{path} inside the output {target} is another filesystem: replacing the output would "
                        "remove what is on it; unmount it or write the checkpoint elsewhere"
                    )
    return None


def is_loader_file(path: Path) -> bool:
    """Whether ``path`` (a file or symlink; directories are never) matches ``LOADER_FILE_PATTERNS``."""
    if path.is_dir() and not path.is_symlink():
        return False
    name = path.name.lower()
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in LOADER_FILE_PATTERNS)


def leftovers(out: Path) -> list[Path]:
    """The staging directories beside ``out`` (its target): a killed run's, or a running writer's."""
    target = output_target(out)
    prefix = f".{target.name}{STAGING_SUFFIX}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name == prefix or p.name.startswith(f"{prefix}-"))


def leftover_error(out: Path) -> str | None:
    """The message for staging directories of killed runs beside ``out``, if there are any."""
    found = leftovers(out)
    if not found:
        return None
    names = ", ".join(str(p) for p in found)
    return (
        f"{names} {'is' if len(found) == 1 else 'are'} left from an interrupted write into {out}; pass "
        "overwrite=True (--overwrite) to remove it, or delete it"
    )


def busy_error(out: Path, holder: LockHolder) -> str:
    """The message for an output another writer holds."""
    return (
        f"{out} is being written by another writer ({holder.describe()}): wait until it has finished, "
        "or write to another directory"
    )


@dataclass(kw_only=True)
class Publication:
    """One write of a checkpoint directory, on one rank (see the module docstring).

    Attributes:
        out: the output as given.
        target: the directory replaced (``out``, or where it points if it is a symlink).
        staging: this write's staging directory (the same on every rank).
        lock: the output's lock, on the first rank only (None elsewhere).
        created_target: whether this write created ``target`` (then abandoning removes it again).
        old_content: where the output's old content went when the swap was done (None before).
    """

    out: Path
    target: Path
    staging: Path
    lock: OutputLock | None = None
    created_target: bool = False
    old_content: Path | None = None

    @property
    def is_first_rank(self) -> bool:
        """Whether this rank holds the lock, and so swaps in, abandons and writes the side files."""
        return self.lock is not None

    @property
    def swapped(self) -> bool:
        """Whether the new content is the output's (this rank swapped it in)."""
        return self.old_content is not None

    def swap_in(self) -> None:
        """First rank: make the staging directory the content of the output, remove the old
        content, release the lock."""
        try:
            swap_in(self.staging, self.target, swapped=self._record_swap)
        finally:
            self._release()

    def abandon(self) -> None:
        """First rank: remove the staging directory (and the output directory if this write created
        it and it is still empty) and release the lock; the output is as it was before. After the
        swap (an interrupt in its last steps) the output keeps the new content and only what is
        left of the old one is removed."""
        try:
            if self.old_content is not None:
                shutil.rmtree(self.old_content, ignore_errors=True)
            elif self.is_first_rank:
                shutil.rmtree(self.staging, ignore_errors=True)
                if self.created_target:
                    with contextlib.suppress(OSError):  # not empty: someone else wrote there since
                        self.target.rmdir()
        finally:
            self._release()

    def _record_swap(self, old_content: Path) -> None:
        self.old_content = old_content

    def _release(self) -> None:
        if self.lock is not None:
            with interrupts_deferred():  # an interrupt halfway would leave the lock file behind
                self.lock.release()


_OK, _REFUSED, _FAILED = 0, 1, 2


def begin_publication(out: Path, *, overwrite: bool, group: Any = None, distributed: bool = False) -> Publication:
    """Start writing ``out``: the first rank (of ``group``, when ``distributed``) locks it, checks
    it and creates the staging directory; every rank learns the outcome from one broadcast and
    raises alike (``OutputRefused`` with the first rank's message there, a short note elsewhere).

    Refused (``OutputRefused``): another writer holds ``out``; ``out`` is not a directory;
    without ``overwrite``, ``out`` is not empty or a killed run's staging directory lies beside
    it. With ``overwrite``, such staging directories are removed. ``out`` is created if missing.
    """
    import torch.distributed as dist

    first = not distributed or dist.get_rank(group) == 0
    status, owner, error, publication = _OK, [0, 0], None, None
    if first:
        try:
            publication = _begin_here(out, overwrite=overwrite)
            pid, token = publication.staging.name.rsplit("-", 2)[-2:]
            owner = [int(pid), int(token, 16)]
        except OutputRefused as err:
            status, error = _REFUSED, err
        except Exception as err:
            status, error = _FAILED, err
    try:
        if distributed:
            status, *owner = _broadcast_from_first([status, *owner], group)
    except BaseException:  # an interrupt, a lost peer: this write ends before it began
        if publication is not None:
            publication.abandon()
        raise
    if error is not None:
        raise error
    if status == _REFUSED:
        raise OutputRefused(f"the first rank refused to write {out} (its message names the path and the fix)")
    if status == _FAILED:
        raise RuntimeError(f"the first rank failed to prepare {out} (its traceback names the error)")
    if publication is None:
        target = output_target(out)
        publication = Publication(out=out, target=target, staging=_staging_dir(target, *owner))
    return publication


def _begin_here(out: Path, *, overwrite: bool) -> Publication:
    target = output_target(out)
    if target.exists() and not target.is_dir():
        raise OutputRefused(f"output {out} exists and is not a directory; pass a directory path")
    problem = placement_problem(target, overwrite=overwrite)
    if problem is not None:
        raise OutputRefused(problem)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = OutputLock.acquire(target)
    except LockHeld as held:
        raise OutputRefused(busy_error(out, held.holder)) from None
    except LockFileError as err:
        raise OutputRefused(str(err)) from None
    publication: Publication | None = None
    try:
        found = leftovers(target)
        if found and not overwrite:
            raise OutputRefused(leftover_error(out))
        if not overwrite and target.is_dir() and any(target.iterdir()):
            raise OutputRefused(
                f"output directory {out} exists and is not empty; pass overwrite=True "
                "(--overwrite on the command line) to replace its checkpoint, or choose a new directory"
            )
        for path in found:
            logger.info("overwrite: removing %s, left by an interrupted write", path)
            shutil.rmtree(path)
        _log_link(out, target)
        staging = _staging_dir(target, os.getpid(), secrets.randbits(60))
        publication = Publication(
            out=out, target=target, staging=staging, lock=lock, created_target=not target.exists()
        )
        target.mkdir(exist_ok=True)
        staging.mkdir()
    except BaseException:  # an interrupt too: nothing of this write stays
        if publication is not None:
            publication.abandon()
        else:
            lock.release()
        raise
    return publication


def _log_link(out: Path, target: Path) -> None:
    """Say where a write into ``out`` goes when a link takes it elsewhere: ``out`` itself is a
    symlink, or a folder on its way is (a relative or ``..`` path that leads straight to ``target``
    is not a link, and says nothing)."""
    if out.is_symlink():
        logger.info("%s is a symlink: writing the directory it points to, %s", out, target)
    elif Path(os.path.abspath(out)) != target:
        logger.info("%s lies under a symlinked folder: writing %s", out, target)


def _staging_dir(target: Path, pid: int, token: int) -> Path:
    return target.parent / f".{target.name}{STAGING_SUFFIX}-{pid}-{token:015x}"


def _broadcast_from_first(values: list[int], group: Any) -> list[int]:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        tensor = tensor.cuda()
    dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return [int(v) for v in tensor.tolist()]


def carry_over(old: Path, new: Path, is_checkpoint_file: Callable[[Path], bool]) -> None:
    """Hard-link (or copy) the entries of ``old`` that are not checkpoint files into ``new``;
    ``old`` is not changed."""
    for entry in sorted(old.iterdir()):
        if (new / entry.name).exists():
            continue
        if is_checkpoint_file(entry):
            logger.info("overwrite: not keeping %s (a file of the old checkpoint, or one a loader would read)", entry)
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, new / entry.name)


def swap_in(staging: Path, out_dir: Path, *, swapped: Callable[[Path], None] | None = None) -> None:
    """Make ``staging`` the content of ``out_dir`` atomically, then remove the old content (a
    warning names it where it cannot be removed: the new content is in place). ``swapped`` is
    called with where the old content went, before an interrupt can come (``interrupts_deferred``)."""
    with interrupts_deferred():
        if exchange(staging, out_dir):
            old = staging  # now the old content
        else:
            old = staging.with_name(f"{staging.name}.old")
            os.replace(out_dir, old)
            os.replace(staging, out_dir)
        if swapped is not None:
            swapped(old)
    fsync_dir(out_dir.parent)
    try:
        shutil.rmtree(old)
    except OSError as err:
        logger.warning(
            "%s now holds the new checkpoint, but its old content could not be removed from %s (%s): delete it",
            out_dir,
            old,
            err,
        )


_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM wait; once it ends they take effect as they would have
    (their handlers run, or their default action). Python runs signal handlers in the main thread
    only, so elsewhere the block changes nothing (no handler can interrupt that thread either)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {
        signum: signal.signal(signum, lambda signum, frame: pending.append(signum))
        for signum in _DEFERRED_SIGNALS
        if signal.getsignal(signum) not in (None, signal.SIG_IGN)  # None: a handler not set from Python
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(pending):
            signal.raise_signal(signum)


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


def new_file_mode() -> int:
    """The mode ``open()`` gives a new file here: ``0o666`` less the process's umask. Read from
    ``/proc/self/status`` where Linux has it; elsewhere set and restored at once (a file another
    thread creates in between gets umask 0o022's mode)."""
    try:
        with open("/proc/self/status") as status:
            umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def give_new_file_mode(path: Path) -> None:
    """Give ``path`` the mode a file ``open()`` creates gets (``new_file_mode``): writers that make
    their file private (safetensors' ``save_file`` writes ``0o600``) would leave a checkpoint whose
    weights only their owner may read, beside a ``config.json`` everyone may."""
    os.chmod(path, new_file_mode())


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
