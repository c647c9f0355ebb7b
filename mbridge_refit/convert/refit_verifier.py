"""Refit verifier: after a refit, are the engine's weights the trainer's, and how far are its numerics?

Two questions, answered apart (a ``RefitVerdict`` holds both):

* Weights, exact: every engine tensor against an oracle, bit for bit. ``verify_refit`` (into a
  ``transformers`` model) compares each tensor the refit wrote with Megatron-Bridge's own export
  of the same model (``export_hf_weights_stock``: another code path); ``verify_vllm_refit``
  compares the engine's parameter fingerprints with those of an engine loaded from a checkpoint
  of the same weights (``reference_fingerprints``). A wrong weight fails here whatever the
  numerics, and a right one passes whatever they are.
* Numerics, measured: per-token log-probabilities of the engine against Megatron's forward on a
  fixed token batch. Two correct implementations differ by their kernels and dtype (bf16: 1e-3
  on CPU for a tiny model, 0.02 on an H100 for the Qwen3-1.7B shape, 0.2 for the DeepSeek-V3
  shape in vLLM), so the number is checked against a tolerance the caller gives or derives:
  ``numerics_tolerance`` (from the dtype's eps and the engine's own spread between two attention
  implementations) or ``tolerance_from_reference`` (from a reference run: an engine loaded from
  a checkpoint of the same weights, which an exact refit reproduces). It catches what the weights
  check cannot: a forward that differs (another config, a missing scaling, a broken kernel).

Library use (e.g. after every refit in a training loop):

    ref = megatron_logprobs(chunks, tokens)          # every trainer rank (PP=1), collective over TP
    got = hf_logprobs(hf_model, tokens)              # wherever the engine-side model lives
    report = compare_logprobs(ref, got)              # mean / max |d logprob|, multiplicative error
    report.check(tolerance)                          # raises RefitMismatch with the numbers

``verify_refit(bridge, chunks, hf_model, tokens)`` does the whole round: export through
``HFModelUpdateSink`` into ``hf_model`` on rank 0, the weights check, both forwards, the
comparison (verdict shared by every rank, so all ranks return or raise alike).
``verify_vllm_refit(refit, bridge, chunks, tokens)`` does the same round into a vLLM engine
(``engines.vllm.VLLMRefit``): the refit, the fingerprints, then the engine's *own* prompt
log-probabilities (``vllm_logprobs``: its kernels, its bf16 logits) against the trainer's.

The command line is ``python -m mbridge_refit.convert verify-refit`` (``convert.verify_refit``).

The multiplicative probability error is ``mean(exp(|logp_trainer - logp_engine|))`` over
tokens (1.0 = identical), the quantity RL frameworks track between trainer and rollout engine.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.distributed as dist

from mbridge_refit.convert.tolerance import EPS_FACTOR, NOISE_FACTOR, numerics_tolerance, tolerance_from_reference
from mbridge_refit.engines.replay.fingerprint import differing
from mbridge_refit.errors import EngineError, InputError
from mbridge_refit.sinks.base import DiscardSink, drain
from mbridge_refit.sinks.model_update import HFModelUpdateSink

if TYPE_CHECKING:
    from mbridge_refit.bridge import RefitBridge

__all__ = [
    "EPS_FACTOR",
    "LogprobComparison",
    "NOISE_FACTOR",
    "RefitMismatch",
    "RefitVerdict",
    "VerifyInputError",
    "WeightsCheck",
    "compare_logprobs",
    "compare_weights",
    "engine_attention_noise",
    "fixed_tokens",
    "hf_config",
    "hf_logprobs",
    "megatron_logprobs",
    "numerics_tolerance",
    "projected_in_fp32",
    "same_bytes",
    "token_logprobs",
    "tolerance_from_reference",
    "verify_refit",
    "verify_vllm_refit",
    "vllm_logprobs",
]

logger = logging.getLogger("mbridge_refit.verify_refit")


class RefitMismatch(EngineError, AssertionError):
    """The engine's weights differ from the trainer's, or its log-probabilities differ beyond the tolerance."""


class VerifyInputError(InputError):
    """A model or option the verifier cannot use (the message names the fix)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LogprobComparison:
    """Per-token log-probability agreement between trainer and engine."""

    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    mult_prob_error: float  # mean(exp(|d logprob|)); 1.0 = identical

    def check(self, tolerance: float) -> "LogprobComparison":
        """Raise ``RefitMismatch`` unless ``mean_abs_diff <= tolerance``; return self."""
        if not self.mean_abs_diff <= tolerance:  # NaN fails too
            raise RefitMismatch(
                f"refit mismatch: mean |d logprob| {self.mean_abs_diff:.3e} > tolerance {tolerance:.1e} "
                f"(max {self.max_abs_diff:.3e}, mult prob error {self.mult_prob_error:.5f}, {self.tokens} tokens): "
                "the engine's weights do not reproduce the trainer's model"
            )
        return self


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightsCheck:
    """The engine's tensors against an oracle, bit for bit."""

    against: str  # what the oracle was
    compared: int  # tensors (or engine parameters) compared
    differing: tuple[str, ...]  # names whose bytes, shape or dtype differ, or that one side lacks

    @property
    def exact(self) -> bool:
        return self.compared > 0 and not self.differing


