"""``python -m mbridge_refit.convert``: HF checkpoint conversion through Megatron layouts.

Subcommands: ``make-tiny`` (random test checkpoints), ``roundtrip`` (HF -> Megatron -> HF in
memory), ``import`` / ``export`` (HF <-> a Megatron checkpoint on disk, see
``megatron_checkpoint``), ``plan`` (what an export yields) and ``verify`` (compare two HF
checkpoints).

Runs as one process (``python -m``) or as N ranks (``torchrun --nproc-per-node N -m ...``).
Every check of the input (paths, architecture, layout against model and world size) runs on
every rank before the first collective, so bad input ends all ranks with the same message and
exit code instead of a hang.

Exit codes: 0 success, 1 ``verify`` found differences, 2 bad input (message says the fix),
3 failure while running.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

from mbridge_refit.plan.layout import ParallelLayout

if TYPE_CHECKING:
    from mbridge_refit.fp8.format import BlockwiseFP8Config

EXIT_OK, EXIT_DIFFERENT, EXIT_BAD_INPUT, EXIT_FAILED = 0, 1, 2, 3

logger = logging.getLogger("mbridge_refit.convert")

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
  torchrun --nproc-per-node 2 -m mbridge_refit.convert import \
      --hf /tmp/qwen3-tiny --megatron /tmp/qwen3-tiny-mcore --tp 2
  torchrun --nproc-per-node 2 -m mbridge_refit.convert export \
      --megatron /tmp/qwen3-tiny-mcore --out /tmp/qwen3-tiny-hf --pp 2

  # an HF FP8 checkpoint (128x128 blockwise e4m3 + weight_scale_inv) from a bf16 one
  torchrun --nproc-per-node 2 -m mbridge_refit.convert roundtrip \
      --hf /tmp/qwen3-tiny --out /tmp/qwen3-tiny-fp8 --tp 2 --fp8-blockwise

  # what an export will yield, where each tensor lives (no weights are read)
  torchrun --nproc-per-node 2 -m mbridge_refit.convert plan --hf /tmp/qwen3-tiny --pp 2 --json plan.json

exit codes: 0 ok, 1 verify found differences, 2 bad input, 3 failure while running
"""


