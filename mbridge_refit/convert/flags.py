"""Flags that several commands (and the scripts under ``scripts/``) share, and their parsing.

``add_layout_flags`` / ``layout_from_flags``: the parallel layout (--tp, --pp, --vpp, --ep, --etp,
--first-stage-layers, --last-stage-layers); ``layout_flags`` writes a layout back as those flags. ``add_fp8_flags`` / ``fp8_from_flags``: blockwise FP8
output. ``add_device_flag`` / ``device_from_flag``, ``add_timeout_flag``,
``add_remote_code_flag`` and ``add_progress_flags`` / ``progress_from_flags`` (the progress bars of
loading and exporting: shown where stderr is a terminal, ``--progress`` shows them in a log too,
``--no-progress`` hides them). Parsing raises
``BadInput`` naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from typing import TYPE_CHECKING

from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.plan.layout import LayoutError, ParallelLayout

if TYPE_CHECKING:
    import torch

    from mbridge_refit.fp8.format import BlockwiseFP8Config

__all__ = [
    "MAX_TIMEOUT_S",
    "add_device_flag",
    "add_fp8_flags",
    "add_layout_flags",
    "add_overwrite_flag",
    "add_progress_flags",
    "add_remote_code_flag",
    "add_timeout_flag",
    "describe_flags",
    "device_from_flag",
    "fp8_from_flags",
    "layout_flags",
    "layout_from_flags",
    "positive_seconds",
    "progress_from_flags",
    "timeout_from_flag",
]


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "parallel layout",
        "One model replica spans tp*pp*cp ranks; a world size that is a multiple of it runs "
        "world/(tp*pp*cp) data-parallel replicas, each holding a full copy of the weights (experts "
        "are split over ep ranks carved from dp*cp*tp, as Megatron does).",
    )
    group.add_argument("--tp", type=int, default=1, help="tensor parallel size (default: 1)")
    group.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default: 1)")
    group.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank")
    group.add_argument(
        "--cp", type=int, default=1, help="context parallel size: splits sequences, not weights (default: 1)"
    )
    group.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE only (default: 1)")
    group.add_argument(
        "--etp",
        type=int,
        default=1,
        help="expert tensor parallel size, MoE only: each routed expert split over this many ranks "
        "(default: 1; Megatron-Core's own default, when a provider leaves it unset, is the --tp size)",
    )
    group.add_argument(
        "--first-stage-layers", type=int, default=None, help="layers on the first PP stage (uneven split)"
    )
    group.add_argument("--last-stage-layers", type=int, default=None, help="layers on the last PP stage (uneven split)")


def layout_from_flags(args: argparse.Namespace) -> ParallelLayout:
    """The layout the flags describe (not yet checked against a model or a world size)."""
    try:
        return ParallelLayout(
            tp=args.tp,
            pp=args.pp,
            vpp=args.vpp,
            cp=getattr(args, "cp", 1),
            ep=args.ep,
            etp=getattr(args, "etp", 1),
            first_stage_layers=getattr(args, "first_stage_layers", None),
            last_stage_layers=getattr(args, "last_stage_layers", None),
        )
    except LayoutError as err:
        raise BadInput(f"layout {describe_flags(args)}: {err}") from err


def layout_flags(layout: ParallelLayout) -> list[str]:
    """The flags ``layout_from_flags`` reads back as ``layout`` (defaults left out)."""
    values = {
        "--tp": layout.tp,
        "--pp": layout.pp,
        "--vpp": layout.vpp,
        "--cp": layout.cp,
        "--ep": layout.ep,
        "--etp": layout.etp,
        "--first-stage-layers": layout.first_stage_layers,
        "--last-stage-layers": layout.last_stage_layers,
    }
    defaults = {"--tp": 1, "--pp": 1, "--cp": 1, "--ep": 1, "--etp": 1}
    return [
        part
        for flag, value in values.items()
        if value is not None and value != defaults.get(flag)
        for part in (flag, str(value))
    ]


def describe_flags(args: argparse.Namespace) -> str:
    return f"tp={args.tp} pp={args.pp} vpp={args.vpp} cp={getattr(args, 'cp', 1)} ep={args.ep} etp={getattr(args, 'etp', 1)}"


def add_fp8_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FP8 output")
    group.add_argument(
        "--fp8-blockwise",
        action="store_true",
        help="write linear weights as 128x128-blockwise float8_e4m3fn with fp32 weight_scale_inv and a "
        "quantization_config in config.json (DeepSeek-V3 / Qwen3-FP8 format)",
    )
    group.add_argument(
        "--fp8-keep",
        action="append",
        metavar="PATTERN",
        help="fnmatch pattern of HF names kept in their dtype (repeatable; replaces the model family's "
        "patterns from mbridge_refit.fp8.keep: embeddings, output layer, norms, MoE routers, encoders, ...)",
    )
    group.add_argument(
        "--fp8-engine-tp",
        type=int,
        default=None,
        metavar="N",
        help="fail unless an engine at tensor-parallel size N can shard every FP8 weight on block boundaries",
    )


def fp8_from_flags(args: argparse.Namespace) -> "BlockwiseFP8Config | None":
    from mbridge_refit.fp8.format import BlockwiseFP8Config

    if not args.fp8_blockwise:
        if args.fp8_keep or args.fp8_engine_tp is not None:
            raise BadInput("--fp8-keep and --fp8-engine-tp need --fp8-blockwise")
        return None
    if args.fp8_engine_tp is not None and args.fp8_engine_tp < 1:
        raise BadInput(f"--fp8-engine-tp must be >= 1, got {args.fp8_engine_tp}")
    keep = tuple(args.fp8_keep) if args.fp8_keep else None  # None: the model family's (fp8.keep)
    return BlockwiseFP8Config(keep_patterns=keep, engine_tp_size=args.fp8_engine_tp)


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if present")


def device_from_flag(args: argparse.Namespace) -> "torch.device":
    import torch

    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda but no CUDA device is visible: use --device cpu")
    return torch.device(args.device)


def add_overwrite_flag(parser: argparse.ArgumentParser, *, replaces: str = "an existing output directory") -> None:
    parser.add_argument("--overwrite", action="store_true", help=f"replace {replaces}")


def add_remote_code_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let a checkpoint whose model_type transformers does not have built in run its own Python code (the "
        "auto_map of its config.json): only for checkpoints you trust. Without it such a checkpoint is refused "
        "(exit 2); a built-in model_type loads with transformers' own class whatever auto_map says",
    )


# The longest --timeout-s (about 115 days): longer ones overflow the process group's millisecond count.
MAX_TIMEOUT_S = 1e7


def positive_seconds(text: str) -> float:
    """argparse type: seconds in (0, ``MAX_TIMEOUT_S``] (``nan`` and ``inf`` parse as floats but are no timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (0 < value <= MAX_TIMEOUT_S):  # also false for nan
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, {MAX_TIMEOUT_S:.0e}], got {text!r}")
    return value


def add_timeout_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout-s",
        type=positive_seconds,
        default=600.0,
        help="bound on every collective, so a rank whose peer died fails instead of hanging (default: %(default)s)",
    )


def timeout_from_flag(args: argparse.Namespace) -> datetime.timedelta:
    if not (0 < args.timeout_s <= MAX_TIMEOUT_S):  # the parser refuses these; a Namespace made by hand may not
        raise BadInput(f"--timeout-s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0e}], got {args.timeout_s}")
    return datetime.timedelta(seconds=args.timeout_s)


def add_progress_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--progress", action="store_true", help="show the progress bars even where stderr is no terminal (a log file)"
    )
    group.add_argument("--no-progress", action="store_true", help="hide the progress bars of loading and exporting")


def progress_from_flags(args: argparse.Namespace) -> bool:
    """Show the progress bars (on rank 0): ``--progress``, or stderr is a terminal and ``--no-progress`` is not given."""
    return args.progress or (not args.no_progress and sys.stderr.isatty())
