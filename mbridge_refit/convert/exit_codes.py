"""Exit codes of every command, and the error that means "bad input".

| code | meaning |
| --- | --- |
| 0 | success (``verify``: the checkpoints are identical; ``verify-refit``: within tolerance) |
| 1 | differences found (``verify``, ``verify-refit`` only) |
| 2 | bad input: a path, file, option, model or layout that cannot work; the message names the fix |
| 3 | internal error: a bug (its traceback is logged), a dead peer rank, a launch stopped by a signal |
| 4 | environment: the machine refused (disk full, quota, file-size limit, permissions, read-only |
|   | filesystem, open-file limit, out of memory); one line names the path, the errno and the fix |

Under ``torchrun`` each rank exits with its own code (bad input is detected on every rank alike,
before any collective); torchrun itself then exits 1 and lists each rank's code. ``convert
--nproc-per-node N`` launches the ranks itself and exits with one code: the most severe any rank
exited with (``launcher.launch_exit_code``; 4 counts as the most severe: a rank whose disk filled
up makes its peers fail too, and the cause is what to report).

Environment failures have their own code so that a script can tell "free space and run again" (4)
from "report a bug" (3); ``app.classify`` decides which a failure is, from the exception and
everything it wraps (its cause, its context, torch.distributed.checkpoint's per-rank failures).
"""

from __future__ import annotations

import enum

from mbridge_refit.errors import InputError

__all__ = ["BadInput", "ExitCode"]


class ExitCode(enum.IntEnum):
    OK = 0
    DIFFERENCES = 1
    BAD_INPUT = 2
    INTERNAL_ERROR = 3
    ENVIRONMENT = 4


class BadInput(InputError):
    """User input that cannot work; the message names the problem and the fix."""
