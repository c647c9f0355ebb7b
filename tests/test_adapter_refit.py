"""The LoRA adapter refit without vLLM: what an engine is refused (``engines.lora.adapter``), the factors shared
and mapped (``engines.lora.ipc``), and ``VLLMAdapterRefit``'s steps against an engine that answers its
RPCs with the engine-agnostic receiver and records what it was asked to load."""

from __future__ import annotations

import pytest
import torch

from mbridge_refit.engines.base import RPC_VERSION
from mbridge_refit.engines.ipc.sharing import LocalTransport
from mbridge_refit.engines.lora.adapter import (
    LIMITS_VERSION,
    PEFT_PREFIX,
    AdapterLimits,
    AdapterRefusedError,
    adapter_config,
    check_adapter,
    unplaced,
)
from mbridge_refit.engines.lora.ipc import AdapterReceiver, AdapterShare, AdapterShareError
from mbridge_refit.errors import EngineError, InputError

Q = "model.layers.0.self_attn.q_proj"
LIMITS = AdapterLimits(max_rank=16, slots=1, modules=frozenset({Q, "model.layers.0.mlp.down_proj"}))
FACTS = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "rank_pattern": {}, "alpha_pattern": {}}


def shapes(**changes):
    table = {f"{Q}.lora_A.weight": (4, 64), f"{Q}.lora_B.weight": (64, 4)}
    table.update(changes)
    return {name: shape for name, shape in table.items() if shape is not None}


def test_a_plain_adapter_within_the_limits_is_taken():
    check_adapter(shapes(), FACTS, LIMITS)


@pytest.mark.parametrize(
    "table, facts, named",
    [
        (shapes(), {**FACTS, "r": 32}, "above the engine's max_lora_rank 16"),
        (shapes(), {**FACTS, "rank_pattern": {Q: 8}}, "differ in rank or alpha"),
        (shapes(), {**FACTS, "alpha_pattern": {Q: 2}}, "differ in rank or alpha"),
        (shapes(**{f"{Q}.lora_B.weight": None}), FACTS, "has A without B"),
        (shapes(**{f"{Q}.lora_B.weight": (64, 8)}), FACTS, "not the factors of a rank-4 adapter"),
        (shapes(**{f"{Q}.lora_A.weight": (2, 4, 64)}), FACTS, "not the factors of a rank-4 adapter"),
        (shapes(**{"model.layers.0.mlp.experts.0.down_proj.lora_A.weight": (4, 8)}), FACTS, "expert adapter"),
        (shapes(**{f"{Q}.bias": (64,)}), FACTS, "no LoRA factor"),
    ],
)
def test_what_the_engine_cannot_take_is_refused_by_name(table, facts, named):
    with pytest.raises(AdapterRefusedError, match=named):
        check_adapter(table, facts, LIMITS)


def test_modules_the_engine_does_not_wrap_are_named():
    assert unplaced([Q, "model.layers.0.self_attn.o_proj"], LIMITS) == ["model.layers.0.self_attn.o_proj"]
    assert AdapterLimits.from_wire(LIMITS.to_wire()) == LIMITS


def test_the_config_is_what_megatron_bridge_writes_for_the_fields_an_engine_reads():
    from megatron.bridge.models.conversion.peft_bridge import build_adapter_config_dict
    from megatron.bridge.peft.lora import LoRA

    stock = build_adapter_config_dict(LoRA(dim=4, alpha=8), target_modules=["q_proj"])
    ours = adapter_config(FACTS)
    assert ours == {key: stock[key] for key in ours}


def test_the_engine_maps_the_factors_once_and_reads_them_in_place():
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    share = AdapterShare(LocalTransport())
    payload = share.record([(f"{Q}.lora_A.weight", a), (f"{Q}.lora_B.weight", b)])
    receiver = AdapterReceiver(torch.device("cpu"))
    opened = receiver.open(share.layout.to_wire(), payload, LocalTransport.name)
    assert opened["tensors"] == 2 and opened["bytes"] == (a.numel() + b.numel()) * 4
    views = receiver.tensors(share.layout.fingerprint)
    assert sorted(views) == [PEFT_PREFIX + f"{Q}.lora_A.weight", PEFT_PREFIX + f"{Q}.lora_B.weight"]
    assert views[PEFT_PREFIX + f"{Q}.lora_A.weight"].data_ptr() == a.data_ptr()
    a.add_(1)  # the trainer's next step, in place
    assert torch.equal(views[PEFT_PREFIX + f"{Q}.lora_A.weight"], a)
    assert share.record([(f"{Q}.lora_A.weight", a), (f"{Q}.lora_B.weight", b)]) is None  # same storages
    moved = a.clone()
    payload = share.record([(f"{Q}.lora_A.weight", moved), (f"{Q}.lora_B.weight", b)])
    assert payload is not None  # the factors moved: shared anew, and the engine maps them again
    receiver.open(share.layout.to_wire(), payload, LocalTransport.name)
    assert receiver.tensors(share.layout.fingerprint)[PEFT_PREFIX + f"{Q}.lora_A.weight"].data_ptr() == moved.data_ptr()
    old = share.layout.fingerprint
    share.record([(f"{Q}.lora_A.weight", moved)])  # another layout, not opened on the engine
    with pytest.raises(AdapterShareError, match="adapter layout mismatch"):
        receiver.tensors(share.layout.fingerprint)
    receiver.close()
    with pytest.raises(AdapterShareError, match="no adapter layout is open"):
        receiver.tensors(old)
    share.release()


