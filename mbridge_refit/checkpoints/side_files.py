"""The files a writer copies from a source checkpoint beside the weights (config, generation config,
tokenizer), checked so that a crafted checkpoint cannot make the copy carry a file from elsewhere.

A side file is the one thing a conversion copies without parsing it. A downloaded checkpoint whose
``tokenizer.json`` is a link to ``~/.ssh/id_ed25519``, or whose ``tokenizer.model`` is a link to
``/proc/self/environ`` (the converter's environment, tokens included), would put that file into the
output the user then publishes. So a side file must be a regular file that lies inside the checkpoint
directory once links are resolved, or a blob of the Hugging Face cache the directory is a snapshot of
(``<repo>/snapshots/<revision>/<name> -> ../../blobs/<hash>``: how ``huggingface_hub`` lays out every
download). A FIFO or a device is refused too: reading one blocks, or never ends.

``side_file_problems`` lists what is wrong with a directory's side files (the command line checks its
input on every rank before any collective); ``copy_side_file`` and ``read_side_file`` check again and
then open the file they checked without following a link swapped in since.

The rule on where a file may lead, ``outside_problem``, is the one every file read from a checkpoint
by name follows: the shards of an HF checkpoint too (``checkpoints.hf``), whose tensors a conversion
writes into its output as they are.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from mbridge_refit.checkpoints.regular_files import open_if_regular
from mbridge_refit.errors import InputError

__all__ = [
    "SideFileError",
    "copy_side_file",
    "outside_problem",
    "read_side_file",
    "side_file_problem",
    "side_file_problems",
]

HUB_SNAPSHOTS = "snapshots"
HUB_BLOBS = "blobs"


class SideFileError(InputError):
    """A side file of a source checkpoint is not a regular file inside it (module docstring)."""


def outside_problem(directory: Path, name: str, *, why: str) -> str | None:
    """Why ``directory / name`` does not lie in the checkpoint ``directory`` once links are resolved, nor
    is a blob of the Hugging Face cache the directory is a snapshot of (None: it does, or it is absent).
    ``why`` says why that file must lie in the checkpoint (it ends the message, before the fix)."""
    path = Path(directory) / name
    if not os.path.lexists(path):
        return None
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as err:  # a dangling link, a loop
        return f"{path} is a link that leads to no file ({type(err).__name__}: {err}); remove it or copy the file in its place"
    home = Path(directory).resolve()
    if not (target.is_relative_to(home) or _hub_blob(home, target)):
        return (
            f"{path} leads to {target}, outside the checkpoint directory {home}: {why}; copy the file into the "
            "checkpoint directory if it is the one you mean"
        )
    return None


def side_file_problem(directory: Path, name: str) -> str | None:
    """Why ``directory / name`` may not be copied into an output (None: it may, or it is absent)."""
    path = Path(directory) / name
    problem = outside_problem(
        directory, name, why="a side file is copied into the output as it is, so it must lie in the checkpoint"
    )
    if problem is not None or not os.path.lexists(path):
        return problem
    try:
        mode = os.stat(path.resolve(strict=True)).st_mode
    except (OSError, RuntimeError) as err:
        return f"cannot read {path}: {type(err).__name__}: {err}"
    if not stat.S_ISREG(mode):
        return f"{path} is not a regular file (a FIFO, device or directory); a side file must be a plain file"
    return None


def side_file_problems(directory: Path, names: Iterable[str]) -> list[str]:
    """``side_file_problem`` of each of ``names`` that has one."""
    return [problem for name in names if (problem := side_file_problem(directory, name)) is not None]


def copy_side_file(directory: Path, name: str, destination: Path) -> bool:
    """Copy ``directory / name`` to ``destination`` once it passes ``side_file_problem``; False when it is
    absent. Raises ``SideFileError`` for a file that may not be copied."""
    fd = _open_checked(directory, name)
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as source, open(destination, "wb") as target:
        shutil.copyfileobj(source, target)
    return True


def read_side_file(directory: Path, name: str) -> bytes | None:
    """The bytes of ``directory / name`` once it passes ``side_file_problem``; None when it is absent."""
    fd = _open_checked(directory, name)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as source:
        return source.read()


def _open_checked(directory: Path, name: str) -> int | None:
    problem = side_file_problem(directory, name)
    if problem is not None:
        raise SideFileError(problem)
    path = Path(directory) / name
    if not os.path.lexists(path):
        return None
    fd, kind = open_if_regular(path.resolve(strict=True), follow_links=False)
    if fd is None:  # replaced between the check and the open
        raise SideFileError(f"{path} changed into a {kind} while it was being copied; a side file must be a plain file")
    return fd


def _hub_blob(home: Path, target: Path) -> bool:
    """Whether ``target`` is a blob of the Hugging Face cache repository ``home`` is a snapshot of."""
    return home.parent.name == HUB_SNAPSHOTS and target.parent == home.parent.parent / HUB_BLOBS
