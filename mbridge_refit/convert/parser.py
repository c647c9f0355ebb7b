"""The argument parser of ``python -m mbridge_refit.convert``: subcommands, flags and help."""

from __future__ import annotations

import argparse
from pathlib import Path

from mbridge_refit.convert.flags import add_device_flag, add_fp8_flags, add_layout_flags, add_timeout_flag
from mbridge_refit.convert.verify_refit import add_verify_refit_parser

EPILOG = """\
examples:
  # a tiny random Qwen3 checkpoint from a built-in recipe (no downloads)
  python -m mbridge_refit.convert make-tiny --recipe qwen3-tiny --out /tmp/qwen3-tiny

  # HF -> Megatron (TP2 x PP2 on 4 CPU ranks) -> HF, then check the result bit for bit
  torchrun --nproc-per-node 4 -m mbridge_refit.convert roundtrip \\
      --hf /tmp/qwen3-tiny --out /tmp/qwen3-tiny-rt --tp 2 --pp 2
  python -m mbridge_refit.convert verify /tmp/qwen3-tiny /tmp/qwen3-tiny-rt

  # MoE with expert parallelism
  torchrun --nproc-per-node 2 -m mbridge_refit.convert roundtrip --hf MOE --out OUT --ep 2

  # HF -> Megatron checkpoint on disk (TP2 on 2 CPU ranks), then back to HF at another layout
  torchrun --nproc-per-node 2 -m mbridge_refit.convert import \\
      --hf /tmp/qwen3-tiny --megatron /tmp/qwen3-tiny-mcore --tp 2
  torchrun --nproc-per-node 2 -m mbridge_refit.convert export \\
      --megatron /tmp/qwen3-tiny-mcore --out /tmp/qwen3-tiny-hf --pp 2

  # an HF FP8 checkpoint (128x128 blockwise e4m3 + weight_scale_inv) from a bf16 one
  torchrun --nproc-per-node 2 -m mbridge_refit.convert roundtrip \\
      --hf /tmp/qwen3-tiny --out /tmp/qwen3-tiny-fp8 --tp 2 --fp8-blockwise

  # does a transformers model updated in place from the export compute what Megatron computes?
  python -m mbridge_refit.convert verify-refit --recipe qwen3-tiny --device cpu

  # what an export will yield, where each tensor lives (no weights are read)
  torchrun --nproc-per-node 2 -m mbridge_refit.convert plan --hf /tmp/qwen3-tiny --pp 2 --json plan.json

exit codes: 0 ok, 1 differences found (verify, verify-refit), 2 bad input (the message names the fix),
            3 internal error (traceback logged)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mbridge_refit.convert",
        description="Convert Hugging Face checkpoints through Megatron-Core parallel layouts, exactly.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser(
        "make-tiny", help="write a tiny random HF checkpoint from a built-in recipe", allow_abbrev=False
    )
    tiny.add_argument("--recipe", default=None, help="recipe name (default: %(default)s → qwen3-tiny); see --list")
    tiny.add_argument("--out", type=Path, help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    tiny.add_argument("--max-shard-bytes", type=int, default=None, help="shard size; small values force sharding")
    tiny.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    tiny.add_argument("--list", action="store_true", help="list recipes and layouts, then exit")

    rt = sub.add_parser(
        "roundtrip",
        help="load HF weights into a Megatron layout and export them back to HF",
        description="Load --hf into a Megatron model split as --tp/--pp/--vpp/--ep across the launched "
        "ranks (any multiple of tp*pp*cp: the rest are data-parallel replicas), export it back with RefitBridge and write --out.",
        allow_abbrev=False,
    )
    rt.add_argument("--hf", type=Path, required=True, help="input HF checkpoint directory")
    rt.add_argument("--out", type=Path, required=True, help="output HF checkpoint directory")
    add_layout_flags(rt)
    add_device_flag(rt)
    rt.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    rt.add_argument(
        "--max-shard-bytes", type=int, default=5 * 1024**3, help="output shard size (default: %(default)s)"
    )
    rt.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_fp8_flags(rt)
    add_timeout_flag(rt)

    imp = sub.add_parser(
        "import",
        help="HF checkpoint -> Megatron checkpoint (Megatron-Core dist_checkpointing, torch_dist)",
        description="Load --hf into a Megatron model split as --tp/--pp/--vpp/--ep across the launched ranks "
        "(any multiple of tp*pp*cp) and save it with Megatron-Core's dist_checkpointing to --megatron. "
        "The HF config.json and tokenizer files are stored next to the weights, so `export` needs nothing else. "
        "The saved checkpoint loads at any layout that fits the model.",
        allow_abbrev=False,
    )
    imp.add_argument("--hf", type=Path, required=True, help="input HF checkpoint directory")
    imp.add_argument("--megatron", type=Path, required=True, help="output Megatron checkpoint directory")
    add_layout_flags(imp)
    imp.add_argument("--overwrite", action="store_true", help="replace a checkpoint in an existing output directory")
    add_timeout_flag(imp)

    exp = sub.add_parser(
        "export",
        help="Megatron checkpoint (written by `import`) -> HF checkpoint, at any layout",
        description="Load the Megatron checkpoint --megatron into a model split as --tp/--pp/--vpp/--ep (which may "
        "differ from the layout it was saved with), export it with RefitBridge and write --out. The HF config "
        "and tokenizer files come from the checkpoint directory (stored there by `import`); each tensor gets the "
        "dtype it had in the original HF checkpoint.",
        allow_abbrev=False,
    )
    exp.add_argument("--megatron", type=Path, required=True, help="input Megatron checkpoint directory (from `import`)")
    exp.add_argument("--out", type=Path, required=True, help="output HF checkpoint directory")
    add_layout_flags(exp)
    exp.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    exp.add_argument(
        "--max-shard-bytes", type=int, default=5 * 1024**3, help="output shard size (default: %(default)s)"
    )
    exp.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_fp8_flags(exp)
    add_timeout_flag(exp)

    plan = sub.add_parser(
        "plan",
        help="print (and optionally save) the export plan of a checkpoint for a layout",
        description="Build the model on the meta device (no weights are read), compute RefitBridge's export plan "
        "and print one line per HF tensor: name, shape, dtype, bytes, pipeline stage, source mesh and placements. "
        "Run it with as many ranks as the layout needs.",
        allow_abbrev=False,
    )
    plan.add_argument("--hf", type=Path, required=True, help="HF checkpoint directory (only config.json and the tensor index are read, no weights)")
    add_layout_flags(plan)
    plan.add_argument("--json", type=Path, default=None, help="also write the plan as JSON to this file")
    add_fp8_flags(plan)
    add_timeout_flag(plan)

    verify = sub.add_parser(
        "verify",
        help="compare two HF checkpoints tensor by tensor (names, shapes, dtypes, bytes)",
        description="Exit 0 only when both checkpoints hold the same names with equal shapes, dtypes and bytes.",
        allow_abbrev=False,
    )
    verify.add_argument("a", type=Path, help="first checkpoint directory (e.g. the source)")
    verify.add_argument("b", type=Path, help="second checkpoint directory (e.g. the round trip)")

    add_verify_refit_parser(sub)
    return parser