@dataclass(frozen=True, kw_only=True, slots=True)
class RefitVerdict:
    """Both answers of a verification (module docstring). ``weights`` is None where no oracle was
    given; ``tolerance`` None where the numerics are reported only; ``tolerance_from`` says how
    the tolerance was set; ``engine_noise`` is the engine against itself with eager attention."""

    weights: WeightsCheck | None
    numerics: LogprobComparison
    tolerance: float | None
    tolerance_from: str
    engine_noise: LogprobComparison | None = None

    @property
    def numerics_within(self) -> bool | None:
        return None if self.tolerance is None else bool(self.numerics.mean_abs_diff <= self.tolerance)  # NaN: False

    @property
    def passed(self) -> bool:
        return (self.weights is None or self.weights.exact) and self.numerics_within is not False

    def check(self) -> "RefitVerdict":
        """Raise ``RefitMismatch`` naming the failed question; return self when both pass."""
        if self.weights is not None and not self.weights.exact:
            shown = list(self.weights.differing[:8])
            raise RefitMismatch(
                f"refit mismatch: the engine's weights are not the trainer's: {len(self.weights.differing)} of "
                f"{self.weights.compared} tensors differ bit for bit from {self.weights.against}, e.g. {shown}"
            )
        if self.numerics_within is False:
            numbers = self.numerics
            exact = f"exact ({self.weights.compared} tensors bit for bit), but " if self.weights is not None else ""
            raise RefitMismatch(
                f"refit mismatch: the engine's weights are {exact}its log-probabilities differ from Megatron's by "
                f"mean |d logprob| {numbers.mean_abs_diff:.3e} > tolerance {self.tolerance:.3e} "
                f"({self.tolerance_from}; max {numbers.max_abs_diff:.3e}, mult prob error "
                f"{numbers.mult_prob_error:.5f}, {numbers.tokens} tokens): "
                "the two forwards differ by more than their numerics (another config, scaling or kernel)"
            )
        return self


def same_bytes(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes (``-0.0 != 0.0``; NaNs by payload)."""
    if left.dtype != right.dtype or tuple(left.shape) != tuple(right.shape):
        return False
    as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (left, right.to(left.device))]
    return bool(torch.equal(*as_bytes))


def compare_weights(sink: HFModelUpdateSink, oracle: Iterable[tuple[str, torch.Tensor]], against: str) -> WeightsCheck:
    """Each oracle tensor against the engine tensor ``sink`` wrote it into, bit for bit."""
    compared, wrong = 0, []
    for name, tensor in oracle:
        target = sink.target_view(name)
        compared += 1
        if target is None:
            wrong.append(f"{name} (no engine tensor)")
        elif not same_bytes(target, tensor):
            wrong.append(name)
    return WeightsCheck(against=against, compared=compared, differing=tuple(wrong))


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
            logits = projected_in_fp32(hidden, weight if weight is not None else model.output_layer.weight).transpose(
                0, 1
            )
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
    from mbridge_refit.models.cpu_forward import cpu_forward

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
        raise VerifyInputError(
            f"the engine returned no log-probability for {missing} prompt token(s): start it with "
            "max_logprobs >= 0 and skip_tokenizer_init=True (token-id prompts)"
        )
    return torch.tensor(rows, dtype=torch.float32)


def verify_vllm_refit(
    refit: Any,
    bridge: RefitBridge,
    chunks: list[torch.nn.Module],
    tokens: torch.Tensor,
    *,
    sender: bool,
    tolerance: float | None = None,
    reference_fingerprints: dict[str, tuple[int, int]] | None = None,
    fp8: Any = None,
    perturb: str | None = None,
    check: bool = True,
) -> RefitVerdict:
    """Refit the engine of ``refit`` (a ``VLLMRefit``) from ``chunks``, then answer both questions
    (module docstring): the engine's parameter fingerprints against ``reference_fingerprints``
    (those of an engine loaded from a checkpoint of the same weights: ``refit.fingerprints()``
    after starting it from the checkpoint ``convert`` wrote), and the engine's own prompt
    log-probabilities on ``tokens`` against the trainer's (Megatron's forward, fp32 logits),
    within ``tolerance`` (e.g. ``tolerance_from_reference`` of that engine's comparison).

    The engine computes in its own kernels with bf16 logits, so how far its numbers may be from
    the trainer's depends on the model (0.02 for the Qwen3-1.7B shape, 0.2 for DeepSeek-V3's on
    an H100): no tolerance is assumed. Give ``reference_fingerprints`` (on the sender), a
    ``tolerance`` (the same on every rank), or both; with neither nothing would be checked and
    the sender raises ``VerifyInputError``. ``perturb`` names a tensor to corrupt on its way (the
    check must then fail).

    Collective over every rank of the model (PP=1): the refit's export and the trainer forward.
    The rank with ``sender=True`` (one per engine) refits and asks the engine; the verdict is
    shared by every rank, so all return the same verdict or (``check``) raise the same
    ``RefitMismatch``. The engine must be idle (no generation in flight) during the call.
    """
    if sender and tolerance is None and reference_fingerprints is None:
        raise VerifyInputError(
            "verify_vllm_refit has nothing to check: pass reference_fingerprints= (an engine loaded from a checkpoint "
            "of these weights: refit.fingerprints()) for the exact weights check and/or tolerance= for the numerics "
            "(tolerance_from_reference(that engine's comparison with Megatron))"
        )
    seen: set[str] = set()
    through = None if perturb is None else (lambda stream: _perturbing(stream, perturb, seen))
    step = refit.refit(bridge, chunks, fp8=fp8, sender=sender, through=through)
    if sender and perturb is not None and perturb not in seen:
        raise VerifyInputError(f"perturb={perturb!r} is not a tensor the refit sends")
    weights = None
    if sender and reference_fingerprints is not None:
        wrong = differing(reference_fingerprints, refit.fingerprints())
        weights = WeightsCheck(
            against="the reference engine's parameter fingerprints",
            compared=len(reference_fingerprints),
            differing=tuple(wrong),
        )
    reference = megatron_logprobs(chunks, tokens, _vocab_size(bridge))
    result = None
    if sender:
        numerics = compare_logprobs(reference, vllm_logprobs(refit.llm, tokens))
        result = RefitVerdict(
            weights=weights,
            numerics=numerics,
            tolerance=tolerance,
            tolerance_from="given" if tolerance is not None else "none: reported only",
        )
    if step is not None:
        logger.info(
            "refit verified against the engine: %d tensors, %.1f ms", step.tensors, step.export_ms + step.apply_ms
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        result = next((r for r in gathered if r is not None), None)
    if result is None:
        raise VerifyInputError("no rank passed sender=True: one rank per engine must hold it")
    return result.check() if check else result


def fixed_tokens(vocab_size: int, batch: int, seq: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """The same token batch on every rank and every run (seeded CPU generator)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen).to(device)


