"""The vLLM adapter's LoRA refit, trainer side: ``VLLMAdapterRefit`` (transport ``adapter_ipc``).

A vLLM ``LLM`` started with ``enable_lora=True`` (``max_lora_rank`` at least the adapter's rank) and the
worker extension (``engine_kwargs()``) on the trainer rank's GPU serves the trainer's LoRA adapter under
one name and id; each ``refit`` replaces that adapter's factors in its GPU slot with the trainer's
current ones, the base weights untouched. Generate with ``llm.generate(..., lora_request=refit.lora_request)``.

One step: ``export_adapter_weights(model, cpu=False, reuse_buffer_from_cache=True)`` (the factors as
views of the adapter parameters or held buffers, the same storages every step); the first step, or one
whose factors moved, shares them by CUDA IPC (``engines.lora.ipc``); then one RPC has every worker
build the adapter from them as vLLM builds it from its PEFT directory and put it in place of the previous
one (``engines.vllm.lora``). Before anything moves, the adapter is checked against what the engine
reported it takes (``engines.lora.adapter.check_adapter``: rank, per-module ranks, experts, factor shapes;
the engine also refuses modules it did not wrap). After the load the engine's prefix cache is reset:
vLLM keys cached prompt blocks by the adapter's name, which stays, so without the reset a prompt seen
before the refit would reuse blocks computed with the old adapter.

What it costs per step: the factors' bytes copied device to host and back into the slot (vLLM keeps
adapters in host memory and fills slots from there), no file written or read, no base weight moved.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mbridge_refit.engines.base import RPC_VERSION, RefitStep
from mbridge_refit.engines.ipc.sharing import CudaIpcTransport, Transport
from mbridge_refit.engines.lora.adapter import AdapterLimits, adapter_config, check_adapter
from mbridge_refit.engines.lora.ipc import AdapterShare
from mbridge_refit.engines.vllm.trainer import reset_prefix_cache
from mbridge_refit.errors import EngineError, InputError
from mbridge_refit.runtime.weight_source import ExportsWeights, Model
from mbridge_refit.sinks.base import DiscardSink, drain

__all__ = ["PLACEHOLDER_PATH", "VLLMAdapterRefit"]

PLACEHOLDER_PATH = "mbridge-refit://{name}"  # the request's lora_path: no directory; vLLM never reads it (pinned)


class VLLMAdapterRefit:
    """A LoRA adapter refit session from this trainer process into one vLLM ``LLM`` on the same GPU.

    ``lora_name`` / ``lora_int_id``: the adapter's name and id in the engine (the same every step).
    ``reset_prefix_cache``: drop the engine's cached prompt blocks after each refit (module docstring).
    Every other rank of the model's groups calls ``refit(..., sender=False)`` (the export is collective).
    """

    def __init__(
        self,
        llm: Any,
        *,
        lora_name: str = "mbridge-refit",
        lora_int_id: int = 1,
        transport: Transport | None = None,
        reset_prefix_cache: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        if lora_int_id < 1:
            raise InputError(f"lora_int_id must be 1 or more (vLLM's ids), got {lora_int_id}")
        self.llm = llm
        self.lora_name, self.lora_int_id = lora_name, lora_int_id
        self.share = AdapterShare(transport or CudaIpcTransport())
        self.reset_prefix_cache = reset_prefix_cache
        self.timeout_s = timeout_s
        self._limits: AdapterLimits | None = None
        self._config: dict[str, Any] | None = None
        self.loaded = False

    @property
    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` of the refit adapter, for ``llm.generate``."""
        if not self.loaded:
            raise EngineError("no adapter was refit into the engine yet: call refit() first")
        from vllm.lora.request import LoRARequest

        path = PLACEHOLDER_PATH.format(name=self.lora_name)
        return LoRARequest(lora_name=self.lora_name, lora_int_id=self.lora_int_id, lora_path=path)

    def open(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None, sender: bool = True) -> None:
        """The adapter's facts (collective on the first call for a model: the adapters' plan) and, on the
        sender, what the engine takes. Optional: ``refit`` does it too."""
        self._prepare(bridge, model, fp8, sender)

    def _prepare(self, bridge: ExportsWeights, model: Model, fp8: Any, sender: bool) -> dict[str, Any]:
        _refuse_fp8(fp8)
        facts = _facts(bridge, model)
        self._config = adapter_config(facts)
        if sender and self._limits is None:
            self._limits = AdapterLimits.from_wire(self._rpc("mbridge_refit_adapter_limits"))
        return facts

    def refit(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None, sender: bool = True) -> RefitStep | None:
        """Export the adapter's factors and put them in the engine's slot in place of the previous ones.
        Returns the step on the sender (None on the others)."""
        started = time.perf_counter()
        facts = self._prepare(bridge, model, fp8, sender)
        stream = bridge.export_adapter_weights(model, cpu=False, show_progress=False, reuse_buffer_from_cache=True)
        if not sender:
            drain(stream, DiscardSink())
            return None
        factors = [(name, tensor) for name, tensor in stream]
        check_adapter({name: tuple(tensor.shape) for name, tensor in factors}, facts, self._limits)
        payload = self.share.record(factors)
        if torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()  # the engine reads from another process
        exported = time.perf_counter()
        layout = self.share.layout
        report = None
        if payload is not None:
            report = self._rpc(
                "mbridge_refit_adapter_open", layout.to_wire(), payload, self.share.transport.name, RPC_VERSION
            )
        loaded = self._rpc("mbridge_refit_adapter_load", layout.fingerprint, self.lora_int_id, self._config)
        self.loaded = True
        if self.reset_prefix_cache:
            reset_prefix_cache(self.llm, "adapter")
        done = time.perf_counter()
        return RefitStep(
            tensors=len(layout.refs),
            bytes=layout.nbytes,
            ms=(done - started) * 1e3,
            opened=payload is not None,
            report=report,
            export_ms=(exported - started) * 1e3,
            apply_ms=(done - exported) * 1e3,
            engine_ms=loaded["ms"],
            workers=[loaded],
        )

    def close(self) -> None:
        """Tell the engine to forget the mapped factors (the adapter stays in its slot), then release them."""
        if self.share.layout is not None:
            self._rpc("mbridge_refit_adapter_close")
        self.share.release()

    def _rpc(self, method: str, *args: Any) -> Any:
        results = self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)
        return results[0] if results else None


def _facts(bridge: ExportsWeights, model: Model) -> dict[str, Any]:
    facts = getattr(bridge, "adapter_facts", None)
    if facts is None:
        raise InputError(f"{type(bridge).__name__} has no adapter_facts: an adapter refit needs a RefitBridge")
    return facts(model)


def _refuse_fp8(fp8: Any) -> None:
    if fp8 is not None:
        raise InputError(f"an adapter refit moves the LoRA factors as trained; fp8={fp8!r} applies to base weights")
