"""The vLLM adapter's trainer side: refit sessions into a vLLM ``LLM``, one per transport, and what
they need of vLLM.

Each session is an engine-agnostic transport's trainer side bound to ``llm``: the workers called
through ``llm.collective_rpc`` (the worker extension ``engines.vllm.worker``, added by
``engine_kwargs()``), the names a vLLM engine skips (``ignored_by_engine``) and the prefix-cache reset
after the weights are written (``reset_prefix_cache``; off with ``reset_prefix_cache=False``):

* ``VLLMRefit`` (transport ``ipc``, ``engines.ipc.trainer.IpcSession``): the engine runs on this
  trainer rank's GPU. Start it with ``LLM(..., **engine_kwargs())``; on that trainer rank
  ``refit = VLLMRefit(llm)``, then each step ``refit.refit(bridge, model)`` (every other rank of the
  model's groups ``refit.refit(..., sender=False)``), ``refit.close()`` before the trainer frees the
  model or the bridge's buffers. The engine process must not be the trainer's own
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs it inside; then pass ``transport=LocalTransport()``).
  Every call is bounded by ``timeout_s``.
* ``VLLMBroadcastRefit`` (transport ``broadcast``, ``engines.broadcast.trainer.BroadcastSession``): the
  engine runs on other GPUs or hosts. On every trainer rank of the model's groups
  ``VLLMBroadcastRefit(llm, host=, port=, source=...)`` with ``source=True`` on exactly one rank (it
  holds ``llm``; the others pass ``llm=None``), ``open`` once, ``refit`` each step, ``close`` at the
  end. The workers' side of joining and receiving runs through ``llm.collective_rpc`` from a thread
  of the source rank while it sends; leaving is bounded by ``timeout_s``. vLLM's batch-invariant
  mode (``VLLM_BATCH_INVARIANT=1``) sets ``NCCL_*`` settings in its workers: set the same in the
  trainer's environment before its first NCCL call.

Also: ``engine_kwargs`` (the ``LLM`` arguments a refit target needs), ``prompt_logprobs`` (the
engine's own log-probabilities of prompts, for checks).
"""

from __future__ import annotations

from typing import Any

from mbridge_refit.engines.broadcast.trainer import BroadcastSession, on_a_thread
from mbridge_refit.engines.ipc.sharing import Transport
from mbridge_refit.engines.ipc.trainer import IpcSession
from mbridge_refit.engines.vllm.worker import WORKER_EXTENSION
from mbridge_refit.errors import EngineError
from mbridge_refit.runtime.weight_source import ExportsWeights

