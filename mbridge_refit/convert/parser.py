"""The argument parser of ``python -m mbridge_refit.convert``: subcommands, flags and help.

Imports nothing that imports torch or Megatron (``--help`` answers in well under a second;
tests/test_convert_cli.py checks it): what the commands need is imported when they run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mbridge_refit.convert.exit_codes import help_table
from mbridge_refit.convert.export_adapter import add_export_adapter_parser
from mbridge_refit.convert.flags import (
    add_device_flag,
    add_fp8_flags,
    add_layout_flags,
    add_overwrite_flag,
    add_progress_flags,
    add_remote_code_flag,
    add_timeout_flag,
)
from mbridge_refit.convert.verify_refit import add_verify_refit_parser

__all__ = ["COMMAND_TEXT", "EPILOG", "FLAGS", "SHARD_BYTES_HELP", "build_parser", "positive_int"]

EPILOG = (
    """\
examples:
  # a tiny random Qwen3 checkpoint from a built-in recipe (no downloads)
  python -m mbridge_refit.convert make-tiny --recipe qwen3-tiny --out /tmp/qwen3-tiny

  # HF -> Megatron (TP2 x PP2 on 4 CPU ranks) -> HF, then check the result bit for bit
  python -m mbridge_refit.convert --nproc-per-node 4 roundtrip \\
      --hf /tmp/qwen3-tiny --out /tmp/qwen3-tiny-rt --tp 2 --pp 2
  python -m mbridge_refit.convert verify /tmp/qwen3-tiny /tmp/qwen3-tiny-rt

  # MoE with expert parallelism
  torchrun --nproc-per-node 2 -m mbridge_refit.convert roundtrip --hf MOE --out OUT --ep 2

  # HF -> Megatron checkpoint on disk (TP2 on 2 CPU ranks), then back to HF at another layout
  torchrun --nproc-per-node 2 -m mbridge_refit.convert import \\
      --hf /tmp/qwen3-tiny --megatron /tmp/qwen3-tiny-mcore --tp 2
  torchrun --nproc-per-node 2 -m mbridge_refit.convert export \\
      --megatron /tmp/qwen3-tiny-mcore --out /tmp/qwen3-tiny-hf --pp 2

  # an HF PEFT adapter from a Megatron-Bridge LoRA training run's checkpoints, onto its base model
  python -m mbridge_refit.convert export-adapter --megatron RUN/checkpoints --hf BASE_HF --out ADAPTER

  # an HF FP8 checkpoint (128x128 blockwise e4m3 + weight_scale_inv) from a bf16 one
  torchrun --nproc-per-node 2 -m mbridge_refit.convert roundtrip \\
      --hf /tmp/qwen3-tiny --out /tmp/qwen3-tiny-fp8 --tp 2 --fp8-blockwise

  # does a transformers model updated in place from the export compute what Megatron computes?
  python -m mbridge_refit.convert verify-refit --recipe qwen3-tiny --device cpu

  # what an export will yield, where each tensor lives (no weights are read)
  torchrun --nproc-per-node 2 -m mbridge_refit.convert plan --hf /tmp/qwen3-tiny --pp 2 --json plan.json

"""
    + help_table()
    + """
  With --nproc-per-node, the most severe code any rank found (a signal to the launcher: its own code);
  under torchrun, each rank's own code (torchrun then exits 1 and lists them).
"""
)


# What --max-shard-bytes defaults to: ShardedSafetensorsWriter's DEFAULT_MAX_SHARD_BYTES, named here
# without importing the writer (tests/test_convert_cli.py checks the two agree).
SHARD_BYTES_HELP = "5368709120, 5 GiB"


def positive_int(text: str) -> int:
    """argparse type: an integer > 0 (argparse turns the ValueError into a usage error, exit 2)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# name -> (one-line help, description)
