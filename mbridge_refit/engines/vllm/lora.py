"""vLLM's LoRA slots fed from memory: the engine side of an adapter refit (imports vLLM when called).

vLLM 0.26 loads an adapter only from a directory (``LRUCacheWorkerLoRAManager.add_adapter`` ->
``_load_adapter``: ``PEFTHelper.from_local_dir`` and ``LoRAModel.from_local_checkpoint``, which reads
``adapter_model.safetensors`` into CPU tensors and hands them to ``LoRAModel.from_lora_tensors``).
``AdapterSlot`` keeps one adapter id filled from tensors in memory, every step, in one of two ways.

**Build** (the first load, and any load the refill below does not take; the report names why):

1. ``PEFTHelper.from_dict`` of the config, with the engine's ``max_position_embeddings`` as
   ``from_local_dir`` adds it, and ``validate_legal`` against the engine's ``LoRAConfig``;
2. the factors copied to host memory (what ``safe_open(...).get_tensor`` gives the disk path: CPU
   tensors of the stored dtype, the same bytes), their modules checked as ``from_local_checkpoint``
   checks them (``parse_fine_tuned_lora_name`` with the model's unstacked ``hf_to_vllm_mapper``) and
   also against the modules vLLM actually wrapped (an adapter module outside them would be dropped);
3. ``LoRAModel.from_lora_tensors`` with the arguments ``_load_adapter`` passes (``device="cpu"``,
   ``lora_dtype``, vocabulary size, mapper, skip prefixes), which pins each factor in host memory;
4. what ``add_adapter`` does for a request with ``load_inplace``: remove the adapter of that id (which
   frees its slot), evict the oldest if the cache is full, ``add_adapter`` (packing q/k/v and gate/up,
   scaling B: ``_create_merged_loras_inplace``, on the host, as for the disk path), ``activate_adapter``
   (``set_lora`` of every wrapped module into the freed GPU slot); then ``pin_adapter``, so that vLLM
   never evicts it and never tries to reload it from its placeholder path. A failure part way removes
   the adapter: a half-written slot never serves a request.

**Refill** (every later load of the same id, config, factor names, shapes and dtypes, while vLLM still
holds the adapter built): the built adapter's own pinned host tensors, the ones ``activate_adapter``
hands to ``set_lora``, are overwritten with this step's factors; each B is multiplied by its module's
scaling with the in-place host op ``LoRALayerWeights.optimize`` uses (``lora_b *= scaling``); vLLM's own
``deactivate_adapter`` / ``activate_adapter`` / ``pin_adapter`` then copy them into the slot. Nothing is
constructed, packed or pinned anew. The build records a refill only when it is faithful: while it
activates, every module's ``set_lora`` is watched, and the tensors handed to it must be exactly the
host tensors the factors map to (one each, of the factor's shape and dtype). An adapter whose activation
reads anything else (MoE experts that vLLM stacks into new tensors, a factor cast to another
``lora_dtype``) stays on the build path, and each report says why.

Either way the host tensors and the slot hold what loading the adapter from its PEFT directory would
put there: the same bytes through the same operations. The base weights are not touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mbridge_refit.engines.lora.adapter import AdapterLimits, AdapterRefusedError, unplaced

__all__ = [
    "FIRST_LOAD",
    "AdapterSlot",
    "PhaseClock",
    "activate_watched",
    "adapter_limits",
    "install",
    "refill_from_activation",
]

FIRST_LOAD = "the first load of this id"


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


class AdapterSlot:
    """One adapter id of one vLLM worker, loaded each step from the trainer's factors (module docstring).

    Called by the worker extension's ``mbridge_refit_adapter_load`` RPC, on every worker, one step at a
    time. ``tensors`` (PEFT names -> factors, any device) are only read during ``load``; the caller may
    overwrite them once it returns.
    """

    def __init__(self, worker_manager: Any) -> None:
        self.worker_manager = worker_manager
        self.refill: _Refill | None = None
        self.refill_refused = FIRST_LOAD

    def load(self, tensors: dict[str, torch.Tensor], *, lora_int_id: int, config: dict[str, Any]) -> dict[str, Any]:
        """Put ``tensors`` under ``lora_int_id`` in place of the previous factors; returns ``{ms, path,
        modules, slot, phases_ms}`` (``path``: ``refill`` or ``build``; a build also names ``why``)."""
        manager = self.worker_manager._adapter_manager
        why = self._why_not_refill(manager, tensors, lora_int_id, config)
        if why is None:
            assert self.refill is not None
            report = self.refill.run(manager, tensors)
        else:
            report, self.refill, self.refill_refused = _build(self.worker_manager, tensors, lora_int_id, config)
            report["why"] = why
        report["slot"] = manager.lora_index_to_id.index(lora_int_id)
        return report

    def _why_not_refill(
        self, manager: Any, tensors: dict[str, torch.Tensor], lora_int_id: int, config: dict
    ) -> str | None:
        refill = self.refill
        if refill is None:
            return self.refill_refused
        if lora_int_id != refill.lora_int_id:
            return f"another adapter id ({lora_int_id}, built {refill.lora_int_id})"
        if config != refill.config:
            return "the adapter's config changed"
        if _layout(tensors) != refill.layout:
            return "the factors' names, shapes or dtypes changed"
        if manager.get_adapter(lora_int_id) is not refill.built:
            return "vLLM no longer holds the adapter this slot built"
        return None


def _build(
    worker_manager: Any, tensors: dict[str, torch.Tensor], lora_int_id: int, config: dict[str, Any]
) -> tuple[dict[str, Any], _Refill | None, str]:
    """vLLM's construction of the adapter from ``tensors`` (module docstring, steps 1-4); returns the
    report, the refill recorded from the activation (None if it would not be faithful) and why not."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    clock = PhaseClock()
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": worker_manager.max_position_embeddings})
    helper.validate_legal(worker_manager.lora_config)
    manager = worker_manager._adapter_manager
    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_unstacked_mapper() if mapper is not None else None
    # the bytes safetensors would give, in tensors of their own (vLLM scales B in place; never the caller's)
    host = {name: tensor.to("cpu", copy=True) for name, tensor in tensors.items()}
    clock.lap("to_host")
    modules = {name: parse_fine_tuned_lora_name(name, mapper) for name in host}
    missing = unplaced({module for module, _ in modules.values()}, adapter_limits(worker_manager))
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
    scaling = {module: weights.scaling for module, weights in lora.loras.items()}  # before add_adapter folds it
    clock.lap("build")
    read = install(manager, lora, clock)
    refill, refused = refill_from_activation(
        manager, lora, tensors, modules, scaling, read, lora_int_id=lora_int_id, config=config
    )
    report = {"ms": clock.total_ms(), "path": "build", "modules": len(lora.loras), "phases_ms": clock.laps}
    return report, refill, refused