class BadInput(Exception):
    """User input that cannot work; the message names the problem and the fix."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundtripArgs:
    hf: Path
    out: Path
    layout: ParallelLayout
    device: str
    overwrite: bool
    max_shard_bytes: int
    show_progress: bool
    timeout: datetime.timedelta
    fp8: "BlockwiseFP8Config | None" = None


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
        "ranks (world size must equal tp*pp*dp), export it back with RefitBridge and write --out.",
        allow_abbrev=False,
    )
    rt.add_argument("--hf", type=Path, required=True, help="input HF checkpoint directory")
    rt.add_argument("--out", type=Path, required=True, help="output HF checkpoint directory")
    _add_layout_flags(rt)
    rt.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if present")
    rt.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    rt.add_argument(
        "--max-shard-bytes", type=int, default=5 * 1024**3, help="output shard size (default: %(default)s)"
    )
    rt.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_fp8_flags(rt)
    rt.add_argument(
        "--timeout-s", type=float, default=600.0, help="collective timeout per operation (default: %(default)s)"
    )

    imp = sub.add_parser(
        "import",
        help="HF checkpoint -> Megatron checkpoint (Megatron-Core dist_checkpointing, torch_dist)",
        description="Load --hf into a Megatron model split as --tp/--pp/--vpp/--ep across the launched ranks "
        "(world size must equal tp*pp*dp) and save it with Megatron-Core's dist_checkpointing to --megatron. "
        "The HF config.json and tokenizer files are stored next to the weights, so `export` needs nothing else. "
        "The saved checkpoint loads at any layout that fits the model.",
        allow_abbrev=False,
    )
    imp.add_argument("--hf", type=Path, required=True, help="input HF checkpoint directory")
    imp.add_argument("--megatron", type=Path, required=True, help="output Megatron checkpoint directory")
    _add_layout_flags(imp)
    imp.add_argument("--overwrite", action="store_true", help="replace a checkpoint in an existing output directory")
    imp.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout (default: %(default)s)")

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
    _add_layout_flags(exp)
    exp.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    exp.add_argument(
        "--max-shard-bytes", type=int, default=5 * 1024**3, help="output shard size (default: %(default)s)"
    )
    exp.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    _add_fp8_flags(exp)
    exp.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout (default: %(default)s)")

    plan = sub.add_parser(
        "plan",
        help="print (and optionally save) the export plan of a checkpoint for a layout",
        description="Build the model on the meta device (no weights are read), compute RefitBridge's export plan "
        "and print one line per HF tensor: name, shape, dtype, bytes, pipeline stage, source mesh and placements. "
        "Run it with as many ranks as the layout needs.",
        allow_abbrev=False,
    )
    plan.add_argument("--hf", type=Path, required=True, help="HF checkpoint directory (only config.json and the tensor index are read, no weights)")
    _add_layout_flags(plan)
    plan.add_argument("--json", type=Path, default=None, help="also write the plan as JSON to this file")
    _add_fp8_flags(plan)
    plan.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout (default: %(default)s)")

    verify = sub.add_parser(
        "verify",
        help="compare two HF checkpoints tensor by tensor (names, shapes, dtypes, bytes)",
        description="Exit 0 only when both checkpoints hold the same names with equal shapes, dtypes and bytes.",
        allow_abbrev=False,
    )
    verify.add_argument("a", type=Path, help="first checkpoint directory (e.g. the source)")
    verify.add_argument("b", type=Path, help="second checkpoint directory (e.g. the round trip)")
    return parser


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel layout")
    group.add_argument("--tp", type=int, default=1, help="tensor parallel size (default: 1)")
    group.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default: 1)")
    group.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per PP rank")
    group.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE only (default: 1)")
    group.add_argument("--first-stage-layers", type=int, default=None, help="layers on the first PP stage (uneven split)")
    group.add_argument("--last-stage-layers", type=int, default=None, help="layers on the last PP stage (uneven split)")


def _add_fp8_flags(parser: argparse.ArgumentParser) -> None:
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
        help="fnmatch pattern of HF names kept in their dtype (repeatable; replaces the defaults: "
        "embeddings, output layer, norms, MoE routers)",
    )
    group.add_argument(
        "--fp8-engine-tp",
        type=int,
        default=None,
        metavar="N",
        help="fail unless an engine at tensor-parallel size N can shard every FP8 weight on block boundaries",
    )


def _fp8_option(args: argparse.Namespace) -> "BlockwiseFP8Config | None":
    from mbridge_refit.fp8.format import DEFAULT_KEEP_PATTERNS, BlockwiseFP8Config

    if not args.fp8_blockwise:
        if args.fp8_keep or args.fp8_engine_tp is not None:
            raise BadInput("--fp8-keep and --fp8-engine-tp need --fp8-blockwise")
        return None
    if args.fp8_engine_tp is not None and args.fp8_engine_tp < 1:
        raise BadInput(f"--fp8-engine-tp must be >= 1, got {args.fp8_engine_tp}")
    keep = tuple(args.fp8_keep) if args.fp8_keep else DEFAULT_KEEP_PATTERNS
    return BlockwiseFP8Config(keep_patterns=keep, engine_tp_size=args.fp8_engine_tp)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    handlers = {
        "make-tiny": cmd_make_tiny,
        "roundtrip": cmd_roundtrip,
        "import": cmd_import,
        "export": cmd_export,
        "plan": cmd_plan,
        "verify": cmd_verify,
    }
    try:
        return handlers[args.command](args)
    except BadInput as err:
        logger.error("%s", err)
        return EXIT_BAD_INPUT


def _configure_logging(verbose: bool) -> None:
    from mbridge_refit.tools.launch import LaunchEnv

    rank = LaunchEnv.from_environ().rank
    level = logging.DEBUG if verbose else (logging.INFO if rank == 0 else logging.WARNING)
    logging.basicConfig(level=level, format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("megatron", "megatron.core", "megatron.bridge", "transformers"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


# --- make-tiny ---------------------------------------------------------------------------------


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from mbridge_refit.tools import recipes

    if args.list:
        for name, recipe in recipes.MODEL_RECIPES.items():
            print(f"model   {name:20s} {recipe.description}")
        for name, layout in recipes.LAYOUTS.items():
            print(f"layout  {name:20s} world size {layout.expected_world_size}")
        return EXIT_OK
    if args.out is None:
        raise BadInput("make-tiny needs --out DIR")
    try:
        recipe = recipes.get_model_recipe(args.recipe or recipes.DEFAULT_MODEL)
    except (KeyError, ValueError) as err:
        raise BadInput(str(err)) from err
    _check_output_dir(args.out, args.overwrite)
    path = recipes.make_random_checkpoint(
        recipe, args.out, seed=args.seed, max_shard_bytes=args.max_shard_bytes, overwrite=args.overwrite
    )
    logger.info("wrote %s checkpoint to %s", recipe.name, path)
    return EXIT_OK


# --- verify ------------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from mbridge_refit.checkpoint import compare_checkpoints

    for path in (args.a, args.b):
        if not path.is_dir():
            raise BadInput(f"checkpoint directory {path} does not exist")
    try:
        differences = compare_checkpoints(args.a, args.b)
    except FileNotFoundError as err:
        raise BadInput(str(err)) from err
    if differences:
        print(f"{len(differences)} difference(s) between {args.a} and {args.b}:")
        for line in differences:
            print(f"  {line}")
        return EXIT_DIFFERENT
    print(f"identical: {args.a} and {args.b} (names, shapes, dtypes and bytes)")
    return EXIT_OK


# --- roundtrip ---------------------------------------------------------------------------------


def cmd_roundtrip(args: argparse.Namespace) -> int:
    options = _validate_roundtrip(args)
    return run_roundtrip(options)


def _validate_input_and_layout(args: argparse.Namespace) -> ParallelLayout:
    """Checks of --hf and the layout flags that need no process group (same verdict on every rank)."""
    from mbridge_refit.checkpoint import HFCheckpoint

    if not args.hf.is_dir():
        raise BadInput(f"input checkpoint directory {args.hf} does not exist (--hf)")
    if not (args.hf / "config.json").is_file():
        raise BadInput(f"{args.hf} has no config.json: --hf must be a Hugging Face checkpoint directory")
    try:
        HFCheckpoint.open(args.hf)
    except FileNotFoundError as err:
        raise BadInput(str(err)) from err
    return _validate_layout(args, _load_supported_config(args.hf))


def _validate_layout(args: argparse.Namespace, config) -> ParallelLayout:
    """The layout flags against the model (HF ``config``) and the launched world size."""
    from mbridge_refit.tools.launch import LaunchEnv
    from mbridge_refit.plan.layout import LayoutError, ModelShape

    flags = f"tp={args.tp} pp={args.pp} vpp={args.vpp} ep={args.ep}"
    try:
        layout = ParallelLayout(
            tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
            first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers,
        )
        layout.validate_model(ModelShape.from_hf_config(config))
        layout.validate_world_size(LaunchEnv.from_environ().world_size)
    except LayoutError as err:
        raise BadInput(f"layout {flags}: {err}") from err
    return layout


def _validate_roundtrip(args: argparse.Namespace) -> RoundtripArgs:
    """Every check that needs no process group: same inputs, same verdict on every rank."""
    layout = _validate_input_and_layout(args)
    if args.out.resolve() == args.hf.resolve():
        raise BadInput("--out must differ from --hf")
    _check_output_dir(args.out, args.overwrite)
    return RoundtripArgs(
        hf=args.hf,
        out=args.out,
        layout=layout,
        device=args.device,
        overwrite=args.overwrite,
        max_shard_bytes=args.max_shard_bytes,
        show_progress=not args.no_progress,
        timeout=datetime.timedelta(seconds=args.timeout_s),
        fp8=_fp8_option(args),
    )


def _check_output_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise BadInput(f"output directory {out} exists and is not empty: pass --overwrite to replace it")


def _load_supported_config(hf: Path):
    from transformers import AutoConfig

    from mbridge_refit.bridge import RefitBridge

    try:
        config = AutoConfig.from_pretrained(hf)
    except (ValueError, KeyError, OSError) as err:
        raise BadInput(f"cannot read {hf}/config.json: {err}") from err
    try:
        RefitBridge._validate_config(config, str(hf))
    except ValueError as err:
        architectures = getattr(config, "architectures", None)
        supported = ", ".join(sorted(RefitBridge.list_supported_models()))
        raise BadInput(
            f"unsupported architecture {architectures} in {hf}/config.json: Megatron-Bridge has no bridge for it. "
            f"Supported: {supported}"
        ) from err
    return config


def run_roundtrip(options: RoundtripArgs) -> int:
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoint import HFCheckpoint
    from mbridge_refit.tools.launch import default_device, distributed_session
    from mbridge_refit.tools.model_builder import BuildOptions, build_model
    from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

    device = default_device() if options.device == "auto" else torch.device(options.device)
    checkpoint = HFCheckpoint.open(options.hf)
    with distributed_session(options.layout, device=device, timeout=options.timeout) as env:
        bridge = RefitBridge.from_hf_pretrained(options.hf)
        chunks = build_model(
            bridge, options.layout, BuildOptions(device=device, params_dtype=checkpoint_float_dtype(checkpoint))
        )
        report = bridge.load_hf_shards(chunks, options.hf)
        logger.info("loaded %d slices (%.1f MB on this rank)", report.tensors_written, report.bytes_read / 1e6)
        dtypes, config_overrides = _output_dtypes(
            bridge, chunks, {name: checkpoint.dtype(name) for name in checkpoint.names()}, options.fp8
        )
        sink = ShardedSafetensorsWriter(
            out_dir=options.out,
            max_shard_bytes=options.max_shard_bytes,
            overwrite=options.overwrite,
            copy_files_from=options.hf,
            config_overrides=config_overrides,
        )
        stream = bridge.export_hf_weights(
            chunks, show_progress=options.show_progress and env.rank == 0, fp8=options.fp8
        )
        count = drain(cast_to_dtypes(stream, dtypes), sink)
    logger.info("wrote %d tensors to %s (layout %s)", count, options.out, options.layout.name)
    return EXIT_OK


# --- import / export ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ImportArgs:
    hf: Path
    megatron: Path
    layout: ParallelLayout
    overwrite: bool
    timeout: datetime.timedelta


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportArgs:
    megatron: Path
    out: Path
    layout: ParallelLayout
    overwrite: bool
    max_shard_bytes: int
    show_progress: bool
    timeout: datetime.timedelta
    fp8: "BlockwiseFP8Config | None" = None


def cmd_import(args: argparse.Namespace) -> int:
    layout = _validate_input_and_layout(args)
    _check_distinct_dirs(args.hf, "--hf", args.megatron, "--megatron")
    _check_output_dir(args.megatron, args.overwrite)
    return run_import(
        ImportArgs(
            hf=args.hf, megatron=args.megatron, layout=layout, overwrite=args.overwrite,
            timeout=datetime.timedelta(seconds=args.timeout_s),
        )
    )


def cmd_export(args: argparse.Namespace) -> int:
    from mbridge_refit.megatron_checkpoint import CheckpointInfo, NotAMegatronCheckpoint

    if not args.megatron.is_dir():
        raise BadInput(f"input checkpoint directory {args.megatron} does not exist (--megatron)")
    try:
        CheckpointInfo.read(args.megatron)
    except NotAMegatronCheckpoint as err:
        raise BadInput(f"--megatron {args.megatron}: {err}") from err
    layout = _validate_layout(args, _load_supported_config(args.megatron))
    _check_distinct_dirs(args.megatron, "--megatron", args.out, "--out")
    _check_output_dir(args.out, args.overwrite)
    return run_export(
        ExportArgs(
            megatron=args.megatron, out=args.out, layout=layout, overwrite=args.overwrite,
            max_shard_bytes=args.max_shard_bytes, show_progress=not args.no_progress,
            timeout=datetime.timedelta(seconds=args.timeout_s), fp8=_fp8_option(args),
        )
    )


def _check_distinct_dirs(source: Path, source_flag: str, out: Path, out_flag: str) -> None:
    if out.resolve() == source.resolve():
        raise BadInput(f"{out_flag} must differ from {source_flag}")


def run_import(options: ImportArgs) -> int:
    """HF -> Megatron checkpoint on CPU (gloo); every rank saves its own shards."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoint import HFCheckpoint
    from mbridge_refit.tools.launch import distributed_session
    from mbridge_refit.megatron_checkpoint import CheckpointInfo, save_model
    from mbridge_refit.tools.model_builder import BuildOptions, build_model

    cpu = torch.device("cpu")
    checkpoint = HFCheckpoint.open(options.hf)
    info = CheckpointInfo(
        saved_layout=options.layout,
        params_dtype=checkpoint_float_dtype(checkpoint),
        hf_dtypes={name: checkpoint.dtype(name) for name in checkpoint.names()},
        source=str(options.hf.resolve()),
    )
    with distributed_session(options.layout, device=cpu, timeout=options.timeout):
        bridge = RefitBridge.from_hf_pretrained(options.hf)
        chunks = build_model(bridge, options.layout, BuildOptions(device=cpu, params_dtype=info.params_dtype))
        report = bridge.load_hf_shards(chunks, options.hf)
        logger.info("loaded %d slices (%.1f MB on this rank)", report.tensors_written, report.bytes_read / 1e6)
        save_model(chunks, options.megatron, info=info, copy_files_from=options.hf, overwrite=options.overwrite)
    logger.info("wrote a Megatron checkpoint (layout %s) to %s", options.layout.name, options.megatron)
    return EXIT_OK