COMMAND_TEXT: dict[str, tuple[str, str | None]] = {
    "make-tiny": ("write a tiny random HF checkpoint from a built-in recipe", None),
    "roundtrip": (
        "load HF weights into a Megatron layout and export them back to HF",
        "Load --hf into a Megatron model split as --tp/--pp/--vpp/--cp/--ep across the launched ranks (any "
        "multiple of tp*pp*cp: the rest are data-parallel replicas), export it back with RefitBridge and write --out. "
        "Replicas write in parallel: each exports and writes its own share of the shards (the files do not depend "
        "on the number of ranks).",
    ),
    "import": (
        "HF checkpoint -> Megatron checkpoint (Megatron-Core dist_checkpointing, torch_dist)",
        "Load --hf into a Megatron model split as --tp/--pp/--vpp/--ep across the launched ranks "
        "(any multiple of tp*pp*cp) and save it with Megatron-Core's dist_checkpointing to --megatron. "
        "The HF config.json and tokenizer files are stored next to the weights, so `export` needs nothing else. "
        "The saved checkpoint loads at any layout that fits the model.",
    ),
    "export": (
        "Megatron checkpoint (written by `import` or by training) -> HF checkpoint, at any layout",
        "Load the Megatron checkpoint --megatron into a model split as --tp/--pp/--vpp/--ep (which may "
        "differ from the layout it was saved with), export it with RefitBridge and write --out. The HF config "
        "and tokenizer files come from the checkpoint directory (stored there by `import`); each tensor gets the "
        "dtype it had in the original HF checkpoint. A training run's torch_dist checkpoint (Megatron-Bridge's "
        "save directory, whose tracker names the iteration, or an iter_* directory) takes them from --hf, the HF "
        "checkpoint the run started from; its optimizer, RNG and train state are not read.",
    ),
    "plan": (
        "print (and optionally save) the export plan of a checkpoint for a layout",
        "Build the model on the meta device (no weights are read), compute RefitBridge's export plan "
        "and print one line per HF tensor: name, shape, dtype, bytes, pipeline stage, source mesh and placements. "
        "Run it with as many ranks as the layout needs.",
    ),
    "verify": (
        "compare two HF checkpoints tensor by tensor (names, shapes, dtypes, bytes)",
        "Exit 0 only when both checkpoints hold the same names with equal shapes, dtypes and bytes.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mbridge_refit.convert",
        description="Convert Hugging Face checkpoints through Megatron-Core parallel layouts, exactly.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging, and the warnings of Megatron, Transformer Engine, transformers, torch (hidden "
        "otherwise; MBRIDGE_REFIT_THIRD_PARTY_WARNINGS=1 shows them without debug logging)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=positive_int,
        default=None,
        metavar="N",
        help="launch N ranks on this machine (torchrun's machinery) and exit with one code for the whole launch: "
        "the most severe of the ranks' codes (torchrun itself exits 1 for any failure). Goes before COMMAND.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, add_flags in FLAGS.items():
        help_text, description = COMMAND_TEXT[name]
        add_flags(sub.add_parser(name, help=help_text, description=description, allow_abbrev=False))
    add_export_adapter_parser(sub)
    add_verify_refit_parser(sub)
    return parser


def _make_tiny_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default=None, help="recipe name (default: qwen3-tiny); see --list")
    parser.add_argument("--out", type=Path, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument(
        "--max-shard-bytes", type=positive_int, default=None, help="shard size; small values force sharding"
    )
    add_overwrite_flag(parser)
    parser.add_argument("--list", action="store_true", help="list recipes and layouts, then exit")


def _roundtrip_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", type=Path, required=True, help="input HF checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="output HF checkpoint directory")
    add_device_flag(parser)
    _add_hf_output_flags(parser)


def _import_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hf", type=Path, required=True, help="input HF checkpoint directory")
    parser.add_argument("--megatron", type=Path, required=True, help="output Megatron checkpoint directory")
    add_layout_flags(parser)
    add_overwrite_flag(parser, replaces="a checkpoint in an existing output directory")
    add_progress_flags(parser)
    add_remote_code_flag(parser)
    add_timeout_flag(parser)


def _export_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--megatron",
        type=Path,
        required=True,
        help="input Megatron checkpoint directory: from `import`, or a training run's (Megatron-Bridge's checkpoint.save "
        "or one of its iter_* directories, torch_dist; needs --hf)",
    )
    parser.add_argument(
        "--hf",
        type=Path,
        default=None,
        help="for a training run's checkpoint: the HF checkpoint the run started from (its config.json, tensor names, "
        "dtypes and tokenizer files are used; its weights are not read)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output HF checkpoint directory")
    _add_hf_output_flags(parser)


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf",
        type=Path,
        required=True,
        help="HF checkpoint directory (only config.json and the tensor index are read, no weights)",
    )
    add_layout_flags(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the plan as JSON to this file")
    add_fp8_flags(parser)
    add_remote_code_flag(parser)
    add_timeout_flag(parser)


def _verify_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, help="first checkpoint directory (e.g. the source)")
    parser.add_argument("b", type=Path, help="second checkpoint directory (e.g. the round trip)")
    _add_json_flag(
        parser,
        "command, ok, exit_code, a and b (path, tensors), exact (true: the same names, shapes, dtypes and bytes), "
        "differences (one line each), seconds",
    )


def _add_json_flag(parser: argparse.ArgumentParser, fields: str) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help=f"print one JSON object on stdout as the command ends (the log, and anything else printed, goes to "
        f"stderr): {fields}; a failure: command, ok false, exit_code, error",
    )


def _add_hf_output_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the commands that export into an HF checkpoint (roundtrip, export)."""
    add_layout_flags(parser)
    add_overwrite_flag(parser)
    parser.add_argument(
        "--max-shard-bytes",
        type=positive_int,
        default=None,  # the writer's DEFAULT_MAX_SHARD_BYTES (sinks imports torch: not for --help)
        help=f"output shard size in bytes, > 0 (default: {SHARD_BYTES_HELP})",
    )
    add_progress_flags(parser)
    _add_json_flag(
        parser,
        "command, ok, exit_code, source, out, layout, world_size, fp8, tensors, bytes (of the tensors), "
        "files (what --out holds), seconds (load, export_write, total: after the imports); check the output against the source with "
        "`verify --json`",
    )
    add_fp8_flags(parser)
    add_remote_code_flag(parser)
    add_timeout_flag(parser)


FLAGS = {
    "make-tiny": _make_tiny_flags,
    "roundtrip": _roundtrip_flags,
    "import": _import_flags,
    "export": _export_flags,
    "plan": _plan_flags,
    "verify": _verify_flags,
}
