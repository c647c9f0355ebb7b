"""Exit codes of every command, the one table that documents them, and the error that means "bad input".

``EXIT_CODES`` is the table: ``--help`` prints it (``help_table``), README.md holds it as
``readme_table`` renders it, and ``tests/test_exit_codes.py`` runs the command line once per row.

Under ``torchrun`` each rank exits with its own code (bad input is detected on every rank alike,
before any collective); torchrun itself then exits 1 and lists each rank's code. ``convert
--nproc-per-node N`` launches the ranks itself and exits with one code (``launcher.launch_exit_code``):
the most severe failure any rank exited with (4 counts as the most severe: a rank whose disk filled
up makes its peers fail too, and the cause is what to report); a launch whose ranks only report an
interruption ends with the interruption's code, as does a launcher that gets the signal itself.

Environment failures have their own code so that a script can tell "free space and run again" (4)
from "report a bug" (3); ``app.classify`` decides which a failure is, from the exception and
everything it wraps (its cause, its context, torch.distributed.checkpoint's per-rank failures).
An interruption (``interrupts``) ends with 128 + the signal's number, the code a shell shows for a
process the signal ended, so that a script's ``$?`` reads the same whether the command cleaned up or not.
"""

from __future__ import annotations

import enum
import signal
import textwrap
from dataclasses import dataclass

from mbridge_refit.errors import InputError

__all__ = ["BadInput", "EXIT_CODES", "ExitCode", "ExitCodeRow", "help_table", "readme_table", "signal_exit_code"]


class ExitCode(enum.IntEnum):
    OK = 0
    DIFFERENCES = 1
    BAD_INPUT = 2
    INTERNAL_ERROR = 3
    ENVIRONMENT = 4
    INTERRUPTED = 128 + signal.SIGINT  # 130: Ctrl-C
    TERMINATED = 128 + signal.SIGTERM  # 143: kill, a scheduler, the launcher stopping its ranks


def signal_exit_code(signum: int) -> int:
    """The exit code of a command a signal interrupted: 128 + its number, as a shell reports a process it ended."""
    return 128 + int(signum)


@dataclass(frozen=True, slots=True)
class ExitCodeRow:
    """One documented outcome: its codes, its name, README's few words and ``--help``'s sentence."""

    codes: tuple[ExitCode, ...]
    name: str
    readme: str
    detail: str

    @property
    def code_text(self) -> str:
        return ", ".join(str(int(code)) for code in self.codes)


EXIT_CODES: tuple[ExitCodeRow, ...] = (
    ExitCodeRow((ExitCode.OK,), "ok", "ok", "success (verify: identical; verify-refit: within tolerance)"),
    ExitCodeRow((ExitCode.DIFFERENCES,), "differences", "differences", "verify or verify-refit found differences"),
    ExitCodeRow(
        (ExitCode.BAD_INPUT,),
        "bad input",
        "bad input, named with its fix, before any collective",
        "a path, file, option, model or layout that cannot work; the message names it and the fix, before any "
        "collective",
    ),
    ExitCodeRow(
        (ExitCode.INTERNAL_ERROR,),
        "internal error",
        "internal error",
        "a bug (its traceback is logged), or a rank that crashed or lost a peer that failed first",
    ),
    ExitCodeRow(
        (ExitCode.ENVIRONMENT,),
        "environment",
        "environment (disk full, permissions): the path and errno named",
        "the machine refused (disk full, quota, file-size limit, permissions, read-only filesystem, open-file "
        "limit, out of memory); one line names the path, the errno and the fix",
    ),
    ExitCodeRow(
        (ExitCode.INTERRUPTED, ExitCode.TERMINATED),
        "interrupted",
        "interrupted (Ctrl-C, SIGTERM), the output whole",
        "stopped by SIGINT (Ctrl-C) or SIGTERM: 128 + its number, one line; what was staged is removed, and the "
        "output holds its old checkpoint, or the new one where the swap was done",
    ),
)


def help_table() -> str:
    """The table as ``--help`` prints it (the epilog's ``exit codes:`` block)."""
    lines = ["exit codes:"]
    for row in EXIT_CODES:
        lines += textwrap.wrap(
            f"{row.name}: {row.detail}", width=110, initial_indent=f"  {row.code_text:<10}", subsequent_indent=" " * 12
        )
    return "\n".join(lines)


def readme_table() -> str:
    """The table as README.md holds it (one header row: a code and its words per cell)."""
    cells = [f"**{row.code_text}** {row.readme}" for row in EXIT_CODES]
    return "| " + " | ".join(cells) + " |\n" + "| --- " * len(cells) + "|"


class BadInput(InputError):
    """User input that cannot work; the message names the problem and the fix."""
