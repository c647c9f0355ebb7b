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
and raises ``SignalException``) ends it with exit code 3 and one line naming the signal.

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

from mbridge_refit.convert.exit_codes import ExitCode
from mbridge_refit.convert.session import EXIT_RECORDS_VARIABLE, LaunchEnv

__all__ = ["KNOWN_CODES", "launch_exit_code", "record_exit_code", "run_ranks"]

logger = logging.getLogger("mbridge_refit.convert")

KNOWN_CODES = frozenset(int(code) for code in ExitCode)


def launch_exit_code(rank_codes: Mapping[int, int]) -> int:
    """One exit code for a launch from the codes of the ranks that failed (0 when none did).

    The most severe documented code wins (4 environment > 3 internal error > 2 bad input > 1
    differences: a rank whose disk filled up can make its peers fail with internal errors, and the
    cause is what to report); a rank ended by a signal or with an undocumented code (a crash, the
    launcher stopping the others) counts as an internal error unless a documented code explains
    the failure.
    """
    documented = [code for code in rank_codes.values() if code in KNOWN_CODES and code != ExitCode.OK]
    if documented:
        return max(documented)
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
        name = signal.Signals(stopped.sigval).name
        logger.error("stopped by %s: the %d ranks were shut down (exit code 3)", name, nproc_per_node)
        return ExitCode.INTERNAL_ERROR
    except KeyboardInterrupt:  # before torchrun installed its handlers
        logger.error("interrupted: the ranks were shut down (exit code 3)")
        return ExitCode.INTERNAL_ERROR
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
