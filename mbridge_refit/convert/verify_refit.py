"""``verify-refit``: export a Megatron model into a fresh ``transformers`` model and check it.

Builds the trainer model from an HF checkpoint (``--hf``), a tiny recipe (``--recipe``, random
checkpoint) or a full-size shape (``--shape``, Megatron's random initialisation on the GPU),
exports it into a fresh ``transformers`` model through ``HFModelUpdateSink`` and answers two
questions (``convert.refit_verifier``): are the engine's weights the trainer's (every tensor against
Megatron-Bridge's own export, bit for bit), and how far are the two forwards' per-token
log-probabilities on a fixed random token batch (within ``--tolerance``, by default derived from
the dtype's eps and the engine's own eager-vs-default attention spread). Exit 0 when both pass,
1 when either fails (the message says which), 2 bad input, 3 internal error, 4 environment
(exit_codes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbridge_refit.convert.exit_codes import BadInput, ExitCode
from mbridge_refit.convert.flags import add_device_flag, add_timeout_flag, device_from_flag, timeout_from_flag
from mbridge_refit.convert.inputs import check_config_numbers, check_provider, check_tied_output, supported_config
from mbridge_refit.convert.tolerance import EPS_FACTOR, NOISE_FACTOR
from mbridge_refit.plan.layout import LayoutError, ParallelLayout

if TYPE_CHECKING:  # torch and the verifier are imported when the command runs, not for its --help
    import torch

    from mbridge_refit.convert.refit_verifier import RefitVerdict

__all__ = ["VerifyArgs", "add_verify_refit_parser", "cmd_verify_refit", "run", "verify_options"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyArgs:
    source: str  # "hf" | "recipe" | "shape"
    name: str
    layout: ParallelLayout
    device: torch.device
    batch: int
    seq: int
    tolerance: float | None
    perturb: str | None
    dtype: torch.dtype
    fp32_logits: bool
    json: Path | None
    timeout: datetime.timedelta


def add_verify_refit_parser(sub: Any) -> None:
    """Add the ``verify-refit`` subcommand to the convert parser's subparsers."""
    parser = sub.add_parser(
        "verify-refit",
        help="export a Megatron model into a transformers model: its weights bit for bit, its log-probabilities",
        description="Export a Megatron model into a transformers model (in-place update sink); check every tensor "
        "against Megatron-Bridge's own export bit for bit, and compare per-token log-probabilities of both "
        "models on a fixed token batch.",
        epilog="examples:\n"
        "  python -m mbridge_refit.convert verify-refit --recipe qwen3-tiny --device cpu\n"
        "  torchrun --nproc-per-node 2 -m mbridge_refit.convert verify-refit --shape qwen3-1.7b --tp 2\n"
        "  python -m mbridge_refit.convert verify-refit --recipe qwen3-tiny --perturb "
        "model.layers.0.self_attn.o_proj.weight   # must fail\n"
        "exit codes: 0 weights exact and log-probabilities within tolerance, 1 mismatch, 2 bad input, 3 failure, 4 environment (disk, permissions)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", type=Path, help="HF checkpoint directory to load into the trainer model")
    source.add_argument("--recipe", help="built-in tiny recipe (a random checkpoint is made in a temp dir)")
    source.add_argument("--shape", help="full-size shape from recipes/shapes (GPU: Megatron's random init)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default: 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE only (default: 1)")
    add_device_flag(parser)
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="parameter and compute dtype of both models (default: %(default)s; float32 separates refit errors "
        "from bf16 kernel noise)",
    )
    parser.add_argument(
        "--model-dtype-logits",
        action="store_true",
        help="compare the models' own logits (bf16 with --dtype bfloat16) instead of projecting the final hidden "
        "states in fp32 on both sides",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences in the token batch (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help=f"max mean |d logprob| between the two forwards (default: derived, the larger of {EPS_FACTOR:g} x the "
        f"dtype's eps and {NOISE_FACTOR:g} x the engine's own eager-vs-default attention difference)",
    )
    parser.add_argument(
        "--perturb", default=None, metavar="HF_NAME", help="corrupt this tensor on its way to the engine"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the comparison as JSON here")
    add_timeout_flag(parser)


def verify_options(args: argparse.Namespace) -> VerifyArgs:
    """The parsed ``verify-refit`` flags, checked (``VerifyInputError`` names the fix)."""
    import torch

    from mbridge_refit.convert.refit_verifier import VerifyInputError
    from mbridge_refit.convert.session import LaunchEnv

    if args.tolerance is not None and not args.tolerance >= 0:
        raise VerifyInputError(f"--tolerance must be a number >= 0, got {args.tolerance}")
    if args.batch < 1 or args.seq < 2:
        raise VerifyInputError(f"--batch must be >= 1 and --seq >= 2, got {args.batch} and {args.seq}")
    if args.json is not None and not args.json.parent.is_dir():
        raise VerifyInputError(f"directory {args.json.parent} for --json does not exist")
    if args.hf is not None and not (args.hf / "config.json").is_file():
        raise VerifyInputError(f"--hf {args.hf}: no config.json there; pass an HF checkpoint directory")
    config = _checked_hf_source(args.hf) if args.hf is not None else None
    device = device_from_flag(args)
    if args.shape is not None and device.type != "cuda":
        raise VerifyInputError("--shape uses Megatron's GPU initialisation: run it on a GPU, or use --recipe on CPU")
    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    try:
        layout.validate_world_size(LaunchEnv.from_environ().world_size)
    except LayoutError as err:
        raise VerifyInputError(f"--tp {args.tp} --ep {args.ep}: {err}") from err
    if config is not None:
        check_provider(config, layout)
        check_tied_output(args.hf)  # the loader's own check would come after the process group and the build
    source, name = next(
        (k, str(v)) for k, v in (("hf", args.hf), ("recipe", args.recipe), ("shape", args.shape)) if v is not None
    )
    return VerifyArgs(
        source=source,
        name=name,
        layout=layout,
        device=device,
        batch=args.batch,
        seq=args.seq,
        tolerance=args.tolerance,
        perturb=args.perturb,
        dtype=getattr(torch, args.dtype),
        json=args.json,
        fp32_logits=not args.model_dtype_logits,
        timeout=timeout_from_flag(args),
    )


def _checked_hf_source(path: Path) -> Any:
    """The config of the HF checkpoint ``path``, its files and sizes checked as ``roundtrip`` checks them."""
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.convert.refit_verifier import VerifyInputError

    try:
        HFCheckpoint.open(path).validate()
    except FileNotFoundError as err:
        raise VerifyInputError(str(err)) from err
    config = supported_config(path)
    check_config_numbers(config)
    return config


def cmd_verify_refit(args: argparse.Namespace) -> int:
    """Exit code 0 when both checks pass, 1 (``RefitMismatch``) when one fails, 2 (``VerifyInputError``) bad input."""
    from mbridge_refit.convert.refit_verifier import RefitMismatch, VerifyInputError

    try:
        return run(verify_options(args))
    except VerifyInputError as err:
        raise BadInput(str(err)) from err
    except RefitMismatch as err:
        logger.error("%s", err)
        return ExitCode.DIFFERENCES


def run(options: VerifyArgs) -> int:
    """The CLI's job on this rank (every rank of the launch)."""
    import torch

    from mbridge_refit.convert.session import distributed_session

    with distributed_session(options.layout, device=options.device, timeout=options.timeout) as env:
        device = torch.device("cuda", torch.cuda.current_device()) if options.device.type == "cuda" else options.device
        checkpoint = _source_checkpoint(options, env.rank)
        try:
            verdict = _verify(options, checkpoint, env.rank, device)
        finally:
            if options.source == "recipe":
                _remove_scratch(checkpoint.parent, env.rank)
    verdict.check()  # RefitMismatch names the failed question
    return ExitCode.OK


def _verify(options: VerifyArgs, checkpoint: Path | None, rank: int, device: torch.device) -> RefitVerdict:
    from transformers import AutoModelForCausalLM

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import HFCheckpoint
    from mbridge_refit.convert.preflight import build_checked, check_hf_source
    from mbridge_refit.convert.refit_verifier import VerifyInputError, fixed_tokens, hf_config, verify_refit
    from mbridge_refit.models.builder import BuildOptions, build_model

    if checkpoint is not None:
        bridge = RefitBridge.from_hf_pretrained(checkpoint)
    else:
        from mbridge_refit.models.recipes import full_size_config

        bridge = RefitBridge.from_hf_config(full_size_config(options.name))
    config = hf_config(bridge)
    _check_layout(options.layout, config)
    if options.device.type == "cpu" and _model_shape(config).num_experts:
        raise VerifyInputError(
            "the CPU forward covers dense models only (Megatron's MoE router and dispatch need CUDA): "
            "verify mixture-of-experts models on a GPU"
        )
    build = BuildOptions(device=options.device, params_dtype=options.dtype)
    if checkpoint is not None:
        source = HFCheckpoint.open(checkpoint)
        chunks = build_checked(bridge, options.layout, build, lambda meta: check_hf_source(bridge, meta, source))
        bridge.load_hf_shards(chunks, checkpoint)
    else:
        chunks = build_model(bridge, options.layout, build)
    hf_model = None
    if rank == 0:
        with device:
            hf_model = AutoModelForCausalLM.from_config(config, dtype=options.dtype).eval()
    tokens = fixed_tokens(config.vocab_size, options.batch, options.seq, device)
    verdict = verify_refit(
        bridge,
        chunks,
        hf_model,
        tokens,
        tolerance=options.tolerance,
        perturb=options.perturb,
        fp32_logits=options.fp32_logits,
        check=False,
    )
    if rank == 0:
        _report(options, verdict)
    return verdict


def _source_checkpoint(options: VerifyArgs, rank: int) -> Path | None:
    """The HF checkpoint to load (for a recipe, a random one rank 0 writes to a temp dir), or None for a shape."""
    import torch.distributed as dist

    if options.source == "hf":
        return Path(options.name)
    if options.source == "shape":
        return None
    from mbridge_refit.models import recipes

    scratch = [tempfile.mkdtemp(prefix="verify_refit_") if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(scratch, src=0)
    path = Path(scratch[0]) / "checkpoint"
    if rank == 0:
        recipes.make_random_checkpoint(recipes.get_model_recipe(options.name), path, seed=0)
    dist.barrier()
    return path


def _remove_scratch(scratch: Path, rank: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def _model_shape(config: Any):
    from mbridge_refit.plan.layout import ModelShape

    return ModelShape.from_hf_config(config)


def _check_layout(layout: ParallelLayout, config: Any) -> None:
    from mbridge_refit.convert.refit_verifier import VerifyInputError

    try:
        layout.validate_model(_model_shape(config))
    except LayoutError as err:
        raise VerifyInputError(f"layout {layout.name}: {err}") from err


def _report(options: VerifyArgs, verdict: RefitVerdict) -> None:
    import torch

    result, weights, engine_noise = verdict.numerics, verdict.weights, verdict.engine_noise
    logger.info(
        "%s %s %s %s%s",
        "PASS" if verdict.passed else "FAIL",
        options.source,
        options.name,
        options.layout.name,
        f", perturbed {options.perturb}" if options.perturb else "",
    )
    logger.info(
        "weights: %s: %d tensors compared bit for bit with %s%s",
        "exact" if weights.exact else "DIFFERENT",
        weights.compared,
        weights.against,
        f", differing: {list(weights.differing[:8])}" if weights.differing else "",
    )
    logger.info(
        "numerics: %d tokens, mean |d logprob| %.3e, max %.3e, mult prob error %.6f: %s tolerance %.3e (%s)",
        result.tokens,
        result.mean_abs_diff,
        result.max_abs_diff,
        result.mult_prob_error,
        "within" if verdict.numerics_within else "BEYOND",
        verdict.tolerance,
        verdict.tolerance_from,
    )
    if engine_noise is not None:
        logger.info(
            "for scale: the engine model against itself with eager attention (same weights): mean |d logprob| %.3e, max %.3e",
            engine_noise.mean_abs_diff,
            engine_noise.max_abs_diff,
        )
    if options.json is not None:
        payload = {
            "source": options.source,
            "model": options.name,
            "layout": options.layout.name,
            "device": torch.cuda.get_device_name() if options.device.type == "cuda" else "cpu",
            "dtype": str(options.dtype).removeprefix("torch."),
            "batch": options.batch,
            "seq": options.seq,
            "tolerance": verdict.tolerance,
            "tolerance_from": verdict.tolerance_from,
            "perturb": options.perturb,
            "logits": "fp32 projection" if options.fp32_logits else "model dtype",
            "passed": verdict.passed,
            "weights": {**asdict(weights), "exact": weights.exact},
            "numerics_within_tolerance": verdict.numerics_within,
            **asdict(result),
            "engine_eager_vs_default_attention": asdict(engine_noise) if engine_noise is not None else None,
        }
        options.json.write_text(json.dumps(payload, indent=1) + "\n")
