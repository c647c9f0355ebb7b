"""The command line: ``python -m mbridge_refit.convert COMMAND`` (console script ``mbridge-refit-convert``).

``app`` (entry point: parse, log, dispatch, map errors to exit codes), ``parser`` (subcommands
and help), ``flags`` (the flags several commands and scripts share: layout, FP8, device,
timeout), ``exit_codes`` (the one table of exit codes), ``inputs`` (checks of paths, configs and
layouts that run on every rank before any collective), ``commands`` (one function per
subcommand), ``writing`` (the export-to-checkpoint path that ``roundtrip`` and ``export`` share)
and ``verify_refit`` (the ``verify-refit`` subcommand).
"""

from mbridge_refit.convert.app import main
from mbridge_refit.convert.exit_codes import BadInput, ExitCode
from mbridge_refit.convert.parser import build_parser

__all__ = ["BadInput", "ExitCode", "build_parser", "main"]
