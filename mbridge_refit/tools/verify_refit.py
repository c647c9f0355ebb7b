"""Refit verifier: after a refit, does the engine's model compute what the trainer's model computes?

Library use (e.g. after every refit in a training loop):

    ref = megatron_logprobs(chunks, tokens)          # every trainer rank (PP=1), collective over TP
    got = hf_logprobs(hf_model, tokens)              # wherever the engine-side model lives
    report = compare_logprobs(ref, got)              # mean / max |d logprob|, multiplicative error
    report.check(tolerance=1e-3)                     # raises RefitMismatch with the numbers

``verify_refit(bridge, chunks, hf_model, tokens)`` does the whole round: export through
``HFModelUpdateSink`` into ``hf_model`` on rank 0, both forwards, comparison (verdict shared by
every rank, so all ranks return or raise alike). ``verify_vllm_refit(refit, bridge, chunks,
tokens)`` does the same round into a vLLM engine (``engines.vllm.VLLMRefit``): the refit, then
the engine's *own* prompt log-probabilities (``vllm_logprobs``: its kernels, its bf16 logits)
against the trainer's.

The command line is ``python -m mbridge_refit.convert verify-refit`` (``convert.verify_refit``).

The multiplicative probability error is ``mean(exp(|logp_trainer - logp_engine|))`` over
tokens (1.0 = identical), the quantity RL frameworks track between trainer and rollout engine.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from mbridge_refit.sinks.base import DiscardSink, drain
from mbridge_refit.sinks.model_update import HFModelUpdateSink

logger = logging.getLogger("mbridge_refit.verify_refit")

DEFAULT_TOLERANCE = 1e-3
VLLM_TOLERANCE = 5e-2  # mean |d logprob| allowed between Megatron (fp32 logits) and a bf16 vLLM engine's own logprobs
# (H100, random weights: 0.023 for the Qwen3-1.7B shape and 0.004 for Qwen3-30B-A3B cut to 4 layers
# after an exact refit; 0.73 with one attention projection perturbed)


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


def vllm_logprobs(llm: Any, tokens: torch.Tensor) -> torch.Tensor:
    """A vLLM engine's own log p(tokens[:, t+1] | tokens[:, :t+1]), [batch, seq-1] in fp32, from
    its prompt logprobs (``engines.vllm.prompt_logprobs``; greedy, one generated token)."""
    from mbridge_refit.engines.vllm import prompt_logprobs

    rows = prompt_logprobs(llm, tokens.tolist())
    missing = sum(value is None for row in rows for value in row)
    if missing or any(len(row) != tokens.shape[1] - 1 for row in rows):
        raise VerifyInputError(f"the engine returned no log-probability for {missing} prompt token(s): start it with "
                               "max_logprobs >= 0 and skip_tokenizer_init=True (token-id prompts)")
    return torch.tensor(rows, dtype=torch.float32)


def verify_vllm_refit(
    refit: Any,
    bridge: Any,
    chunks: list[torch.nn.Module],
    tokens: torch.Tensor,
    *,
    sender: bool,
    tolerance: float = VLLM_TOLERANCE,
    fp8: Any = None,
    perturb: str | None = None,
) -> LogprobComparison:
    """Refit the engine of ``refit`` (a ``VLLMRefit``) from ``chunks``, then compare the engine's
    own prompt log-probabilities on ``tokens`` with the trainer's (Megatron's forward, fp32 logits).

    Collective over every rank of the model (PP=1): the refit's export and the trainer forward.
    The rank with ``sender=True`` (one per engine) refits and asks the engine; the verdict is
    shared by every rank, so all return the same comparison or raise the same ``RefitMismatch``.
    The engine computes in its own kernels with bf16 logits, so its numbers differ from the
    trainer's by more than a transformers model's do: ``VLLM_TOLERANCE`` is set for that, and a
    wrong weight moves them far more (``perturb`` names a tensor to corrupt on its way: the
    check must then fail). The engine must be idle (no generation in flight) during the call.
    """
    seen: set[str] = set()
    through = None if perturb is None else (lambda stream: _perturbing(stream, perturb, seen))
    step = refit.refit(bridge, chunks, fp8=fp8, sender=sender, through=through)
    if sender and perturb is not None and perturb not in seen:
        raise VerifyInputError(f"perturb={perturb!r} is not a tensor the refit sends")
    reference = megatron_logprobs(chunks, tokens, _vocab_size(bridge))
    result = compare_logprobs(reference, vllm_logprobs(refit.llm, tokens)) if sender else None
    if step is not None:
        logger.info("refit verified against the engine: %d tensors, %.1f ms", step.tensors, step.export_ms + step.apply_ms)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        result = next((r for r in gathered if r is not None), None)
    if result is None:
        raise VerifyInputError("no rank passed sender=True: one rank per engine must hold it")
    return result.check(tolerance)


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
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and hf_model is None:
        raise VerifyInputError("rank 0 needs the engine-side hf_model")
    sink = HFModelUpdateSink(hf_model) if rank == 0 else DiscardSink()
    seen: set[str] = set()
    stream = bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False)
    drain(_perturbing(stream, perturb, seen), sink)
    if rank == 0 and perturb is not None and perturb not in seen:
        raise VerifyInputError(f"--perturb {perturb!r} is not a name the export yields")
    vocab_size = _vocab_size(bridge)
    reference = megatron_logprobs(chunks, tokens, vocab_size, fp32_logits=fp32_logits)
    result = [compare_logprobs(reference, hf_logprobs(hf_model, tokens, fp32_logits=fp32_logits)) if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0].check(tolerance)


def _perturbing(stream: Iterable[tuple[str, torch.Tensor]], name: str | None, seen: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with the tensor called ``name`` corrupted (recorded in ``seen``)."""
    for hf_name, tensor in stream:
        if hf_name == name:
            seen.add(hf_name)
            tensor = _perturbed(tensor)
        yield hf_name, tensor


def _perturbed(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` plus noise of its own spread, clamped to its dtype's finite range (an FP8 weight
    would otherwise overflow to NaN)."""
    gen = torch.Generator(device=tensor.device).manual_seed(1)
    noise = torch.randn(tensor.shape, generator=gen, device=tensor.device, dtype=torch.float32)
    values = tensor.float() + noise * tensor.float().std()
    if tensor.dtype.is_floating_point:
        limit = torch.finfo(tensor.dtype).max
        values = values.clamp(-limit, limit)
    return values.to(tensor.dtype)


def hf_config(bridge: Any) -> Any:
    """The bridge's HF config (``from_hf_pretrained`` keeps it on the model wrapper, ``from_hf_config`` bare)."""
    return getattr(bridge.hf_pretrained, "config", bridge.hf_pretrained)


def _vocab_size(bridge: Any) -> int:
    return int(hf_config(bridge).vocab_size)