__all__ = [
    "TIED_OUTPUT_NAMES",
    "VLLMBroadcastRefit",
    "VLLMRefit",
    "engine_kwargs",
    "ignored_by_engine",
    "prompt_logprobs",
    "reset_prefix_cache",
]


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that a refit target needs (the worker extension)."""
    return {"worker_extension_cls": WORKER_EXTENSION, **overrides}


def reset_prefix_cache(llm: Any, what: str = "weights") -> None:
    """Drop the engine's cached prompt blocks after a refit (every session here does, unless told
    not to). vLLM keys them by the tokens (and the adapter's name), not by the weights: without the
    reset a prompt seen before the refit reuses KV blocks computed with the old ``what``. Raises
    ``EngineError`` when the engine refuses (requests still running: refit between generations)."""
    if not llm.reset_prefix_cache():
        raise EngineError(
            f"the engine refused to reset its prefix cache (requests still running): prompts seen before the refit "
            f"would reuse KV blocks computed with the previous {what}; refit between generations"
        )


TIED_OUTPUT_NAMES = ("lm_head.weight",)  # what an engine skips when its config ties embeddings


def ignored_by_engine(bridge: ExportsWeights) -> frozenset[str]:
    """Exported names an engine started from ``bridge``'s HF config skips by design: the output
    layer when the config ties it to the embedding (vLLM then never loads it)."""
    config = getattr(bridge.hf_pretrained, "config", None) or bridge.hf_pretrained
    return frozenset(TIED_OUTPUT_NAMES) if getattr(config, "tie_word_embeddings", False) else frozenset()


class _OnVLLM:
    """What both sessions bind of an ``LLM`` (``self.llm``, ``self.timeout_s``, ``self.reset_prefix_cache``)."""

    llm: Any
    timeout_s: float
    reset_prefix_cache: bool

    def _call_workers(self, method: str, *args: Any) -> list:
        """``method`` on every worker, bounded by ``timeout_s``; their results in worker order."""
        return self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)

    def _after_weights_written(self) -> None:
        if self.reset_prefix_cache:
            reset_prefix_cache(self.llm)


class VLLMRefit(_OnVLLM, IpcSession):
    """A refit session from this trainer process into one vLLM ``LLM`` on the same GPU
    (``IpcSession`` with vLLM's workers, names and prefix cache).

    ``check_first_refit``: the engine proves its recorded copies against its own loader on every
    open (costs one more pass over the weights, once). ``reset_prefix_cache``: drop the engine's
    cached prompt blocks after each refit (``reset_prefix_cache``; one engine call). ``allow_partial``: accept an export that
    leaves engine parameters unwritten or has tensors the engine does not load (a subset refit).
    ``overlap_follow_up``: over CUDA IPC the workers' apply returns once their copies are launched
    and the reset runs while they do; the refit still returns only once they are done
    (``engines.ipc.completion``; off: the reset after the copies). ``engine_quantizes``: with ``fp8``, the
    workers quantize the weights that are whole-block rows of the trainer's parameters themselves, straight
    into their FP8 parameters where their loader copies a weight whole (off: the trainer quantizes them into
    its export buffers and the workers copy those; ``IpcSession``). ``early_apply``: each steady step's
    apply RPC leaves before the export and the worker waits for the trainer's go-ahead on a local
    socket (``engines.ipc.go_ahead``; None: on over CUDA IPC, where the engine is its own process).
    ``defer_gc``: a steady step holds Python's garbage collector off until the workers' copies are let
    go (``runtime.gc_pause``). ``check_after_word``: the live parameters' addresses are read after the
    go-ahead, while the workers copy, and a step that finds one moved opens anew over its copies (off: read
    before it; ``IpcSession``). The session references the last refit's model parameters and shared
    storages until ``close``.
    """

    def __init__(
        self,
        llm: Any,
        *,
        transport: Transport | None = None,
        check_first_refit: bool = True,
        allow_partial: bool = False,
        timeout_s: float = 600.0,
        reset_prefix_cache: bool = True,
        overlap_follow_up: bool = True,
        engine_quantizes: bool = True,
        early_apply: bool | None = None,
        defer_gc: bool = True,
        check_after_word: bool = True,
    ) -> None:
        self.llm = llm
        self.reset_prefix_cache = reset_prefix_cache
        self.timeout_s = timeout_s
        super().__init__(
            self._call_workers,
            transport=transport,
            ignored=ignored_by_engine,
            after_weights_written=self._after_weights_written,
            check_first_refit=check_first_refit,
            allow_partial=allow_partial,
            overlap_follow_up=overlap_follow_up,
            engine_quantizes=engine_quantizes,
            early_apply=early_apply,
            defer_gc=defer_gc,
            check_after_word=check_after_word,
            timeout_s=timeout_s,
        )


class VLLMBroadcastRefit(_OnVLLM, BroadcastSession):
    """A broadcast refit session from the trainer ranks into one vLLM ``LLM`` (``BroadcastSession``
    with vLLM's workers, names and prefix cache; module docstring).

    Args:
        llm: the engine (``collective_rpc``); only on the source rank.
        reset_prefix_cache: drop the engine's cached prompt blocks in each refit (``reset_prefix_cache``):
            asked for from a thread of the source once the workers are in their receive, so vLLM's engine
            core runs it right after the receive (``overlap_follow_up``, on by default), or after the receive.
        options: ``BroadcastSession``'s keywords, passed through: ``host``, ``port`` (required),
        ``engine_workers``, ``source``, ``trainer_group``, ``trainer_src``, ``config``, ``backend``,
        ``allow_partial``, ``timeout_s`` (also bounds leaving the group), ``device``, ``overlap_follow_up``.
    """

    def __init__(self, llm: Any, *, reset_prefix_cache: bool = True, **options: Any) -> None:
        if options.get("source", True) and llm is None:
            raise ValueError("the source rank needs the engine (llm); the other trainer ranks pass source=False")
        self.llm = llm
        self.reset_prefix_cache = reset_prefix_cache
        super().__init__(
            None if llm is None else self._call_workers,
            start_workers=None if llm is None else on_a_thread(self._rpc_unbounded),
            ignored=ignored_by_engine,
            after_weights_written=self._after_weights_written,
            **options,
        )

    def _rpc_unbounded(self, method: str, *args: Any) -> list:
        """Unbounded: the workers' side of the join and the receive, ended by the protocol's own timeouts."""
        return self.llm.collective_rpc(method, args=args)


def prompt_logprobs(llm: Any, prompts: list[list[int]], lora_request: Any = None) -> list[list[float]]:
    """vLLM's log-probability of every prompt token after the first, for each prompt (token ids),
    computed by the engine itself (greedy, one generated token), with ``lora_request``'s adapter if given."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    adapter = {} if lora_request is None else {"lora_request": lora_request}
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False, **adapter)
    result = []
    for ids, output in zip(prompts, outputs):
        steps = output.prompt_logprobs[1:]
        result.append([step[token].logprob if step and token in step else None for token, step in zip(ids[1:], steps)])
    return result