class _Bridge:
    """What the session asks of a bridge: the adapters' facts and their export, held tensors."""

    def __init__(self, rank: int = 4):
        self.factors = [(f"{Q}.lora_A.weight", torch.randn(rank, 64)), (f"{Q}.lora_B.weight", torch.randn(64, rank))]
        self.facts = {**FACTS, "r": rank}

    def adapter_facts(self, model):
        return self.facts

    def export_adapter_weights(self, model, cpu=True, show_progress=True, *, reuse_buffer_from_cache=False):
        assert not cpu and reuse_buffer_from_cache
        return iter(self.factors)


class _Engine:
    """An ``LLM`` whose one worker answers the adapter RPCs with the receiver and records each load."""

    def __init__(self):
        self.receiver = AdapterReceiver(torch.device("cpu"))
        self.calls, self.loads, self.resets = [], [], 0

    def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append(method)
        verb = method.removeprefix("mbridge_refit_")
        if verb == "adapter_limits":
            return [LIMITS.to_wire()]
        if verb == "adapter_open":
            *opening, rpc_version = args
            assert rpc_version == RPC_VERSION, args  # the session's first RPC into the worker carries it
            return [self.receiver.open(*opening)]
        if verb == "adapter_load":
            fingerprint, lora_int_id, config = args
            tensors = self.receiver.tensors(fingerprint)
            self.loads.append((lora_int_id, config, {name: t.clone() for name, t in tensors.items()}))
            return [{"ms": 0.1}]
        if verb == "adapter_close":
            return [self.receiver.close()]
        raise AssertionError(method)

    def reset_prefix_cache(self):
        self.resets += 1
        return True


def _session(engine, **options):
    from mbridge_refit.engines.vllm import VLLMAdapterRefit

    return VLLMAdapterRefit(engine, transport=LocalTransport(), lora_int_id=3, **options)


def test_each_refit_loads_the_current_factors_under_one_id_opening_only_once():
    bridge, engine = _Bridge(), _Engine()
    refit = _session(engine)
    first = refit.refit(bridge, None)
    bridge.factors[0][1].mul_(2)  # an optimizer step, in place
    second = refit.refit(bridge, None)
    assert first.opened and not second.opened and first.tensors == 2
    assert engine.calls.count("mbridge_refit_adapter_open") == 1 and len(engine.loads) == 2
    assert engine.resets == 2
    lora_int_id, config, tensors = engine.loads[1]
    assert lora_int_id == 3 and config == adapter_config(bridge.facts)
    assert torch.equal(tensors[PEFT_PREFIX + f"{Q}.lora_A.weight"], bridge.factors[0][1])
    assert not torch.equal(engine.loads[0][2][PEFT_PREFIX + f"{Q}.lora_A.weight"], bridge.factors[0][1])
    refit.close()
    assert engine.calls[-1] == "mbridge_refit_adapter_close"


def test_a_refused_adapter_moves_nothing_and_a_non_sender_only_exports():
    engine = _Engine()
    with pytest.raises(AdapterRefusedError, match="max_lora_rank"):
        _session(engine).refit(_Bridge(rank=32), None)
    assert engine.calls == ["mbridge_refit_adapter_limits"]
    assert _session(engine).refit(_Bridge(), None, sender=False) is None
    assert engine.calls == ["mbridge_refit_adapter_limits"]


def test_fp8_an_early_request_and_a_refused_cache_reset_are_named():
    engine = _Engine()
    refit = _session(engine)
    with pytest.raises(InputError, match="fp8"):
        refit.refit(_Bridge(), None, fp8="blockwise")
    with pytest.raises(EngineError, match="no adapter was refit"):
        refit.lora_request  # noqa: B018
    engine.reset_prefix_cache = lambda: False
    with pytest.raises(EngineError, match="prefix cache"):
        refit.refit(_Bridge(), None)


@pytest.mark.parametrize("version", [None, LIMITS_VERSION + 1])
def test_an_engine_s_limits_of_another_version_are_refused_by_name(version):
    """The engine's LoRA limits from another mbridge_refit (None: from before the reply carried a version)."""
    wire = {key: value for key, value in LIMITS.to_wire().items() if key != "version"}
    if version is not None:
        wire["version"] = version
    with pytest.raises(EngineError, match="adapter limits wire version mismatch") as caught:
        AdapterLimits.from_wire(wire)
    shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
    assert f"this side speaks version {LIMITS_VERSION}, the engine version {shown}" in str(caught.value)
