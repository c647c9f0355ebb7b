"""vLLM's LoRA slots fed from memory: the engine side of an adapter refit (imports vLLM when called).

vLLM 0.26 loads an adapter only from a directory (``LRUCacheWorkerLoRAManager.add_adapter`` ->
``_load_adapter``: ``PEFTHelper.from_local_dir`` and ``LoRAModel.from_local_checkpoint``, which reads
``adapter_model.safetensors`` into CPU tensors and hands them to ``LoRAModel.from_lora_tensors``).
``load_adapter`` runs the same steps from tensors in memory, every step under one adapter id:

1. ``PEFTHelper.from_dict`` of the config, with the engine's ``max_position_embeddings`` as
   ``from_local_dir`` adds it, and ``validate_legal`` against the engine's ``LoRAConfig``;
2. the factors copied to host memory (what ``safe_open(...).get_tensor`` gives the disk path: CPU
   tensors of the stored dtype, the same bytes), their modules checked as ``from_local_checkpoint``
   checks them (``parse_fine_tuned_lora_name`` with the model's unstacked ``hf_to_vllm_mapper``) and
   also against the modules vLLM actually wrapped (an adapter module outside them would be dropped);
3. ``LoRAModel.from_lora_tensors`` with the arguments ``_load_adapter`` passes (``device="cpu"``,
   ``lora_dtype``, vocabulary size, mapper, skip prefixes);
4. what ``add_adapter`` does for a request with ``load_inplace``: remove the adapter of that id (which
   frees its slot), evict the oldest if the cache is full, ``add_adapter`` (packing q/k/v and gate/up,
   scaling B: ``_create_merged_loras_inplace``, on the host, as for the disk path), ``activate_adapter``
   (``set_lora`` of every wrapped module into the freed GPU slot); then ``pin_adapter``, so that vLLM
   never evicts it and never tries to reload it from its placeholder path.

From the same bytes through the same code, the slot holds what loading the adapter from its PEFT
directory would put there. The base weights are not touched.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mbridge_refit.engines.adapter import AdapterLimits, AdapterRefusedError, unplaced

__all__ = ["adapter_limits", "load_adapter"]


def adapter_limits(worker_manager: Any) -> AdapterLimits:
    """What the engine's LoRA support takes (``LRUCacheWorkerLoRAManager``: the model runner's
    ``lora_manager``): ``max_lora_rank``, ``max_loras`` and the modules it wrapped, packed ones by
    their constituents (``model_manager.py`` ``modules`` and ``packed_modules``)."""
    manager = worker_manager._adapter_manager
    modules = set(manager.modules)
    for constituents in manager.packed_modules.values():
        modules.update(constituents)
    config = worker_manager.lora_config
    return AdapterLimits(max_rank=int(config.max_lora_rank), slots=int(config.max_loras), modules=frozenset(modules))


def load_adapter(
    worker_manager: Any, tensors: dict[str, torch.Tensor], *, lora_int_id: int, config: dict[str, Any]
) -> dict[str, Any]:
    """Build the adapter of ``tensors`` (PEFT names -> factors, any device) as vLLM builds it from disk,
    and put it under ``lora_int_id`` in place of the previous one (module docstring); returns
    ``{ms, modules, slot, phases_ms}`` (``phases_ms``: the time of each step above, by name)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    clock = _PhaseClock()
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings})
    helper.validate_legal(worker_manager.lora_config)
    manager = worker_manager._adapter_manager
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_unstacked_mapper() if mapper is not None else None
    host = {name: tensor.to("cpu") for name, tensor in tensors.items()}  # the bytes safetensors would give
    clock.lap("to_host")
    modules = {parse_fine_tuned_lora_name(name, mapper)[0] for name in host}
    missing = unplaced(modules, adapter_limits(worker_manager))
    if missing:
        raise AdapterRefusedError(
            f"{len(missing)} adapter module(s) that no LoRA module of the engine takes, e.g. {missing[:3]} "
            "(vLLM would drop them): adapt only the modules the engine wraps, or start it with them"
        )
    clock.lap("check")
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_int_id,
        tensors=host,
        peft_helper=helper,
        device="cpu",
        dtype=worker_manager.lora_config.lora_dtype,
        model_vocab_size=worker_manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = False
    clock.lap("build")
    manager.remove_adapter(lora.id)
    if len(manager) + 1 > manager.capacity:
        manager.remove_oldest_adapter()
    clock.lap("remove")
    manager.add_adapter(lora)
    clock.lap("add")
    manager.activate_adapter(lora.id)
    manager.pin_adapter(lora.id)
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # the slot holds the adapter when the RPC returns
    clock.lap("activate")
    return {
        "ms": clock.total_ms(),
        "modules": len(modules),
        "slot": manager.lora_index_to_id.index(lora.id),
        "phases_ms": clock.laps,
    }


class _PhaseClock:
    """Milliseconds per named phase of one load, in order (where a step's time goes)."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round((now - self.last) * 1e3, 3)
        self.last = now

    def total_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1e3
