"""The adapter slot's refill (``engines.vllm.lora``) without vLLM: against a stand-in of vLLM 0.26's
LoRA manager written here from its source (``LoRAModelManager``: packed q/k/v lists, B scaled in place on
the host by ``optimize``, ``activate_adapter`` calling each module's ``set_lora`` with the held host
tensors, which zero the slot and copy them in), a refill puts into the slot what a fresh build of the
same factors puts there, bit for bit; an activation that reads anything but the held factors, a factor
vLLM converts, and a changed adapter are sent back to the build path by name."""

from __future__ import annotations

import pytest
import torch

from mbridge_refit.engines.vllm.lora import (
    FIRST_LOAD,
    AdapterSlot,
    PhaseClock,
    activate_watched,
    install,
    refill_from_activation,
)

ATTN, MLP = "model.layers.0.self_attn", "model.layers.0.mlp"
QKV, DOWN = f"{ATTN}.qkv_proj", f"{MLP}.down_proj"
PACKED = {QKV: [f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj"]}
SCALING = 2.0 / 3.0  # alpha / r that is not a power of two: B's scaling rounds
RANK, MAX_RANK, SLOTS = 4, 8, 2
OUT = {f"{ATTN}.q_proj": 16, f"{ATTN}.k_proj": 8, f"{ATTN}.v_proj": 8, DOWN: 16}
IN = 16


class Weights:
    """``LoRALayerWeights`` / ``PackedLoRALayerWeights``: factors (or lists of them) and a scaling."""

    def __init__(self, lora_a, lora_b, scaling):
        self.lora_a, self.lora_b, self.scaling = lora_a, lora_b, scaling


class Module:
    """A LoRA-wrapped linear: one stacked A and B buffer per slice, ``set_lora`` as ``BaseLinearLayerWithLoRA``."""

    def __init__(self, outs):
        self.lora_a_stacked = [torch.zeros(SLOTS, 1, MAX_RANK, IN, dtype=torch.bfloat16) for _ in outs]
        self.lora_b_stacked = [torch.zeros(SLOTS, 1, out, MAX_RANK, dtype=torch.bfloat16) for out in outs]

    def set_lora(self, index, lora_a, lora_b):
        lora_a = lora_a if isinstance(lora_a, list) else [lora_a]
        lora_b = lora_b if isinstance(lora_b, list) else [lora_b]
        for i, (a, b) in enumerate(zip(lora_a, lora_b, strict=True)):
            self.lora_a_stacked[i][index] = 0
            self.lora_b_stacked[i][index] = 0
            if a is not None:
                a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])  # a stacked expert of one
                self.lora_a_stacked[i][index, 0, : a.shape[0], : a.shape[1]].copy_(a)
                self.lora_b_stacked[i][index, 0, : b.shape[0], : b.shape[1]].copy_(b)


class Manager:
    """``LRUCacheLoRAModelManager``'s part the slot uses: register (pack + scale B), activate, deactivate."""

    def __init__(self):
        self.packed_modules = PACKED
        self.modules = {QKV: Module([OUT[m] for m in PACKED[QKV]]), DOWN: Module([OUT[DOWN]])}
        self.lora_index_to_id = [None] * SLOTS
        self.registered = {}

    def register(self, lora_id, loras):
        """``from_lora_tensors`` (cast to the lora dtype) + ``_create_merged_loras_inplace``."""
        loras = {
            m: Weights(w.lora_a.to(torch.bfloat16), w.lora_b.to(torch.bfloat16), w.scaling) for m, w in loras.items()
        }
        for weights in loras.values():
            weights.lora_b *= weights.scaling  # optimize
            weights.scaling = 1
        for packed, constituents in PACKED.items():
            parts = [loras.pop(m, None) for m in constituents]
            a = [p.lora_a if p else None for p in parts]
            b = [p.lora_b if p else None for p in parts]
            loras[packed] = Weights(a, b, [1] * len(parts))
        self.registered[lora_id] = Built(loras)
        return self.registered[lora_id]

    def get_adapter(self, lora_id):
        return self.registered.get(lora_id)

    capacity = SLOTS

    def __len__(self):
        return len(self.registered)

    def add_adapter(self, lora):
        self.register(lora.id, lora.loras)

    def remove_adapter(self, lora_id):
        if lora_id in self.lora_index_to_id:
            self.deactivate_adapter(lora_id)
        self.registered.pop(lora_id, None)

    def remove_oldest_adapter(self):
        self.remove_adapter(next(iter(self.registered)))

    def activate_adapter(self, lora_id):
        index = self.lora_index_to_id.index(None)
        self.lora_index_to_id[index] = lora_id
        for name, module in self.modules.items():
            weights = self.registered[lora_id].loras[name]
            module.set_lora(index, weights.lora_a, weights.lora_b)

    def deactivate_adapter(self, lora_id):
        self.lora_index_to_id[self.lora_index_to_id.index(lora_id)] = None

    def pin_adapter(self, lora_id):
        pass


class Built:
    def __init__(self, loras):
        self.loras = loras


