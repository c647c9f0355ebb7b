"""Exit codes of every command, and the error that means "bad input".

| code | meaning |
| --- | --- |
| 0 | success (``verify``: the checkpoints are identical; ``verify-refit``: within tolerance) |
| 1 | differences found (``verify``, ``verify-refit`` only) |
| 2 | bad input: a path, file, option, model or layout that cannot work; the message names the fix |
| 3 | internal error: anything else (a bug, a dead peer rank, a full disk); the traceback is logged |

Under ``torchrun`` each rank exits with its own code (bad input is detected on every rank alike,
before any collective); torchrun itself then exits 1 and lists each rank's code. ``convert
--nproc-per-node N`` launches the ranks itself and exits with one code: the most severe any rank
exited with (``launcher.launch_exit_code``).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    DIFFERENCES = 1
    BAD_INPUT = 2
    INTERNAL_ERROR = 3


class BadInput(Exception):
    """User input that cannot work; the message names the problem and the fix."""