def run_export(options: ExportArgs) -> int:
    """Megatron checkpoint -> HF on CPU (gloo), at ``options.layout`` (may differ from the saved one)."""
    import torch

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.tools.launch import distributed_session
    from transformers import AutoConfig

    from mbridge_refit.megatron_checkpoint import CheckpointInfo, load_model, match_source_tensors
    from mbridge_refit.tools.model_builder import BuildOptions, build_model
    from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

    cpu = torch.device("cpu")
    info = CheckpointInfo.read(options.megatron)
    with distributed_session(options.layout, device=cpu, timeout=options.timeout) as env:
        # Config only: the checkpoint holds no HF weights; the names to write come from `info`.
        bridge = RefitBridge.from_hf_config(AutoConfig.from_pretrained(options.megatron))
        chunks = build_model(bridge, options.layout, BuildOptions(device=cpu, params_dtype=info.params_dtype))
        load_model(chunks, options.megatron)
        logger.info(
            "loaded %s (saved at layout %s) at layout %s",
            options.megatron, info.saved_layout.name, options.layout.name,
        )
        dtypes, config_overrides = _output_dtypes(bridge, chunks, info.hf_dtypes, options.fp8)
        sink = ShardedSafetensorsWriter(
            out_dir=options.out,
            max_shard_bytes=options.max_shard_bytes,
            overwrite=options.overwrite,
            copy_files_from=options.megatron,
            config_overrides=config_overrides,
        )
        stream = bridge.export_hf_weights(
            chunks, show_progress=options.show_progress and env.rank == 0, fp8=options.fp8
        )
        count = drain(match_source_tensors(stream, dtypes), sink)
    logger.info("wrote %d tensors to %s (layout %s)", count, options.out, options.layout.name)
    return EXIT_OK


