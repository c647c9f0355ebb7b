"""The entry point of ``python -m mbridge_refit.convert``: parse, configure logging, dispatch, and
turn every outcome into one exit code (``exit_codes``).

Runs as one process (``python -m``), as N ranks (``torchrun --nproc-per-node N -m ...``), or
launches N ranks itself (``python -m mbridge_refit.convert --nproc-per-node N COMMAND``, see
``launcher``) and exits with one code for all of them.

Every failure of a command goes through one classifier, ``classify``, which looks at the exception
and at everything it wraps (``__cause__``, ``__context__``, and the per-rank failures of
torch.distributed.checkpoint's ``CheckpointException``, which derives from ``BaseException``):

- environment (exit 4): an ``OSError`` whose errno says the machine refused (``ENVIRONMENT_ERRNOS``:
  disk full, quota, file-size limit, permissions, read-only filesystem, open-file limits, I/O
  error), the same error as safetensors' writer reports it (``... (os error 28)``), or an
  allocation that failed (``MemoryError``, torch's "can't allocate memory", CUDA out of memory: the
  model matches its checkpoint by then, so the machine is too small); one line names the path
  (the file, or the command's output when the error names none), the errno and what to do (an
  output this user may not write, ``inputs.OutputNotWritable``, is found on every rank alike: printed once);
- bad input (exit 2): ``BadInput`` and the library's own input errors (``INPUT_ERRORS``: a layout
  that does not fit, a model the FP8 format cannot hold, a damaged or hostile checkpoint or
  config, a checkpoint whose tensors do not match its config, an output another writer holds);
  their messages name the file and the fix;
- a collective that lost a peer rank (gloo's "connection closed by peer", ...) is exit 3 in one
  line: the peer failed first and its own message says why;
- anything else is an internal error (exit 3) and is logged with its traceback.

An interrupt (SIGINT, SIGTERM: ``interrupts``) anywhere in ``main`` comes first: it ends with 128 +
the signal's number (130, 143) and one line, whatever failed while it unwound.

A rank records its code for the ``--nproc-per-node`` launcher before it logs (``launcher``).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import logging
import os
import re
import signal
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from mbridge_refit.convert.exit_codes import ExitCode, signal_exit_code
from mbridge_refit.convert.inputs import OutputNotWritable
from mbridge_refit.convert.interrupts import interrupt_signal, signals_interrupt
from mbridge_refit.convert.launcher import record_exit_code, run_ranks
from mbridge_refit.convert.parser import build_parser
from mbridge_refit.convert.session import LaunchEnv
from mbridge_refit.convert.summary import summary_on_stdout, write_summary
from mbridge_refit.errors import InputError

__all__ = [
    "COMMANDS",
    "ENVIRONMENT_ERRNOS",
    "Failure",
    "INPUT_ERRORS",
    "SAME_ON_EVERY_RANK",
    "THIRD_PARTY_LOGGERS",
    "THIRD_PARTY_WARNINGS_VARIABLE",
    "classify",
    "command",
    "environment_message",
    "hide_third_party_warnings",
    "interrupted",
    "main",
    "same_on_every_rank",
]

logger = logging.getLogger("mbridge_refit.convert")

# command -> (module, function): a command's module (torch, Megatron: seconds) is imported when the
# command runs, after the arguments are parsed, so that ``--help`` and usage errors do not wait for it.
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny": ("mbridge_refit.convert.commands", "cmd_make_tiny"),
    "roundtrip": ("mbridge_refit.convert.commands", "cmd_roundtrip"),
    "import": ("mbridge_refit.convert.commands", "cmd_import"),
    "export": ("mbridge_refit.convert.commands", "cmd_export"),
    "export-adapter": ("mbridge_refit.convert.export_adapter", "cmd_export_adapter"),
    "plan": ("mbridge_refit.convert.commands", "cmd_plan"),
    "verify": ("mbridge_refit.convert.commands", "cmd_verify"),
    "verify-refit": ("mbridge_refit.convert.verify_refit", "cmd_verify_refit"),
}

# Errors that mean "this input cannot work" (their messages name the file and the fix): every one
# the library raises so derives from ``errors.InputError``.
INPUT_ERRORS = (InputError,)
# Input errors every rank computes alike from the same input (and a rank's note that another rank
# failed): rank 0 prints them, the other ranks only at debug level, so a message appears once.
# Named by (module, class): an error whose module was never imported cannot have been raised, so
# ``classify`` looks only at the classes of imported modules and imports none itself.
SAME_ON_EVERY_RANK: tuple[tuple[str, str], ...] = (
    ("mbridge_refit.convert.exit_codes", "BadInput"),
    ("mbridge_refit.plan.layout", "LayoutError"),
    ("mbridge_refit.fp8.format", "FP8FormatError"),
    ("mbridge_refit.checkpoints.hf", "CheckpointError"),
    ("mbridge_refit.checkpoints.hf", "ConfigError"),
    ("mbridge_refit.checkpoints.megatron", "NotAMegatronCheckpoint"),
    ("mbridge_refit.checkpoints.loader", "LoadFailedElsewhere"),
    ("mbridge_refit.checkpoints.publish", "OutputRefused"),  # decided on rank 0 and shared with the others
)
# The loggers of the packages below us, ERROR only unless --verbose or THIRD_PARTY_WARNINGS_VARIABLE=1
# (``hide_third_party_warnings``: their Python warnings too).
THIRD_PARTY_LOGGERS = ("megatron", "transformers", "TransformerEngine", "torch", "absl")
THIRD_PARTY_WARNINGS_VARIABLE = "MBRIDGE_REFIT_THIRD_PARTY_WARNINGS"
# errno -> what to do about it: the machine refused what the input asked for (exit code 4).
ENVIRONMENT_ERRNOS: dict[int, str] = {
    errno.ENOSPC: "free space on that filesystem, or write the output elsewhere",
    errno.EDQUOT: "raise the disk quota, or write the output elsewhere",
    errno.EFBIG: "a file-size limit (`ulimit -f`, or the filesystem's largest file) is below the file's size: "
    "raise it, or write the output elsewhere",
    errno.EACCES: "give this user access to the path, or use another one",
    errno.EPERM: "give this user access to the path, or use another one",
    errno.EROFS: "the filesystem is mounted read-only: write the output elsewhere",
    errno.EMFILE: "this process may open no more files: raise the limit (`ulimit -n`)",
    errno.ENFILE: "the system may open no more files: close other programs' files or raise fs.file-max",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg) before running again",
    errno.ENOMEM: "not enough memory: use a machine with more, or more ranks (a smaller share each)",
}
# How a collective tells a rank that a peer died first (gloo, NCCL): a consequence, not this rank's bug.
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited|communicator was aborted")
# How torch reports an allocation it could not make (CPU: "can't allocate memory"; CUDA: OutOfMemoryError).
_OUT_OF_MEMORY = re.compile(r"can't allocate memory|CUDA out of memory|out of memory")
# How safetensors' writer reports an OS error: its own exception type, the errno only in the text.
_SAFETENSORS_OS_ERROR = re.compile(r"(?P<strerror>[^:]*) \(os error (?P<errno>\d+)\)")


@dataclass(frozen=True, slots=True)
class Failure:
    """What a failed command ends with: its exit code, the line to log, and whether the traceback
    goes with it (internal errors only)."""

    code: int  # an ExitCode
    message: str
    traceback: bool = False
    same_on_every_rank: bool = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns its exit code (``exit_codes``).
    SIGINT and SIGTERM interrupt it (``interrupts``) until it returns; the handlers before are restored."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with signals_interrupt():
        try:
            return _main(argv)
        except KeyboardInterrupt as err:  # outside a command: parsing, or reporting a failure
            return _report("convert", err, classify(err))


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    if args.nproc_per_node is not None:
        return _launch(args.nproc_per_node, argv)
    with summary_on_stdout(getattr(args, "json", None) is True):  # --json of roundtrip, export, verify
        try:
            return int(command(args.command)(args))
        except (SystemExit, GeneratorExit):
            raise
        except BaseException as err:  # CheckpointException and KeyboardInterrupt derive from BaseException only
            failure = classify(err, output=_output_of(args))
            code = _report(args.command, err, failure)  # first: it records the code for the launcher
            if LaunchEnv.from_environ().rank == 0:
                write_summary({"command": args.command, "ok": False, "exit_code": code, "error": failure.message})
            return code


def command(name: str) -> Callable[[argparse.Namespace], int]:
    """The function that runs the command ``name`` (its module imported now)."""
    module, function = COMMANDS[name]
    return getattr(importlib.import_module(module), function)


def same_on_every_rank(err: BaseException) -> bool:
    """Whether ``err`` is one of the ``SAME_ON_EVERY_RANK`` errors."""
    for module, name in SAME_ON_EVERY_RANK:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(err, getattr(loaded, name)):
            return True
    return False


def classify(err: BaseException, *, output: Path | None = None) -> Failure:
    """Interrupted (128 + the signal), environment (4), bad input (2) or internal error (3): see the
    module docstring."""
    interrupt = next((inner for inner in _wrapped(err) if isinstance(inner, KeyboardInterrupt)), None)
    if interrupt is not None:  # DCP wraps it per rank
        return interrupted(interrupt_signal(interrupt))
    for inner in _wrapped(err):
        environment = environment_message(inner, output)
        if environment is not None:
            return Failure(ExitCode.ENVIRONMENT, environment, same_on_every_rank=isinstance(inner, OutputNotWritable))
    for inner in _wrapped(err):
        if isinstance(inner, INPUT_ERRORS):
            message = one_line(str(inner))
            return Failure(ExitCode.BAD_INPUT, message, same_on_every_rank=same_on_every_rank(inner))
    lost = next((e for e in _wrapped(err) if isinstance(e, RuntimeError) and _PEER_LOST.search(str(e))), None)
    if lost is not None:
        first_line = str(lost).strip().splitlines()[0]
        return Failure(
            ExitCode.INTERNAL_ERROR,
            f"another rank of this job failed first (its own message says why); this rank lost it: {first_line}",
        )
    return Failure(ExitCode.INTERNAL_ERROR, "internal error: please report it with this traceback", traceback=True)


def interrupted(signum: int) -> Failure:
    """The failure of a command the signal ``signum`` interrupted (the writers it stopped say what
    became of their output)."""
    code = signal_exit_code(signum)
    name = signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")
    return Failure(code, f"interrupted by {name}: stopped before the command ended (exit code {code})")


def environment_message(err: BaseException, output: Path | None) -> str | None:
    """The line an environment failure ends with (path, errno, what to do), or None if ``err`` is none."""
    if isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and _OUT_OF_MEMORY.search(str(err))):
        first_line = (str(err).strip().splitlines() or [""])[0][:300]
        return f"out of memory ({type(err).__name__}: {first_line}): {ENVIRONMENT_ERRNOS[errno.ENOMEM]}"
    number, strerror, path = None, None, None
    if isinstance(err, OSError) and err.errno in ENVIRONMENT_ERRNOS:
        number, strerror, path = err.errno, err.strerror, err.filename
    elif type(err).__name__ == "SafetensorError" and (match := _SAFETENSORS_OS_ERROR.search(str(err))):
        number, strerror = int(match["errno"]), match["strerror"].rsplit(": ", 1)[-1].strip()
    if number not in ENVIRONMENT_ERRNOS:
        return None
    where = str(path) if path is not None else (f"writing {output}" if output is not None else "(no path given)")
    name = errno.errorcode.get(number, "?")
    return f"{where}: {strerror or 'error'} [errno {number} {name}]: {ENVIRONMENT_ERRNOS[number]}"


def _wrapped(err: BaseException) -> Iterator[BaseException]:
    """``err`` and everything it wraps: causes, contexts, and CheckpointException's per-rank failures."""
    seen: set[int] = set()
    pending = [err]
    while pending and len(seen) < 64:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch's CheckpointException: rank -> (exception, traceback)
        for failure in failures.values() if isinstance(failures, dict) else ():
            pending.append(failure[0] if isinstance(failure, tuple) and failure else getattr(failure, "exc", None))


