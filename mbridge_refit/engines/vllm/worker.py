"""The vLLM adapter's engine side: the worker extension vLLM loads, an ``engines.base.RefitWorker``.

vLLM mixes ``RefitWorkerExtension`` into its GPU worker when the engine is started with
``worker_extension_cls=WORKER_EXTENSION`` (``engines.vllm.engine_kwargs()`` sets it). The trainer's
sessions (``engines.vllm.trainer``) call its methods through ``LLM.collective_rpc`` on every
worker, each named ``mbridge_refit_<verb>``; arguments and results are plain data (msgpack).
Each RPC hands over to a transport's engine side: ``open`` / ``apply`` / ``close`` to
``engines.ipc.engine.RefitReceiver`` (colocated, CUDA IPC), as do ``open_shards`` / ``apply_shards``
(colocated at engine TP > 1: the worker's own entry, ``engines.ipc.sharded``), ``join`` / ``receive`` / ``leave`` to
``engines.broadcast.engine.BroadcastTarget`` (other GPUs, the packed broadcast), ``adapter_limits`` /
``adapter_open`` / ``adapter_load`` / ``adapter_close`` to ``engines.lora.ipc.AdapterReceiver`` and
``engines.vllm.lora`` (a LoRA adapter into vLLM's slot, the base untouched); ``fingerprints`` reads
the engine's weights exactly. The GPU checks' and benchmarks' own RPCs (scramble, time, memory)
live in a subclass in the test support (``testing.vllm_worker``). It imports vLLM only for its layerwise reload
(the bracket an FP8 engine is recorded through) and its attention layers (whose parameters derived after loading,
such as MLA's ``W_UV``/``W_UK_T``, the receiver has recomputed after each replay); DeepGEMM's processing of FP8
layers is redone after each replay, or refused by name at the open, by ``engines.vllm.deep_gemm``. The worker
provides ``self.model_runner`` and ``self.device``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mbridge_refit.engines.base import check_rpc_version
from mbridge_refit.engines.broadcast.engine import BroadcastTarget
from mbridge_refit.engines.ipc.engine import RefitReceiver
from mbridge_refit.engines.ipc.sharded import worker_entry
from mbridge_refit.engines.lora.ipc import AdapterReceiver
from mbridge_refit.engines.replay.apply_plan import Recompute, StagedLoad
from mbridge_refit.engines.replay.fingerprint import fingerprints_to_wire, named_fingerprints
from mbridge_refit.engines.vllm.deep_gemm import refuse_unsupported, reprocess
from mbridge_refit.engines.vllm.lora import AdapterSlot, adapter_limits
from mbridge_refit.errors import EngineError

__all__ = ["WORKER_EXTENSION", "RefitWorkerExtension"]

WORKER_EXTENSION = "mbridge_refit.engines.vllm.worker.RefitWorkerExtension"  # vLLM's worker_extension_cls


class RefitWorkerExtension:
    """Refit methods on a vLLM worker (each runs on every worker of the engine)."""

    def _mbridge_receiver(self) -> RefitReceiver:
        receiver = getattr(self, "_mbridge_refit_receiver", None)
        if receiver is None:
            model = self.model_runner.get_model()
            receiver = RefitReceiver(
                model,
                torch.device(self.device),
                staged=self._mbridge_staged_load(model),
                recompute=self._mbridge_recompute(),
                precheck=functools.partial(refuse_unsupported, model),
            )
            self._mbridge_refit_receiver = receiver
        return receiver

    def _mbridge_staged_load(self, model: torch.nn.Module) -> StagedLoad | None:
        """vLLM's layerwise reload as the receiver's reload bracket (None where this vLLM has none)."""
        try:
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )
        except ImportError:
            return None
        config = self.model_runner.model_config
        return StagedLoad(
            begin=lambda: initialize_layerwise_reload(model), end=lambda: finalize_layerwise_reload(model, config)
        )

    def _mbridge_recompute(self) -> Recompute:
        """vLLM's own recomputation of a module's derived or processed parameters: its attention layers
        (``Attention``, ``MLAAttention``, where this vLLM has them) run ``process_weights_after_loading(
        model_config.dtype)`` after every reload with their kernel tensors in place
        (``model_loader/reload/layerwise.py`` ``_finalize_attention_layer``); a DeepGEMM linear layer runs its
        processing again on the bytes the replay copied (``engines.vllm.deep_gemm.reprocess``); other layers
        have none."""
        try:
            from vllm.model_executor.layers.attention import Attention, MLAAttention
        except ImportError:
            attention: tuple[type, ...] = ()
        else:
            attention = (Attention, MLAAttention)

        def recompute(module: torch.nn.Module):
            if attention and isinstance(module, attention):
                return functools.partial(module.process_weights_after_loading, self.model_runner.model_config.dtype)
            return reprocess(module)

        return recompute

    def mbridge_refit_open(
        self,
        wire: dict,
        payload: bytes,
        transport: str,
        check: bool,
        allow_partial: bool,
        completion: bool = False,
        go_ahead: dict | None = None,
        rpc_version: int | None = None,
    ) -> dict:
        """Map the trainer's tensors, load them once through the model's ``load_weights`` while
        recording its copies, optionally prove the recording; returns the open report (with
        ``completion``, the handle of the event later applies record: ``engines.ipc.completion``; with
        ``go_ahead``, connected to the trainer's line for early applies: ``engines.ipc.go_ahead``).
        ``rpc_version``: the trainer's ``engines.base.RPC_VERSION``, checked first."""
        check_rpc_version(rpc_version, "open")
        return self._mbridge_receiver().open(
            wire, payload, transport, check=check, allow_partial=allow_partial, completion=completion, go_ahead=go_ahead
        )

    def mbridge_refit_apply(self, fingerprint: str, signal: bool = False, go: int | None = None) -> float | None:
        """Replay the recorded copies from the trainer's (now updated) tensors; returns when done, or,
        with ``signal`` on a layout opened with ``completion``, once they are launched (the trainer
        waits on the event); with the milliseconds the worker spent (the rest of the call's time is
        the RPC's). ``go``: an early apply's step number: the worker waits for the trainer's go-ahead
        (None returned when told to skip)."""
        return self._mbridge_receiver().apply(fingerprint, signal=signal, go=go)

    def mbridge_refit_open_shards(
        self,
        wires: list,
        payloads: list,
        transport: str,
        check: bool,
        allow_partial: bool,
        rpc_version: int | None = None,
    ) -> dict:
        """Open this worker's entry of a sharded refit (``engines.ipc.sharded``): its engine rank is
        its tensor-parallel rank (``_worker_index``), its shards are the trainer rank's on its GPU."""
        check_rpc_version(rpc_version, "open_shards")
        rank = _worker_index(self)
        wire, payload = worker_entry(wires, rank, "shard layout"), worker_entry(payloads, rank, "shard payload")
        return self._mbridge_receiver().open(wire, payload, transport, check=check, allow_partial=allow_partial)

    def mbridge_refit_apply_shards(self, fingerprints: list) -> float:
        """Replay this worker's sharded refit from its (now updated) shards."""
        return self._mbridge_receiver().apply(worker_entry(fingerprints, _worker_index(self), "layout fingerprint"))

    def mbridge_refit_close(self) -> None:
        """Forget the open layout and the mapped storages (the trainer's session closes)."""
        self._mbridge_receiver().close()

    def mbridge_refit_join(
        self, group: dict, rank_offset: int, allow_partial: bool, rpc_version: int | None = None
    ) -> int:
        """Join the trainer's broadcast group (``group``: ``BroadcastTarget.join``'s keyword arguments
        but ``rank``) as rank ``rank_offset`` + this worker's index among the engine's workers
        (data-parallel replicas included); returns that rank. Blocks until the trainer joins
        (``engines.broadcast.engine``)."""
        check_rpc_version(rpc_version, "join")
        model = self.model_runner.get_model()
        target = BroadcastTarget(
            model.load_weights,
            model,
            torch.device(self.device),
            staged=self._mbridge_staged_load(model) if _quantized(self) else None,
            allow_partial=allow_partial,
        )
        rank = rank_offset + _worker_index(self)
        target.join(rank=rank, **group)
        self._mbridge_broadcast_target = target
        return rank

    def mbridge_refit_receive(self) -> dict:
        """Receive one refit from the trainer and load it; returns the worker's report."""
        target = getattr(self, "_mbridge_broadcast_target", None)
        if target is None:
            raise RuntimeError("no broadcast refit was joined on this worker: call mbridge_refit_join first")
        return target.receive()

    def mbridge_refit_leave(self) -> None:
        """Leave the broadcast group (the trainer's session closes)."""
        target = getattr(self, "_mbridge_broadcast_target", None)
        if target is not None:
            target.close()
        self._mbridge_broadcast_target = None

    def mbridge_refit_adapter_limits(self) -> dict:
        """What this engine's LoRA slots take (``engines.lora.adapter.AdapterLimits`` as plain data)."""
        return adapter_limits(_lora_manager(self)).to_wire()

    def mbridge_refit_adapter_open(
        self, wire: dict, payload: bytes, transport: str, rpc_version: int | None = None
    ) -> dict:
        """Map the trainer's adapter factors (``engines.lora.ipc``); returns what was mapped."""
        check_rpc_version(rpc_version, "adapter_open")
        _lora_manager(self)
        receiver = getattr(self, "_mbridge_adapter_receiver", None) or AdapterReceiver(torch.device(self.device))
        self._mbridge_adapter_receiver = receiver
        return receiver.open(wire, payload, transport)

    def mbridge_refit_adapter_load(self, fingerprint: str, lora_int_id: int, config: dict) -> dict:
        """Load this step's factors into the adapter ``lora_int_id``'s slot in place of the previous ones
        (``engines.vllm.lora.AdapterSlot``: built as from disk, then refilled); returns when the slot holds them."""
        receiver = getattr(self, "_mbridge_adapter_receiver", None) or AdapterReceiver(torch.device(self.device))
        tensors = receiver.tensors(fingerprint)
        slots = getattr(self, "_mbridge_adapter_slots", None)
        if slots is None:
            slots = self._mbridge_adapter_slots = {}  # one per adapter id: sessions of several ids each refill
        slot = slots.get(lora_int_id) or slots.setdefault(lora_int_id, AdapterSlot(_lora_manager(self)))
        return slot.load(tensors, lora_int_id=lora_int_id, config=config)

    def mbridge_refit_adapter_close(self) -> None:
        """Forget the mapped adapter factors (the adapter stays in its slot)."""
        receiver = getattr(self, "_mbridge_adapter_receiver", None)
        if receiver is not None:
            receiver.close()

    def mbridge_refit_fingerprints(self) -> dict:
        """``{parameter name: [sum, weighted sum]}`` of every model parameter (exact), in
        ``engines.replay.fingerprint.fingerprints_to_wire``'s versioned reply."""
        model = self.model_runner.get_model()
        return fingerprints_to_wire(named_fingerprints(model.named_parameters()))


def _worker_index(worker: Any) -> int:
    """This worker's index among all workers of the engine: data-parallel replica, then its rank
    within the replica (as vLLM's own weight transfer numbers them); 0 without a parallel config."""
    config = getattr(worker, "parallel_config", None)
    if config is None:
        return 0
    return config.data_parallel_index * config.world_size + config.rank


def _lora_manager(worker: Any) -> Any:
    """The worker's LoRA manager (vLLM's ``LoRAModelRunnerMixin.lora_manager``); refused by name when the
    engine was started without LoRA."""
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise EngineError("the engine was started without LoRA: start it with enable_lora=True (and max_lora_rank)")
    return manager


def _quantized(worker: Any) -> bool:
    """Whether the engine's model is quantized (its loaders then run inside vLLM's layerwise reload)."""
    model_config = getattr(getattr(worker, "model_runner", None), "model_config", None)
    return getattr(model_config, "quantization", None) is not None