def install(manager: Any, lora: Any, clock: PhaseClock) -> list[torch.Tensor]:
    """What ``add_adapter`` does for a ``load_inplace`` request (module docstring, step 4), then pin; returns
    what the activation read. A failure part way removes the adapter: a half-written slot never serves."""
    manager.remove_adapter(lora.id)
    if len(manager) + 1 > manager.capacity:
        manager.remove_oldest_adapter()
    clock.lap("remove")
    try:
        manager.add_adapter(lora)
        clock.lap("add")
        read = activate_watched(manager, lora.id)
        manager.pin_adapter(lora.id)
    except BaseException:
        manager.remove_adapter(lora.id)
        raise
    _synchronize()  # the slot holds the adapter when the RPC returns
    clock.lap("activate")
    return read


def activate_watched(manager: Any, lora_id: int) -> list[torch.Tensor]:
    """``manager.activate_adapter(lora_id)``, returning every tensor its modules' ``set_lora`` were handed."""
    read: list[torch.Tensor] = []
    modules = list(manager.modules.values())
    for module in modules:
        module.set_lora = _watching(module.set_lora, read)  # an instance attribute shadows the method
    try:
        manager.activate_adapter(lora_id)
    finally:
        for module in modules:
            del module.set_lora
    return read


def _watching(set_lora: Any, read: list[torch.Tensor]) -> Any:
    def watched(index: int, lora_a: Any, lora_b: Any, *args: Any, **kwargs: Any) -> Any:
        for factors in (lora_a, lora_b):
            read.extend(f for f in (factors if isinstance(factors, (list, tuple)) else [factors]) if f is not None)
        return set_lora(index, lora_a, lora_b, *args, **kwargs)

    return watched