def one_line(message: str) -> str:
    """``message`` on one line: a refusal quotes what a library raised (transformers' validation errors
    span lines, a quoted name may hold any line break ``str.splitlines`` knows), and the contract is
    one line per failure."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def _report(command: str, err: BaseException, failure: Failure) -> int:
    shared = failure.same_on_every_rank and not failure.traceback
    # first: the launcher may stop this rank while it logs; a message every rank sees alike it prints once
    by_launcher = record_exit_code(failure.code, failure.message if shared else None) and shared
    if failure.traceback:
        logger.error("%s failed (%s)", command, failure.message, exc_info=err)
    else:
        quiet = shared and (by_launcher or LaunchEnv.from_environ().rank != 0)
        logger.log(logging.DEBUG if quiet else logging.ERROR, "%s", failure.message)
    return failure.code


def _output_of(args: argparse.Namespace) -> Path | None:
    """What the command writes, named by environment failures whose error names no file."""
    for flag in ("megatron", "out", "json") if args.command == "import" else ("out", "json"):
        if isinstance(getattr(args, flag, None), Path):
            return getattr(args, flag)
    return None


def _launch(nproc_per_node: int, argv: list[str]) -> int:
    if LaunchEnv.from_environ().launched_by_torchrun:
        logger.error(
            "--nproc-per-node starts the ranks itself: run it without torchrun, or drop the flag under torchrun"
        )
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
    quiet = not verbose and os.environ.get(THIRD_PARTY_WARNINGS_VARIABLE, "") in ("", "0")
    for noisy in THIRD_PARTY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR if quiet else max(level, logging.WARNING))
    if quiet:
        hide_third_party_warnings()


def hide_third_party_warnings() -> None:
    """Hide the warnings of the packages below us (``THIRD_PARTY_LOGGERS``' packages, and every
    ``warnings.warn`` of a module outside ``mbridge_refit``: "Apex is not installed", absl's,
    DCP's deprecations): a user of the command line cannot act on them, and they bury its own
    lines. Errors still show. Called before a command imports them (their import warns)."""
    warnings.filterwarnings("ignore", module=r"(?!mbridge_refit(\.|$))")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # transformers sets its level on import
    os.environ.setdefault("TORCH_LOGS", "-torch")  # torch's loggers: errors only (torch resets their levels on import)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10's own warnings
