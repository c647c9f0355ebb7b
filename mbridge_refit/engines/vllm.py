"""Refit a vLLM engine from the trainer's process: colocated, by CUDA IPC, every step.

The engine maps the trainer's exported tensors (the parameters and the export's held buffers,
``engines.sharing``) and applies them with the copies its own ``load_weights`` makes, recorded
on the first step (``engines.apply_plan``). Per step: the trainer's export fills its buffers, one
RPC tells every worker to replay, the RPC returns when the engine's parameters hold the new
weights. No bytes are packed or staged, nothing is allocated after the first step on either side.

Who calls what:

* Start the engine with ``LLM(..., **engine_kwargs())`` (adds the worker extension).
* On the trainer rank that shares the engine's GPU: ``refit = VLLMRefit(llm)``, then each step
  ``refit.refit(bridge, model)`` (or ``fp8="blockwise"`` for an engine started from an FP8
  blockwise config). Every other rank of the model's groups must iterate the same export (it is
  collective) and drop the tensors: ``refit.refit(..., sender=False)`` does that.
* ``refit.close()`` before the trainer frees the model or the bridge's buffers.

Scope today: one trainer rank feeds one engine worker on its GPU (engine tensor parallel size 1);
the engine process must not be the trainer's own (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs it
inside; then pass ``transport=LocalTransport()``). Every call is bounded by ``timeout_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mbridge_refit.engines.sharing import CudaIpcTransport, LayoutRecorder, SharedLayout, Transport
from mbridge_refit.engines.vllm_worker import WORKER_EXTENSION
from mbridge_refit.sinks.base import DiscardSink, drain

logger = logging.getLogger(__name__)

Stream = Iterable[tuple[str, torch.Tensor]]


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that a refit target needs (the worker extension)."""
    return {"worker_extension_cls": WORKER_EXTENSION, **overrides}


TIED_OUTPUT_NAMES = ("lm_head.weight",)  # what an engine skips when its config ties embeddings


def ignored_by_engine(bridge: Any) -> frozenset[str]:
    """Exported names an engine started from ``bridge``'s HF config skips by design: the output
    layer when the config ties it to the embedding (vLLM then never loads it)."""
    config = getattr(bridge.hf_pretrained, "config", None) or bridge.hf_pretrained
    return frozenset(TIED_OUTPUT_NAMES) if getattr(config, "tie_word_embeddings", False) else frozenset()


@dataclass
class RefitStep:
    """One refit: ``opened`` when the layout was (re)shared this step, with the engine's report."""

    tensors: int
    bytes: int
    opened: bool
    export_ms: float
    apply_ms: float
    report: dict[str, Any] | None = None


class VLLMRefit:
    """A refit session from this trainer process into one vLLM ``LLM`` on the same GPU.

    ``check_first_refit``: the engine proves its recorded copies against its own loader on every
    open (costs one more pass over the weights, once). ``allow_partial``: accept an export that
    leaves engine parameters unwritten or has tensors the engine does not load (a subset refit).
    """

    def __init__(
        self, llm: Any, *, transport: Transport | None = None, check_first_refit: bool = True,
        allow_partial: bool = False, timeout_s: float = 600.0,
    ) -> None:
        self.llm = llm
        self.transport = transport or CudaIpcTransport()
        self.check_first_refit = check_first_refit
        self.allow_partial = allow_partial
        self.timeout_s = timeout_s
        self._layout: SharedLayout | None = None
        self._key: tuple | None = None
        self._held: list = []  # storages the engine maps: kept alive while it may read them
        self._payload: bytes | None = None
        self.last_report: dict[str, Any] | None = None

    def refit(
        self, bridge: Any, model: Any, *, fp8: Any = None, sender: bool = True, through: Callable[[Stream], Stream] | None = None
    ) -> RefitStep | None:
        """Export ``model`` with ``bridge`` (held cached buffers) and apply it to the engine.

        Collective like ``export_hf_weights``: every rank of the model's groups calls it; the
        ranks with ``sender=False`` only iterate. ``through`` wraps the sender's stream (e.g. a
        check that alters a tensor on its way). Returns the step on the sender."""
        started = time.perf_counter()
        stream = bridge.export_hf_weights(
            model, reuse_buffer_from_cache=True, hold_outputs=True, fp8=fp8, show_progress=False
        )
        if not sender:
            drain(stream, DiscardSink())
            return None
        ignored = ignored_by_engine(bridge)
        if ignored:
            stream = ((name, tensor) for name, tensor in stream if name not in ignored)
        if through is not None:
            stream = through(stream)
        return self.refit_stream(stream, started=started)

    def refit_stream(self, stream: Stream, *, started: float | None = None) -> RefitStep:
        """Apply ``stream`` (``(hf_name, tensor)`` on this GPU, each valid until the stream ends)."""
        started = time.perf_counter() if started is None else started
        recorder = LayoutRecorder()
        needs_cuda = isinstance(self.transport, CudaIpcTransport)
        for name, tensor in stream:
            if needs_cuda and tensor.device.type != "cuda":
                raise ValueError(f"{name} is on {tensor.device}: CUDA IPC shares GPU memory (export with cpu=False)")
            recorder.add(name, tensor)
        if torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the engine reads from another process
        exported = time.perf_counter()
        if self._layout is not None and recorder.key == self._key:
            self._rpc("mbridge_refit_apply", self._layout.fingerprint)
            report, opened = None, False
        else:
            report, opened = self._open(recorder), True
        done = time.perf_counter()
        return RefitStep(tensors=len(self._layout.refs), bytes=self._layout.nbytes, opened=opened,
                         export_ms=(exported - started) * 1e3, apply_ms=(done - exported) * 1e3, report=report)

    def _open(self, recorder: LayoutRecorder) -> dict[str, Any]:
        if self._layout is not None:
            logger.info("refit: the export's layout changed (other storages or tensors): sharing it anew")
        layout, storages = recorder.layout()
        payload = self.transport.share(storages)
        report = self._rpc("mbridge_refit_open", layout.to_wire(), payload, self.transport.name,
                           self.check_first_refit, self.allow_partial)
        self._release_payload()
        self._layout, self._key, self._held, self._payload = layout, recorder.key, storages, payload
        self.last_report = report
        return report

    def fingerprints(self) -> dict[str, tuple[int, int]]:
        """The engine's exact per-parameter fingerprints (first worker)."""
        return {name: tuple(fp) for name, fp in self._rpc("mbridge_refit_fingerprints").items()}

    def close(self) -> None:
        """Tell the engine to forget the mapped tensors, then release them."""
        if self._layout is not None:
            self._rpc("mbridge_refit_close")
        self._release_payload()
        self._layout, self._key, self._held = None, None, []

    def _release_payload(self) -> None:
        release = getattr(self.transport, "release", None)
        if release is not None and self._payload is not None:
            release(self._payload)  # the in-process transport keeps storages until told
        self._payload = None

    def _rpc(self, method: str, *args: Any) -> Any:
        results = self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)
        return results[0] if results else None


def prompt_logprobs(llm: Any, prompts: list[list[int]]) -> list[list[float]]:
    """vLLM's log-probability of every prompt token after the first, for each prompt (token ids),
    computed by the engine itself (greedy, one generated token)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    result = []
    for ids, output in zip(prompts, outputs):
        steps = output.prompt_logprobs[1:]
        result.append([step[token].logprob if step and token in step else None for token, step in zip(ids[1:], steps)])
    return result
