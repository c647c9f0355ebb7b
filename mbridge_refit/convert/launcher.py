"""``convert --nproc-per-node N COMMAND ...``: launch the ranks on this machine and exit with one code.

Under ``torchrun`` each rank exits with its own code (``exit_codes``) and torchrun itself exits 1
for any failure, so a script cannot tell bad input (2) from an internal error (3) or from
``verify``'s differences (1). This launcher runs the same ranks through torchrun's own machinery
(``torch.distributed.run``, standalone rendezvous on a free local port) and turns the ranks'
codes into one, ``launch_exit_code``. The ranks print their own messages, except an input error
every rank sees alike: each rank records it and the launcher prints it once. Rank 0 printing it
(as under plain torchrun) loses it whenever another rank fails first: torchrun then stops rank 0
before it gets there. The launcher adds one line naming which rank failed how.
A signal to the launcher (SIGTERM, SIGINT, SIGHUP, SIGQUIT: torchrun's machinery stops the ranks
with SIGTERM, each removes what it had staged, and raises ``SignalException``) ends it as the signal
ends one process: 128 + its number (130 for Ctrl-C, 143 for SIGTERM) and one line naming it.

Each rank also records its exit code (and that message) in a directory the launcher names (``record_exit_code``,
``convert.session.EXIT_RECORDS_VARIABLE``) as soon as it has decided it. A rank that fails closes its
connections before its process ends, so a peer waiting in a collective may fail ("connection
closed by peer") and exit first, and torchrun then stops the failing rank by a signal: its own
code, the cause, would be lost without the record.

Called by ``convert.app.main`` in the parent process only; the ranks it starts are ordinary
torchrun ranks (``python -m mbridge_refit.convert COMMAND ...`` with torchrun's environment).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from mbridge_refit.convert.exit_codes import ExitCode, signal_exit_code
from mbridge_refit.convert.interrupts import interrupt_signal
from mbridge_refit.convert.session import EXIT_RECORDS_VARIABLE, LaunchEnv

__all__ = ["FAILURE_CODES", "INTERRUPT_CODES", "KNOWN_CODES", "launch_exit_code", "record_exit_code", "run_ranks"]

logger = logging.getLogger("mbridge_refit.convert")

KNOWN_CODES = frozenset(int(code) for code in ExitCode)
FAILURE_CODES = frozenset(
    (ExitCode.DIFFERENCES, ExitCode.BAD_INPUT, ExitCode.INTERNAL_ERROR, ExitCode.ENVIRONMENT)
)  # what a rank found
INTERRUPT_CODES = (ExitCode.INTERRUPTED, ExitCode.TERMINATED)  # what a rank was told: Ctrl-C first (see below)


def launch_exit_code(rank_codes: Mapping[int, int]) -> int:
    """One exit code for a launch from the codes of the ranks that failed (0 when none did).

    The most severe failure a rank found wins (4 environment > 3 internal error > 2 bad input > 1
    differences: a rank whose disk filled up can make its peers fail with internal errors, and the
    cause is what to report). A rank that reports an interruption was stopped, by the user or by
    torchrun once a peer failed: it explains nothing a failure explains, and where no rank failed
    the launch ends interrupted, 130 (SIGINT) before 143 (torchrun stops ranks with SIGTERM, so a
    143 may be its own doing). A rank killed by a signal it did not handle, or ended with an
    undocumented code (a crash), counts as an internal error unless another code explains it.
    """
    failures = [code for code in rank_codes.values() if code in FAILURE_CODES]
    if failures:
        return max(failures)
    interrupted = next((code for code in INTERRUPT_CODES if code in rank_codes.values()), None)
    if interrupted is not None:
        return interrupted
    return ExitCode.INTERNAL_ERROR if rank_codes else ExitCode.OK


def run_ranks(nproc_per_node: int, argv: Sequence[str]) -> int:
    """Run ``python -m mbridge_refit.convert *argv`` as ``nproc_per_node`` ranks; return one exit code."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc_per_node), "-m", "mbridge_refit.convert", *argv]
    )
    records = Path(tempfile.mkdtemp(prefix="mbridge-refit-exit-codes-"))
    os.environ[EXIT_RECORDS_VARIABLE] = str(records)  # the ranks inherit this process's environment
    try:
        run(args)
    except ChildFailedError as failed:
        ended = {rank: failure.exitcode for rank, failure in failed.failures.items()}
        recorded, messages = _records(records)
        for message in messages:
            logger.error("%s", message)
        codes = {rank: recorded.get(rank, code) for rank, code in ended.items()}
        code = launch_exit_code(codes)
        described = ", ".join(f"rank {rank}: {_describe(c, recorded.get(rank))}" for rank, c in sorted(ended.items()))
        logger.error("%d of %d ranks failed (%s): exit code %d", len(codes), nproc_per_node, described, code)
        return code
    except SignalException as stopped:
        code = signal_exit_code(stopped.sigval)
        name = signal.Signals(stopped.sigval).name
        logger.error("stopped by %s: the %d ranks were shut down (exit code %d)", name, nproc_per_node, code)
        return code
    except KeyboardInterrupt as interrupted:  # before torchrun installed its handlers, or after it restored ours
        signum = interrupt_signal(interrupted)
        code = signal_exit_code(signum)
        logger.error("interrupted by %s: the ranks were shut down (exit code %d)", signal.Signals(signum).name, code)
        return code
    finally:
        os.environ.pop(EXIT_RECORDS_VARIABLE, None)
        shutil.rmtree(records, ignore_errors=True)
    return ExitCode.OK


def record_exit_code(code: int, shared_message: str | None = None) -> bool:
    """In a rank of ``run_ranks``: record the exit code this rank decided on and, for a failure every
    rank sees alike, its message (``shared_message``), which the launcher then prints once.
    Whether it was recorded: False outside the launcher or where its directory cannot be written
    (the rank prints its message itself then)."""
    env = LaunchEnv.from_environ()
    if env.exit_records is None:
        return False
    record = json.dumps({"code": int(code), "message": shared_message})
    try:
        (Path(env.exit_records) / f"rank{env.rank}").write_text(record)
    except OSError:  # the launcher's directory is gone or full: its own view of the exit stands
        return False
    return True


def _records(records: Path) -> tuple[dict[int, int], list[str]]:
    """The recorded exit code of each rank, and the distinct shared messages in rank order."""
    entries = {}
    for record in records.glob("rank*"):
        try:
            entry = json.loads(record.read_text())
            entries[int(record.name.removeprefix("rank"))] = (int(entry["code"]), entry.get("message"))
        except (OSError, ValueError, KeyError, TypeError):  # a rank stopped while writing
            continue
    ordered = sorted(entries.items())  # by rank number: rank10 after rank9
    codes = {rank: code for rank, (code, _) in ordered}
    messages = list(dict.fromkeys(message for _, (_, message) in ordered if isinstance(message, str)))
    return codes, messages


def _describe(code: int, recorded: int | None = None) -> str:
    if code < 0:
        stopped = f"killed by signal {-code}"
        return stopped if recorded is None else f"{_describe(recorded)}, then {stopped}"
    return f"exit {code}" + (f" ({ExitCode(code).name.lower().replace('_', ' ')})" if code in KNOWN_CODES else "")
