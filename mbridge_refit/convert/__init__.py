"""The command line: ``python -m mbridge_refit.convert COMMAND`` (console script ``mbridge-refit-convert``).

``app`` (entry point: parse, log, dispatch, map errors to exit codes), ``parser`` (subcommands
and help), ``flags`` (the flags several commands and scripts share: layout, FP8, device,
timeout), ``exit_codes`` (the one table of exit codes), ``interrupts`` (SIGINT and SIGTERM stop a
command with 128 + the signal's number), ``inputs`` (checks of paths, configs and
layouts that run on every rank before any collective), ``preflight`` (the model a config
describes against the checkpoint's tensors, before any weight memory is allocated), ``commands``
(one function per subcommand), ``writing`` (the export-to-checkpoint path that ``roundtrip`` and
``export`` share), ``summary`` (the ``--json`` object of ``roundtrip``, ``export`` and ``verify``),
``launcher`` (``--nproc-per-node``: N ranks, one exit code), ``session``
(process groups: torchrun's environment, gloo or NCCL, Megatron's model-parallel state),
``verify_refit`` (the ``verify-refit`` subcommand), ``refit_verifier`` (what it checks, as a
library: a refit model's weights and log-probabilities against Megatron's) and ``tolerance`` (how
far two correct forwards may differ).

The public names are imported lazily, so that ``python -m mbridge_refit.convert`` reaches its
``__main__`` (which turns an interrupt while ``app`` is being imported into one line) before
anything heavy is imported; ``app`` imports a command's module (torch, Megatron) only once the
arguments are parsed, so ``--help`` and usage errors import neither.
"""

from __future__ import annotations

from mbridge_refit.lazy_exports import lazy_getattr, public_names

_PUBLIC = {
    "mbridge_refit.convert.app": ("main",),
    "mbridge_refit.convert.exit_codes": ("BadInput", "ExitCode"),
    "mbridge_refit.convert.parser": ("build_parser",),
}

__all__ = public_names(_PUBLIC)


__getattr__ = lazy_getattr(__name__, _PUBLIC)
