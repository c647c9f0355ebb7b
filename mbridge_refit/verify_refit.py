"""Refit verifier: after a refit, does the engine's model compute what the trainer's model computes?

Library use (e.g. after every refit in a training loop):

    ref = megatron_logprobs(chunks, tokens)          # every trainer rank (PP=1), collective over TP
    got = hf_logprobs(hf_model, tokens)              # wherever the engine-side model lives
    report = compare_logprobs(ref, got)              # mean / max |d logprob|, multiplicative error
    report.check(tolerance=1e-3)                     # raises RefitMismatch with the numbers

``verify_refit(bridge, chunks, hf_model, tokens)`` does the whole round: export through
``HFModelUpdateSink`` into ``hf_model`` on rank 0, both forwards, comparison (verdict shared by
every rank, so all ranks return or raise alike).

CLI: ``python -m mbridge_refit.verify_refit`` builds the trainer model from an HF checkpoint
(``--hf``), a tiny recipe (``--recipe``, random checkpoint) or a full-size shape (``--shape``,
Megatron's random initialisation on the GPU), exports it into a fresh ``transformers`` model and
compares per-token log-probabilities on a fixed random token batch. Exit 0 within tolerance,
1 mismatch, 2 bad input, 3 failure.

The multiplicative probability error is ``mean(exp(|logp_trainer - logp_engine|))`` over
tokens (1.0 = identical), the quantity RL frameworks track between trainer and rollout engine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from mbridge_refit.plan.layout import LayoutError, ParallelLayout

logger = logging.getLogger("mbridge_refit.verify_refit")

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_FAILED = 0, 1, 2, 3
DEFAULT_TOLERANCE = 1e-3


class RefitMismatch(AssertionError):
    """The engine-side model's log-probabilities differ from the trainer's beyond the tolerance."""


class VerifyInputError(ValueError):
    """A model or option the verifier cannot use (the message names the fix)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobComparison:
    """Per-token log-probability agreement between trainer and engine."""

    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    mult_prob_error: float  # mean(exp(|d logprob|)); 1.0 = identical

    def check(self, tolerance: float = DEFAULT_TOLERANCE) -> "LogprobComparison":
        """Raise ``RefitMismatch`` unless ``mean_abs_diff <= tolerance``; return self."""
        if not self.mean_abs_diff <= tolerance:  # NaN fails too
            raise RefitMismatch(
                f"refit mismatch: mean |d logprob| {self.mean_abs_diff:.3e} > tolerance {tolerance:.1e} "
                f"(max {self.max_abs_diff:.3e}, mult prob error {self.mult_prob_error:.5f}, {self.tokens} tokens): "
                "the engine's weights do not reproduce the trainer's model"
            )
        return self