def factors(seed, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    table = {}
    for module, out in OUT.items():
        table[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, IN, generator=generator).to(dtype)
        table[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out, RANK, generator=generator).to(dtype)
    return table


def modules_of(tensors):
    return {name: (name.removeprefix("base_model.model.").rsplit(".", 2)[0], ".lora_A." in name) for name in tensors}


def build(manager, tensors, lora_id=1):
    """The build path on the stand-in: register, activate watched; returns the refill (or why not)."""
    modules = modules_of(tensors)
    loras = {}
    for name, tensor in tensors.items():
        module, is_a = modules[name]
        weights = loras.setdefault(module, Weights(None, None, SCALING))
        weights.lora_a, weights.lora_b = (tensor, weights.lora_b) if is_a else (weights.lora_a, tensor)
    built = manager.register(lora_id, loras)
    read = activate_watched(manager, lora_id)
    scaling = {module: SCALING for module, _ in modules.values()}
    return refill_from_activation(
        manager, built, tensors, modules, scaling, read, lora_int_id=lora_id, config={"r": RANK}
    )


def slot_bytes(manager, lora_id):
    index = manager.lora_index_to_id.index(lora_id)
    return [
        buffer[index].clone()
        for module in manager.modules.values()
        for buffer in (*module.lora_a_stacked, *module.lora_b_stacked)
    ]


def test_a_refill_puts_into_the_slot_what_a_fresh_build_puts_there():
    refilled = Manager()
    refill, why = build(refilled, factors(0))
    assert refill is not None, why
    report = refill.run(refilled, factors(1))
    assert report["path"] == "refill" and set(report["phases_ms"]) == {"to_host", "scale", "activate"}

    fresh = Manager()
    build(fresh, factors(1))
    for got, want in zip(slot_bytes(refilled, 1), slot_bytes(fresh, 1), strict=True):
        assert torch.equal(got, want)
    index = refilled.lora_index_to_id.index(1)
    b = refilled.modules[DOWN].lora_b_stacked[0][index, 0, :, :RANK]
    assert torch.equal(b, factors(1)[f"base_model.model.{DOWN}.lora_B.weight"] * SCALING)  # scaled once, as optimize
    assert not torch.equal(b, factors(0)[f"base_model.model.{DOWN}.lora_B.weight"] * SCALING)


def test_an_activation_reading_what_no_factor_maps_to_stays_on_the_build_path():
    manager = Manager()
    register = manager.register

    def register_with_one_more_module(lora_id, loras):  # the activation also reads weights the factors never gave
        built = register(lora_id, loras)
        built.loras["lm_head"] = Weights(torch.zeros(RANK, IN), torch.zeros(IN, RANK), 1)
        return built

    manager.register = register_with_one_more_module
    manager.modules["lm_head"] = Module([IN])
    refill, why = build(manager, factors(0))
    assert refill is None and "read 2 tensor(s) no factor maps to, and 0 factor(s) it did not read" in why


def test_a_factor_vllm_holds_derived_stays_on_the_build_path():
    manager = Manager()
    register = manager.register

    def register_stacked(lora_id, loras):  # as pack_moe stacks experts into new tensors
        built = register(lora_id, loras)
        weights = built.loras[DOWN]
        weights.lora_a, weights.lora_b = weights.lora_a[None], weights.lora_b[None]
        return built

    manager.register = register_stacked
    refill, why = build(manager, factors(0))
    assert refill is None and f"{DOWN}.lora_A.weight: held as torch.bfloat16 (1, {RANK}, {IN})" in why


def test_a_factor_vllm_converts_stays_on_the_build_path():
    refill, why = build(Manager(), factors(0, dtype=torch.float32))
    assert refill is None and "held as torch.bfloat16" in why and "the factor is torch.float32" in why


class _WorkerManager:
    def __init__(self, manager):
        self._adapter_manager = manager


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda t, c, i: (t, c, 2), "another adapter id (2, built 1)"),
        (lambda t, c, i: (t, {"r": 8}, i), "the adapter's config changed"),
        (lambda t, c, i: ({k: v[:, :2] if ".lora_B." in k else v for k, v in t.items()}, c, i), "shapes or dtypes"),
    ],
)
def test_a_changed_adapter_is_built_again_and_says_why(change, why):
    manager = Manager()
    slot = AdapterSlot(_WorkerManager(manager))
    assert slot._why_not_refill(manager, factors(0), 1, {"r": RANK}) == FIRST_LOAD
    slot.refill, _ = build(manager, factors(0))
    assert slot._why_not_refill(manager, factors(1), 1, {"r": RANK}) is None
    tensors, config, lora_id = change(factors(1), {"r": RANK}, 1)
    assert why in slot._why_not_refill(manager, tensors, lora_id, config)
    manager.registered[1] = Built({})  # vLLM evicted and rebuilt it from elsewhere
    assert "no longer holds" in slot._why_not_refill(manager, factors(1), 1, {"r": RANK})


def test_a_build_failing_while_activating_leaves_no_adapter_behind():
    manager = Manager()

    def set_lora_fails(index, lora_a, lora_b):
        raise RuntimeError("CUDA error in set_lora")

    manager.modules[DOWN].set_lora = set_lora_fails  # the packed qkv module was written first: a half-written slot
    loras = {}
    for name, tensor in factors(0).items():
        module, is_a = modules_of({name: tensor})[name]
        weights = loras.setdefault(module, Weights(None, None, SCALING))
        weights.lora_a, weights.lora_b = (tensor, weights.lora_b) if is_a else (weights.lora_a, tensor)
    lora = Built(loras)
    lora.id = 1
    with pytest.raises(RuntimeError, match="CUDA error in set_lora"):
        install(manager, lora, PhaseClock())
    assert manager.get_adapter(1) is None and 1 not in manager.lora_index_to_id  # nothing serves the half slot
