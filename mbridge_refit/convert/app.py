"""The entry point of ``python -m mbridge_refit.convert``: parse, configure logging, dispatch, and
turn every outcome into one exit code (``exit_codes``).

Runs as one process (``python -m``), as N ranks (``torchrun --nproc-per-node N -m ...``), or
launches N ranks itself (``python -m mbridge_refit.convert --nproc-per-node N COMMAND``, see
``launcher``) and exits with one code for all of them.
Bad input (``BadInput``, and the library's own input errors: a layout that does not fit, a model
the FP8 format cannot hold, a checkpoint whose tensors do not match its config, an output another
writer holds) ends with its message and exit code 2; anything else with its traceback and exit
code 3.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Sequence

from mbridge_refit.convert import commands
from mbridge_refit.convert.exit_codes import BadInput, ExitCode
from mbridge_refit.convert.launcher import run_ranks
from mbridge_refit.convert.parser import build_parser
from mbridge_refit.checkpoints.hf import CheckpointError
from mbridge_refit.checkpoints.loader import LoadError, LoadFailedElsewhere
from mbridge_refit.checkpoints.publish import OutputRefused
from mbridge_refit.convert.verify_refit import cmd_verify_refit
from mbridge_refit.fp8.format import FP8FormatError
from mbridge_refit.plan.layout import LayoutError
from mbridge_refit.tools.launch import LaunchEnv

logger = logging.getLogger("mbridge_refit.convert")

COMMANDS: dict[str, Callable] = {
    "make-tiny": commands.cmd_make_tiny,
    "roundtrip": commands.cmd_roundtrip,
    "import": commands.cmd_import,
    "export": commands.cmd_export,
    "plan": commands.cmd_plan,
    "verify": commands.cmd_verify,
    "verify-refit": cmd_verify_refit,
}

# Library errors that mean "this input cannot work" (their messages name the fix); an output
# another writer holds, or one that changed after the first checks (``OutputRefused``), too.
INPUT_ERRORS = (BadInput, LayoutError, FP8FormatError, LoadError, CheckpointError, OutputRefused)
# Input errors every rank computes alike from the same input (and a rank's note that another rank
# failed): rank 0 prints them, the other ranks only at debug level, so a message appears once.
# ``OutputRefused`` is decided on rank 0 and shared with the others.
SAME_ON_EVERY_RANK = (BadInput, LayoutError, FP8FormatError, CheckpointError, LoadFailedElsewhere, OutputRefused)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.nproc_per_node is not None:
        return _launch(args.nproc_per_node, argv)
    try:
        return int(COMMANDS[args.command](args))
    except INPUT_ERRORS as err:
        quiet = isinstance(err, SAME_ON_EVERY_RANK) and LaunchEnv.from_environ().rank != 0
        logger.log(logging.DEBUG if quiet else logging.ERROR, "%s", err)
        return ExitCode.BAD_INPUT
    except KeyboardInterrupt:
        logger.error("interrupted")
        return ExitCode.INTERNAL_ERROR
    except Exception:
        logger.exception("%s failed (internal error: please report it with this traceback)", args.command)
        return ExitCode.INTERNAL_ERROR


def _launch(nproc_per_node: int, argv: list[str]) -> int:
    if LaunchEnv.from_environ().launched_by_torchrun:
        logger.error("--nproc-per-node starts the ranks itself: run it without torchrun, or drop the flag under torchrun")
        return ExitCode.BAD_INPUT
    return run_ranks(nproc_per_node, _without_nproc_flag(argv))


def _without_nproc_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc-per-node N`` / ``--nproc-per-node=N`` (a top-level flag, before COMMAND)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _configure_logging(verbose: bool) -> None:
    rank = LaunchEnv.from_environ().rank
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("megatron", "megatron.core", "megatron.bridge", "transformers"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