def verify_refit(
    bridge: RefitBridge,
    chunks: list[torch.nn.Module],
    hf_model: torch.nn.Module | None,
    tokens: torch.Tensor,
    *,
    tolerance: float | None = None,
    perturb: str | None = None,
    fp32_logits: bool = True,
    check: bool = True,
) -> RefitVerdict:
    """Export ``chunks`` into ``hf_model`` (rank 0's; None elsewhere), then answer both questions
    (module docstring): every tensor written against Megatron-Bridge's own export, bit for bit,
    and the log-probabilities of both forwards, within ``tolerance`` (default: ``numerics_tolerance``
    of ``hf_model``'s dtype and its own eager-vs-default attention spread).

    Collective over every rank of the model. Rank 0 applies the stream with ``HFModelUpdateSink``
    (strict: a missing or unexpected name raises) and compares; the verdict is broadcast, so every
    rank returns the same verdict or (``check``) raises the same ``RefitMismatch``. ``perturb``
    names an HF tensor to corrupt on its way into the engine (a self-test: the check must then fail).
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
    oracle = bridge.export_hf_weights_stock(chunks, show_progress=False)  # collective: every rank iterates it
    if rank == 0:
        weights = compare_weights(sink, oracle, against="Megatron-Bridge's own export of the trainer model")
    else:
        drain(oracle, DiscardSink())
    vocab_size = _vocab_size(bridge)
    reference = megatron_logprobs(chunks, tokens, vocab_size, fp32_logits=fp32_logits)
    result: list[Any] = [None]
    if rank == 0:
        numerics = compare_logprobs(reference, hf_logprobs(hf_model, tokens, fp32_logits=fp32_logits))
        noise = engine_attention_noise(hf_model, tokens, fp32_logits)
        tolerance_from = "given"
        if tolerance is None:
            tolerance, tolerance_from = numerics_tolerance(next(hf_model.parameters()).dtype, noise)
        result = [
            RefitVerdict(
                weights=weights,
                numerics=numerics,
                tolerance=tolerance,
                tolerance_from=tolerance_from,
                engine_noise=noise,
            )
        ]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0].check() if check else result[0]


def engine_attention_noise(
    hf_model: torch.nn.Module, tokens: torch.Tensor, fp32_logits: bool = True
) -> LogprobComparison | None:
    """The engine model against itself with another attention implementation (``eager`` vs the
    one it runs, same weights): how far two correct implementations drift apart in this dtype.
    None where the model runs eager attention already or cannot switch."""
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


def _perturbing(
    stream: Iterable[tuple[str, torch.Tensor]], name: str | None, seen: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
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


def hf_config(bridge: RefitBridge) -> Any:
    """The bridge's HF config (``from_hf_pretrained`` keeps it on the model wrapper, ``from_hf_config`` bare)."""
    return getattr(bridge.hf_pretrained, "config", bridge.hf_pretrained)


def _vocab_size(bridge: RefitBridge) -> int:
    return int(hf_config(bridge).vocab_size)