@dataclass(frozen=True)
class _Factor:
    name: str
    host: torch.Tensor  # the built adapter's host tensor that set_lora reads
    scaling: float  # B's scaling (multiplied in after the copy); 1 for A


@dataclass(frozen=True)
class _Refill:
    """The built adapter's host tensors, each with the factor it takes and B's scaling."""

    lora_int_id: int
    config: dict[str, Any]
    layout: dict[str, tuple]
    built: Any  # the LoRAModel vLLM registered
    factors: tuple[_Factor, ...]

    def run(self, manager: Any, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        clock = PhaseClock()
        for factor in self.factors:
            factor.host.copy_(tensors[factor.name], non_blocking=True)
        _synchronize()  # the host tensors hold this step's factors
        clock.lap("to_host")
        for factor in self.factors:
            if factor.scaling != 1:  # LoRALayerWeights.optimize: ``self.lora_b *= self.scaling``
                factor.host.mul_(factor.scaling)
        clock.lap("scale")
        manager.deactivate_adapter(self.lora_int_id)
        manager.activate_adapter(self.lora_int_id)
        manager.pin_adapter(self.lora_int_id)
        _synchronize()  # the slot holds the adapter when the RPC returns
        clock.lap("activate")
        return {"ms": clock.total_ms(), "path": "refill", "modules": len(self.built.loras), "phases_ms": clock.laps}


def refill_from_activation(
    manager: Any,
    built: Any,
    tensors: dict[str, torch.Tensor],
    modules: dict[str, tuple[str, bool]],
    scaling: dict[str, Any],
    read: list[torch.Tensor],
    *,
    lora_int_id: int,
    config: dict[str, Any],
) -> tuple[_Refill | None, str]:
    """The refill of ``built`` (vLLM's ``LoRAModel`` after ``add_adapter``), or None and why it would not
    be faithful. ``modules``: each factor's ``(module, is_lora_a)``; ``scaling``: each module's scaling
    before ``add_adapter`` folded it into B; ``read``: what the activation's ``set_lora`` calls were handed.
    Faithful: every factor has its own host tensor of its shape and dtype, and those are all that was read."""
    factors = []
    for name, tensor in tensors.items():
        module, is_a = modules[name]
        host = _held_factor(manager, built, module, is_a)
        if host is None:
            return None, f"{name}: the built adapter holds no host tensor of it alone (vLLM derives what it reads)"
        if host.shape != tensor.shape or host.dtype != tensor.dtype:
            return None, (
                f"{name}: held as {host.dtype} {tuple(host.shape)}, the factor is {tensor.dtype} "
                f"{tuple(tensor.shape)} (vLLM converts it)"
            )
        factors.append(_Factor(name, host, 1 if is_a else scaling[module]))
    held = {id(f.host) for f in factors}
    if len(held) != len(factors):
        return None, "two factors map to one host tensor"
    unmapped = [t for t in read if id(t) not in held]
    if unmapped or held - {id(t) for t in read}:
        return None, (
            f"the activation read {len(unmapped)} tensor(s) no factor maps to, and "
            f"{len(held - {id(t) for t in read})} factor(s) it did not read"
        )
    refill = _Refill(lora_int_id, dict(config), _layout(tensors), built, tuple(factors))
    return refill, ""


def _held_factor(manager: Any, built: Any, module: str, is_a: bool) -> torch.Tensor | None:
    """The host tensor ``built`` keeps for a factor of ``module``: its own weights' or, for a constituent
    of a packed module (q/k/v, gate/up), its entry in the packed weights' lists."""
    weights, index = built.loras.get(module), None
    if weights is None:
        for packed, constituents in manager.packed_modules.items():
            if module in constituents and packed in built.loras:
                weights, index = built.loras[packed], constituents.index(module)
                break
    if weights is None:
        return None
    held = weights.lora_a if is_a else weights.lora_b
    if index is not None:  # a constituent's entry; MoE packs its experts into fewer, stacked, entries
        held = held[index] if isinstance(held, list) and index < len(held) else None
    return held if isinstance(held, torch.Tensor) else None


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()}


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


class PhaseClock:
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