# --- plan --------------------------------------------------------------------------------------


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from mbridge_refit.fp8.format import FP8FormatError

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoint import HFCheckpoint
    from mbridge_refit.tools.launch import distributed_session
    from mbridge_refit.tools.model_builder import BuildOptions, build_model

    layout = _validate_input_and_layout(args)
    if args.json is not None and not args.json.parent.is_dir():
        raise BadInput(f"directory {args.json.parent} for --json does not exist")
    fp8 = _fp8_option(args)
    cpu = torch.device("cpu")
    dtype = checkpoint_float_dtype(HFCheckpoint.open(args.hf))
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(seconds=args.timeout_s)) as env:
        bridge = RefitBridge.from_hf_pretrained(args.hf)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=dtype, materialize=False))
        try:
            plan = bridge.export_plan(chunks, fp8=fp8)
        except FP8FormatError as err:
            raise BadInput(f"cannot plan an FP8 export: {err}") from err
        if env.rank == 0:
            print(format_plan(plan))
            if args.json is not None:
                tmp = args.json.with_name(f".{args.json.name}.tmp")
                tmp.write_text(plan.to_json())
                tmp.replace(args.json)
                logger.info("wrote %s", args.json)
    return EXIT_OK


def format_plan(plan) -> str:
    """One line per HF tensor: name, shape, dtype, bytes, stage, source mesh, placements."""
    header = f"{'hf_name':60s} {'shape':>16s} {'dtype':>9s} {'bytes':>12s} {'pp/vpp':>6s} {'mesh':>14s}  placements"
    lines = [header]
    for e in plan.entries:
        mesh = f"{e.sharding.mesh_dims[0]}{e.sharding.mesh_shape[0]}x{e.sharding.mesh_dims[1]}{e.sharding.mesh_shape[1]}"
        owner = f" owner ep{e.sharding.owner_ep_rank}" if e.sharding.owner_ep_rank is not None and plan.ep > 1 else ""
        alias = f" (same data as {e.alias_of})" if e.alias_of else ""
        lines.append(
            f"{e.hf_name:60s} {str(list(e.shape)):>16s} {e.dtype:>9s} {e.nbytes:12d} {e.pp_rank:>4d}/{e.vpp_stage:<1d} "
            f"{mesh:>14s}  {', '.join(e.sharding.placements)}{owner}{alias}"
        )
    layers = ", ".join(f"{layer}:{pp}/{vpp}" for layer, (pp, vpp) in plan.layer_map.items())
    lines.append(f"{len(plan.entries)} tensors, {plan.total_bytes} bytes; layer -> pp/vpp: {layers}")
    return "\n".join(lines)