def compare_logprobs(reference: torch.Tensor, candidate: torch.Tensor) -> LogprobComparison:
    """Compare two [batch, positions] log-probability tensors (computed in fp32 here)."""
    if reference.shape != candidate.shape:
        raise VerifyInputError(f"log-probability shapes differ: {tuple(reference.shape)} vs {tuple(candidate.shape)}")
    diff = (reference.double() - candidate.double().to(reference.device)).abs()
    return LogprobComparison(
        tokens=diff.numel(),
        mean_abs_diff=diff.mean().item(),
        max_abs_diff=diff.max().item(),
        mult_prob_error=diff.exp().mean().item(),
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) in fp32, [batch, seq-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def megatron_logprobs(
    chunks: list[torch.nn.Module], tokens: torch.Tensor, vocab_size: int, *, fp32_logits: bool = True
) -> torch.Tensor:
    """Trainer-side log-probabilities. Call on every rank of the model (collective over TP).

    Needs a single pipeline stage (PP=1, no VPP): the verifier runs a plain forward, not a
    pipeline schedule. Vocab padding added by Megatron is trimmed to ``vocab_size``.
    ``fp32_logits``: project the final hidden states with the output weight in fp32 (see
    ``projected_in_fp32``) instead of using the model's own (bf16) logits.
    """
    from megatron.core import parallel_state

    if len(chunks) != 1 or parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise VerifyInputError("the refit verifier runs the trainer model with PP=1 (no VPP): verify at --pp 1")
    model = chunks[0]
    was_training = model.training
    model.eval()
    batch, seq = tokens.shape
    positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
    # Megatron builds its default causal mask on CUDA; on CPU pass it (True = masked out).
    mask = None if tokens.is_cuda else torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad(), _forward_context(chunks, tokens.device), _captured_input(model.output_layer) as captured:
        logits = model(input_ids=tokens, position_ids=positions, attention_mask=mask)
        if fp32_logits:  # Megatron's output layer takes [seq, batch, hidden] and may be given the tied weight
            hidden, weight = captured["input"], captured.get("weight")
            logits = projected_in_fp32(hidden, weight if weight is not None else model.output_layer.weight).transpose(0, 1)
        logits = _gather_vocab(logits, parallel_state.get_tensor_model_parallel_group())[..., :vocab_size]
    model.train(was_training)
    return token_logprobs(logits, tokens)


def _gather_vocab(logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """Concatenate vocab-parallel logits over the TP group (plain ``all_gather``: gloo and NCCL)."""
    size = dist.get_world_size(tp_group)
    if size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def _forward_context(chunks: list[torch.nn.Module], device: torch.device):
    if device.type != "cpu":
        return contextlib.nullcontext()
    from mbridge_refit.tools.cpu_forward import cpu_forward

    return cpu_forward(chunks)


def hf_logprobs(hf_model: torch.nn.Module, tokens: torch.Tensor, *, fp32_logits: bool = True) -> torch.Tensor:
    """Engine-side log-probabilities from a ``transformers`` causal LM (single process)."""
    head = hf_model.get_output_embeddings()
    with torch.no_grad(), _captured_input(head) as captured:
        logits = hf_model(input_ids=tokens.to(hf_model.device)).logits
        if fp32_logits:
            logits = projected_in_fp32(captured["input"], head.weight)
    return token_logprobs(logits, tokens.to(logits.device))


def projected_in_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` in fp32: logits without the output layer's bf16 rounding.

    bf16 logits carry a rounding error of up to half an ulp of the logit (2^-8 relative: ~0.008
    for a logit of 4), which alone exceeds a 1e-3 log-probability tolerance; computing the last
    projection in fp32 on both sides leaves only the transformer body's differences. (With
    PyTorch's default ``allow_tf32 = False`` this is a true fp32 product; the caller's setting is
    left alone.)
    """
    return hidden.float() @ weight.float().t()


@contextlib.contextmanager
def _captured_input(module: torch.nn.Module):
    """Record the input (and a ``weight`` keyword, if given) of ``module``'s next forward calls."""
    captured: dict[str, Any] = {}

    def hook(_module, args, kwargs):
        captured["input"] = args[0] if args else kwargs.get("input_", kwargs.get("input"))
        captured["weight"] = kwargs.get("weight")

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield captured
    finally:
        handle.remove()


def fixed_tokens(vocab_size: int, batch: int, seq: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """The same token batch on every rank and every run (seeded CPU generator)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen).to(device)


def verify_refit(
    bridge: Any,
    chunks: list[torch.nn.Module],
    hf_model: torch.nn.Module | None,
    tokens: torch.Tensor,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    perturb: str | None = None,
    fp32_logits: bool = True,
) -> LogprobComparison:
    """Export ``chunks`` into ``hf_model`` (rank 0's; None elsewhere), then compare log-probabilities.

    Collective over every rank of the model. Rank 0 applies the stream with ``HFModelUpdateSink``
    (strict: a missing or unexpected name raises) and compares; the result is broadcast, so every
    rank returns the same comparison or raises the same ``RefitMismatch``. ``perturb`` names an HF
    tensor to corrupt on its way into the engine (a self-test: the check must then fail).
    """
    from mbridge_refit.sinks import HFModelUpdateSink

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and hf_model is None:
        raise VerifyInputError("rank 0 needs the engine-side hf_model")
    sink = HFModelUpdateSink(hf_model) if rank == 0 else None
    seen_perturb = False
    for name, tensor in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False):
        if sink is None:
            continue
        if name == perturb:
            tensor, seen_perturb = _perturbed(tensor), True
        sink.consume(name, tensor)
    if sink is not None:
        sink.finish()
        if perturb is not None and not seen_perturb:
            raise VerifyInputError(f"--perturb {perturb!r} is not a name the export yields")
    vocab_size = _vocab_size(bridge)
    reference = megatron_logprobs(chunks, tokens, vocab_size, fp32_logits=fp32_logits)
    result = [compare_logprobs(reference, hf_logprobs(hf_model, tokens, fp32_logits=fp32_logits)) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0].check(tolerance)


def _perturbed(tensor: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=tensor.device).manual_seed(1)
    noise = torch.randn(tensor.shape, generator=gen, device=tensor.device, dtype=torch.float32)
    return (tensor.float() + noise * tensor.float().std()).to(tensor.dtype)


def _hf_config(bridge: Any) -> Any:
    """The bridge's HF config (``from_hf_pretrained`` keeps it on the model wrapper, ``from_hf_config`` bare)."""
    return getattr(bridge.hf_pretrained, "config", bridge.hf_pretrained)


def _vocab_size(bridge: Any) -> int:
    return int(_hf_config(bridge).vocab_size)


# --- CLI ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class VerifyArgs:
    source: str  # "hf" | "recipe" | "shape"
    name: str
    layout: ParallelLayout
    device: torch.device
    batch: int
    seq: int
    tolerance: float
    perturb: str | None
    dtype: torch.dtype
    fp32_logits: bool
    json: Path | None
    timeout: datetime.timedelta


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mbridge_refit.verify_refit",
        description="Export a Megatron model into a transformers model (in-place update sink) and compare "
        "per-token log-probabilities of both on a fixed token batch.",
        epilog="examples:\n"
        "  python -m mbridge_refit.verify_refit --recipe qwen3-tiny --device cpu\n"
        "  torchrun --nproc-per-node 2 -m mbridge_refit.verify_refit --shape qwen3-1.7b --tp 2\n"
        "  python -m mbridge_refit.verify_refit --recipe qwen3-tiny --perturb "
        "model.layers.0.self_attn.o_proj.weight   # must fail\n"
        "exit codes: 0 within tolerance, 1 mismatch, 2 bad input, 3 failure",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", type=Path, help="HF checkpoint directory to load into the trainer model")
    source.add_argument("--recipe", help="built-in tiny recipe (a random checkpoint is made in a temp dir)")
    source.add_argument("--shape", help="full-size shape from recipes/shapes (GPU: Megatron's random init)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default: 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE only (default: 1)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if present")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16",
        help="parameter and compute dtype of both models (default: %(default)s; float32 separates refit errors "
        "from bf16 kernel noise)",
    )
    parser.add_argument(
        "--model-dtype-logits", action="store_true",
        help="compare the models' own logits (bf16 with --dtype bfloat16) instead of projecting the final hidden "
        "states in fp32 on both sides",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences in the token batch (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="max mean |d logprob| (default: %(default)s)")
    parser.add_argument("--perturb", default=None, metavar="HF_NAME", help="corrupt this tensor on its way to the engine")
    parser.add_argument("--json", type=Path, default=None, help="write the comparison as JSON here")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def parse_args(argv: Sequence[str] | None) -> VerifyArgs:
    from mbridge_refit.tools.launch import LaunchEnv, default_device

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.batch < 1 or args.seq < 2:
        raise VerifyInputError(f"--batch must be >= 1 and --seq >= 2, got {args.batch} and {args.seq}")
    if args.json is not None and not args.json.parent.is_dir():
        raise VerifyInputError(f"directory {args.json.parent} for --json does not exist")
    if args.hf is not None and not (args.hf / "config.json").is_file():
        raise VerifyInputError(f"--hf {args.hf}: no config.json there; pass an HF checkpoint directory")
    device = default_device() if args.device == "auto" else torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VerifyInputError("--device cuda but no CUDA device is visible: use --device cpu")
    if args.shape is not None and device.type != "cuda":
        raise VerifyInputError("--shape uses Megatron's GPU initialisation: run it on a GPU, or use --recipe on CPU")
    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    try:
        layout.validate_world_size(LaunchEnv.from_environ().world_size)
    except LayoutError as err:
        raise VerifyInputError(f"--tp {args.tp} --ep {args.ep}: {err}") from err
    source, name = next((k, str(v)) for k, v in (("hf", args.hf), ("recipe", args.recipe), ("shape", args.shape)) if v is not None)
    return VerifyArgs(
        source=source, name=name, layout=layout, device=device, batch=args.batch, seq=args.seq,
        tolerance=args.tolerance, perturb=args.perturb, dtype=getattr(torch, args.dtype), json=args.json,
        fp32_logits=not args.model_dtype_logits,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except VerifyInputError as err:
        logger.error("%s", err)
        return EXIT_BAD_INPUT
    except RefitMismatch as err:
        logger.error("%s", err)
        return EXIT_MISMATCH


def run(options: VerifyArgs) -> int:
    """The CLI's job on this rank (every rank of the launch)."""
    from mbridge_refit.tools.launch import distributed_session

    with distributed_session(options.layout, device=options.device, timeout=options.timeout) as env:
        device = torch.device("cuda", torch.cuda.current_device()) if options.device.type == "cuda" else options.device
        checkpoint = _source_checkpoint(options, env.rank)
        try:
            passed, result = _verify(options, checkpoint, env.rank, device)
        finally:
            if options.source == "recipe":
                _remove_scratch(checkpoint.parent, env.rank)
    if not passed:
        raise RefitMismatch(f"mean |d logprob| {result.mean_abs_diff:.3e} > tolerance {options.tolerance:.1e}")
    return EXIT_OK


def _verify(options: VerifyArgs, checkpoint: Path | None, rank: int, device: torch.device) -> tuple[bool, LogprobComparison]:
    from transformers import AutoModelForCausalLM

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.tools.model_builder import BuildOptions, build_model

    if checkpoint is not None:
        bridge = RefitBridge.from_hf_pretrained(checkpoint)
    else:
        from mbridge_refit.tools.recipes import full_size_config

        bridge = RefitBridge.from_hf_config(full_size_config(options.name))
    config = _hf_config(bridge)
    _check_layout(options.layout, config)
    if options.device.type == "cpu" and _model_shape(config).num_experts:
        raise VerifyInputError(
            "the CPU forward covers dense models only (Megatron's MoE router and dispatch need CUDA): "
            "verify mixture-of-experts models on a GPU"
        )
    chunks = build_model(bridge, options.layout, BuildOptions(device=options.device, params_dtype=options.dtype))
    if checkpoint is not None:
        bridge.load_hf_shards(chunks, checkpoint)
    hf_model = None
    if rank == 0:
        with device:
            hf_model = AutoModelForCausalLM.from_config(config, dtype=options.dtype).eval()
    tokens = fixed_tokens(config.vocab_size, options.batch, options.seq, device)
    result = verify_refit(
        bridge, chunks, hf_model, tokens, tolerance=float("inf"), perturb=options.perturb, fp32_logits=options.fp32_logits
    )
    passed = result.mean_abs_diff <= options.tolerance
    if rank == 0:
        _report(options, result, passed, engine_noise=_engine_attention_noise(hf_model, tokens, options.fp32_logits))
    return passed, result


def _engine_attention_noise(hf_model: torch.nn.Module, tokens: torch.Tensor, fp32_logits: bool) -> LogprobComparison | None:
    """The engine model against itself with another attention implementation (``eager`` vs
    the one it runs, same weights): how far two correct implementations drift apart in this
    dtype. A context for the trainer-vs-engine number, reported, never used to pass or fail."""
    current = getattr(hf_model.config, "_attn_implementation", None)
    if current in (None, "eager"):
        return None
    baseline = hf_logprobs(hf_model, tokens, fp32_logits=fp32_logits)
    try:
        hf_model.set_attn_implementation("eager")
        return compare_logprobs(baseline, hf_logprobs(hf_model, tokens, fp32_logits=fp32_logits))
    except (ValueError, ImportError) as err:  # an implementation this model or machine lacks
        logger.info("engine attention noise not measured: %s", err)
        return None
    finally:
        hf_model.set_attn_implementation(current)


def _source_checkpoint(options: VerifyArgs, rank: int) -> Path | None:
    """The HF checkpoint to load (for a recipe, a random one rank 0 writes to a temp dir), or None for a shape."""
    if options.source == "hf":
        return Path(options.name)
    if options.source == "shape":
        return None
    from mbridge_refit.tools import recipes

    scratch = [tempfile.mkdtemp(prefix="verify_refit_") if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(scratch, src=0)
    path = Path(scratch[0]) / "checkpoint"
    if rank == 0:
        recipes.make_random_checkpoint(recipes.get_model_recipe(options.name), path, seed=0)
    dist.barrier()
    return path


def _remove_scratch(scratch: Path, rank: int) -> None:
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)


def _model_shape(config: Any):
    from mbridge_refit.plan.layout import ModelShape

    return ModelShape.from_hf_config(config)


def _check_layout(layout: ParallelLayout, config: Any) -> None:
    try:
        layout.validate_model(_model_shape(config))
    except LayoutError as err:
        raise VerifyInputError(f"layout {layout.name}: {err}") from err


def _report(options: VerifyArgs, result: LogprobComparison, passed: bool, engine_noise: LogprobComparison | None = None) -> None:
    verdict = "PASS" if passed else "FAIL"
    logger.info(
        "%s %s %s %s: %d tokens, mean |d logprob| %.3e, max %.3e, mult prob error %.6f (tolerance %.1e)%s",
        verdict, options.source, options.name, options.layout.name, result.tokens, result.mean_abs_diff,
        result.max_abs_diff, result.mult_prob_error, options.tolerance,
        f", perturbed {options.perturb}" if options.perturb else "",
    )
    if engine_noise is not None:
        logger.info(
            "for scale: the engine model against itself with eager attention (same weights): mean |d logprob| %.3e, max %.3e",
            engine_noise.mean_abs_diff, engine_noise.max_abs_diff,
        )
    if options.json is not None:
        payload = {
            "source": options.source, "model": options.name, "layout": options.layout.name,
            "device": torch.cuda.get_device_name() if options.device.type == "cuda" else "cpu",
            "dtype": str(options.dtype).removeprefix("torch."), "batch": options.batch, "seq": options.seq, "tolerance": options.tolerance,
            "perturb": options.perturb, "logits": "fp32 projection" if options.fp32_logits else "model dtype",
            "passed": passed, **asdict(result),
            "engine_eager_vs_default_attention": asdict(engine_noise) if engine_noise is not None else None,
        }
        options.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