def checkpoint_float_dtype(checkpoint) -> "torch.dtype":
    """The dtype of most floating-point tensors in the checkpoint (used as the params dtype)."""
    from collections import Counter

    counts = Counter(checkpoint.dtype(name) for name in checkpoint.names())
    floating = [(n, d) for d, n in counts.items() if d.is_floating_point]
    if not floating:
        raise BadInput(f"checkpoint {checkpoint.path} has no floating-point tensors")
    return max(floating, key=lambda item: item[0])[1]


def cast_to_dtypes(stream: Iterable, dtypes: "Mapping[str, torch.dtype]") -> Iterator:
    """Give every exported tensor named in ``dtypes`` that dtype (a no-op when they agree)."""
    for name, tensor in stream:
        dtype = dtypes.get(name)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def _output_dtypes(
    bridge, chunks, source_dtypes: "Mapping[str, torch.dtype]", fp8: "BlockwiseFP8Config | None"
) -> tuple[dict, dict | None]:
    """(dtype of every tensor to write, config.json overrides): the source checkpoint's dtypes,
    and with ``fp8`` the FP8 weights and their scales plus the ``quantization_config``.

    Builds the export plan (collective); FP8 problems surface here, on every rank alike, before
    any tensor moves.
    """
    from mbridge_refit.fp8.format import FP8_DTYPE, FP8FormatError

    if fp8 is None:
        return dict(source_dtypes), None
    try:
        plan = bridge.export_plan(chunks, fp8=fp8)
    except FP8FormatError as err:
        raise BadInput(f"cannot write an FP8 checkpoint: {err}") from err
    scales = [e for e in plan.entries if e.scale_of is not None]
    changed = {e.hf_name: e.torch_dtype for e in plan.entries if e.scale_of is not None or e.torch_dtype == FP8_DTYPE}
    logger.info("FP8 blockwise: %d of %d tensors quantized", len(scales), len(plan.entries) - len(scales))
    return {**source_dtypes, **changed}, {"quantization_config": fp8.quantization_config(plan)}


if __name__ == "__main__":
    sys.exit(main())
