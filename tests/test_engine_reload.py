"""What vLLM 0.26 does when it reloads DeepSeek-V3's layers, modelled on CPU, and how the recorded
apply plan (``engines.replay.apply_plan``) replays it exactly or refuses it by name.

``Reload`` below is vLLM's layerwise reload cut to what the recorder sees
(``vllm/model_executor/model_loader/reload/layerwise.py``): every layer's loadable parameters
are replaced by staging tensors, loads are buffered until a layer is complete, then loaded,
processed and copied back into the kernel tensors; attention layers are processed last, by
their own ``process_weights_after_loading``. The layers are DeepSeek-V3's (``deepseek_v2.py``):
a router whose ``e_score_correction_bias`` the reload never stages and the experts share, and
MLA, whose ``W_UV``/``W_UK_T`` are computed from ``kv_b_proj`` after loading, not loaded.
"""

from __future__ import annotations

import pytest
import torch

from mbridge_refit.engines.ipc.engine import EngineRefitError, RefitReceiver
from mbridge_refit.engines.ipc.sharing import LayoutRecorder, LocalTransport
from mbridge_refit.engines.replay.apply_plan import ApplyPlan, ApplyPlanError, StagedLoad

# vllm/model_executor/model_loader/reload/meta.py:25-32: SKIP_TENSORS = {"_expert_map", ...,
# "e_score_correction_bias"}: never moved to meta, never staged, its loader never wrapped.
SKIP_TENSORS = {"e_score_correction_bias"}


def _param(data: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(data, requires_grad=False)


class Gate(torch.nn.Module):
    """``GateLinear`` (unquantized); ``DeepseekV2MoE`` gives it the bias (deepseek_v2.py:314-317):
    ``self.gate.e_score_correction_bias = nn.Parameter(torch.empty(n_routed_experts, dtype=torch.float32))``."""

    def __init__(self, experts: int, hidden: int):
        super().__init__()
        self.weight = _param(torch.zeros(experts, hidden, dtype=torch.bfloat16))
        self.e_score_correction_bias = _param(torch.zeros(experts))


class Experts(torch.nn.Module):
    """``RoutedExperts``: ``self.e_score_correction_bias = e_score_correction_bias`` (routed_experts.py:114)
    registers the gate's Parameter on the experts too; ``w13`` takes expert rows."""

    def __init__(self, gate: Gate, experts: int, hidden: int):
        super().__init__()
        self.w13 = _param(torch.zeros(experts, 2, hidden))
        self.e_score_correction_bias = gate.e_score_correction_bias


class KvB(torch.nn.Module):
    """``kv_b_proj``: [heads * (nope + v), kv_lora]; with ``scale`` a stand-in for a block-FP8 layer
    (``weight_scale_inv``: dequantizing makes a new tensor), without it a BF16 layer."""

    def __init__(self, heads: int, nope: int, v: int, lora: int, quantized: bool):
        super().__init__()
        self.weight = _param(torch.zeros(heads * (nope + v), lora))
        self.scale = _param(torch.ones(1)) if quantized else None

    def dequantized(self) -> torch.Tensor:
        """quant_utils.get_and_maybe_dequant_weights: ``weight.to(out_dtype)`` unquantized (the weight
        itself when the dtype is already right), ``scaled_dequantize(weight, weight_scales, ...)`` for FP8."""
        return self.weight.to(torch.float32) if self.scale is None else self.weight * self.scale


class MLA(torch.nn.Module):
    """``MLAAttention``: holds ``kv_b_proj`` and derives ``W_UV``/``W_UK_T`` from it after loading
    (mla_attention.py:948-1035): ``kv_b_proj_weight = get_and_maybe_dequant_weights(self.kv_b_proj, ...).T``,
    ``W_UK, W_UV = kv_b_proj_weight.view(L, N, P + V).split([P, V], dim=-1)``,
    ``replace_parameter(self, "W_UV", W_UV.transpose(0, 1), prefer_copy=True)``,
    ``replace_parameter(self, "W_UK_T", W_UK.permute(1, 2, 0), prefer_copy=True)``. replace_parameter
    (model_executor/utils.py:47-86) wraps the view itself in a Parameter the first time (two strided views of
    one tensor: the dequantized weight, or the BF16 weight itself) and ``copy_``s into it later."""

    def __init__(self, kv_b: KvB, heads: int, nope: int, v: int, lora: int):
        super().__init__()
        self.kv_b_proj, self.heads, self.nope, self.v, self.lora = kv_b, heads, nope, v, lora
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        weight = self.kv_b_proj.dequantized().T.view(self.lora, self.heads, self.nope + self.v)
        w_uk, w_uv = weight.split([self.nope, self.v], dim=-1)
        for name, value in (("W_UV", w_uv.transpose(0, 1)), ("W_UK_T", w_uk.permute(1, 2, 0))):
            old = getattr(self, name, None)
            if old is not None and old.shape == value.shape:
                old.copy_(value)
            else:
                setattr(self, name, _param(value))


class DeepseekLayer(torch.nn.Module):
    """One MoE layer's router, experts and MLA, loaded by HF names as ``DeepseekV2Model.load_weights``
    does (default loader ``param.data.copy_``, experts by row)."""

    EXPERTS, HIDDEN, HEADS, NOPE, V, LORA = 4, 8, 2, 3, 2, 5

    def __init__(self, router: bool = True, mla: bool = True, quantized: bool = True):
        super().__init__()
        if router:
            self.gate = Gate(self.EXPERTS, self.HIDDEN)
            self.experts = Experts(self.gate, self.EXPERTS, self.HIDDEN)
        if mla:
            self.kv_b_proj = KvB(self.HEADS, self.NOPE, self.V, self.LORA, quantized)
            self.mla_attn = MLA(self.kv_b_proj, self.HEADS, self.NOPE, self.V, self.LORA)

    def layers(self) -> list[torch.nn.Module]:
        """The modules vLLM's reload handles one by one, attention last."""
        return sorted(self.children(), key=lambda module: isinstance(module, MLA))

    def sources(self) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        out = {}
        if hasattr(self, "gate"):
            out["gate.weight"] = torch.randn(self.EXPERTS, self.HIDDEN, generator=generator).bfloat16()
            out["gate.e_score_correction_bias"] = torch.randn(self.EXPERTS, generator=generator)
            for expert in range(self.EXPERTS):
                out[f"experts.{expert}.w13"] = torch.randn(2, self.HIDDEN, generator=generator)
        if hasattr(self, "mla_attn"):
            out["kv_b_proj.weight"] = torch.randn(self.HEADS * (self.NOPE + self.V), self.LORA, generator=generator)
            if self.kv_b_proj.scale is not None:
                out["kv_b_proj.scale"] = torch.rand(1, generator=generator) + 0.5
        return out

    def process(self) -> None:
        """What loading from disk ends with: attention's processing after everything is loaded."""
        if hasattr(self, "mla_attn"):
            self.mla_attn.process_weights_after_loading()

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if name.startswith("experts."):
                expert = int(name.split(".")[1])
                _loader(self.experts.w13)(self.experts.w13, tensor, expert)
            else:
                module, attribute = name.rsplit(".", 1)
                param = getattr(self.get_submodule(module), attribute)
                _loader(param)(param, tensor, None)


def _default_loader(param, tensor, expert) -> None:
    """weight_utils.default_weight_loader: ``param.data.copy_(loaded_weight)``; FusedMoE's expert loader
    narrows to the expert (``expert_data = param.data[expert_id]``)."""
    (param.data if expert is None else param.data[expert]).copy_(tensor)


def _loader(param):
    return getattr(param, "weight_loader", _default_loader)


class Reload:
    """vLLM's layerwise reload of a ``DeepseekLayer`` (layerwise.py, the parts the recorder sees)."""

    def __init__(self, model: DeepseekLayer):
        self.model = model
        self.kernel: dict[torch.nn.Module, dict[str, torch.nn.Parameter]] = {}

    def staged(self) -> StagedLoad:
        return StagedLoad(begin=self.begin, end=self.end)

    def begin(self) -> None:
        """initialize_layerwise_reload (layerwise.py:84-130): keep the kernel tensors, put loadable
        staging tensors in their place, wrap their loaders to buffer until the layer is complete."""
        for layer in self.model.layers():
            self.kernel[layer] = dict(layer._parameters)
            if isinstance(layer, MLA):
                for name in ("W_UV", "W_UK_T"):  # not in its restore metadata (created after the first load)
                    delattr(layer, name)
                continue
            pending, size = [], sum(p.numel() for n, p in layer._parameters.items() if n not in SKIP_TENSORS)
            for name, param in list(layer._parameters.items()):
                if name in SKIP_TENSORS:
                    continue
                staging = _param(torch.empty_like(param))
                staging.weight_loader = self._buffering(layer, name, pending, size)
                setattr(layer, name, staging)

    def _buffering(self, layer, name, pending, size):
        def online_process_loader(param, tensor, expert):  # layerwise.py:157-225
            pending.append((name, tensor, expert))
            if sum(t.numel() for _, t, _ in pending) >= size:
                for param_name, loaded, index in pending:  # _layerwise_process, layerwise.py:357-361
                    target = getattr(layer, param_name)
                    _default_loader(target, loaded, index)
                self._copy_and_restore(layer)

        return online_process_loader

    def _copy_and_restore(self, layer) -> None:
        """_copy_and_restore_kernel_tensors (layerwise.py:395-411): ``param.data.copy_(getattr(layer, name))``
        for every kernel parameter, the never-staged bias included (a copy of itself)."""
        for name, param in self.kernel[layer].items():
            param.data.copy_(getattr(layer, name))
        for name, param in self.kernel[layer].items():
            setattr(layer, name, param)

    def end(self) -> None:
        """_finalize_attention_layer (layerwise.py:293-307): nothing loaded into MLA itself, so its kernel
        tensors go back and ``layer.process_weights_after_loading(model_config.dtype)`` runs."""
        for attn in [layer for layer in self.model.layers() if isinstance(layer, MLA)]:
            for name, param in self.kernel[attn].items():
                setattr(attn, name, param)
            attn.process_weights_after_loading()


def recompute_attention(module: torch.nn.Module):
    """The vLLM adapter's rule, for this model: attention layers are processed by their own
    ``process_weights_after_loading`` after every reload (layerwise.py:293-307)."""
    return module.process_weights_after_loading if isinstance(module, MLA) else None


def _open(model, sources, *, staged=None, recompute=None):
    recorder = LayoutRecorder()
    for name, tensor in sources.items():
        recorder.add(name, tensor)
    layout, storages = recorder.layout()
    receiver = RefitReceiver(model, torch.device("cpu"), staged=staged, recompute=recompute)
    transport = LocalTransport()
    return receiver, layout, receiver.open(layout.to_wire(), transport.share(storages), transport.name)


def _expected(sources: dict[str, torch.Tensor], **parts) -> dict[str, torch.Tensor]:
    """The oracle: a fresh engine loaded from ``sources`` by its own loader, then processed."""
    fresh = DeepseekLayer(**parts)
    fresh.load_weights(sources.items())
    fresh.process()
    return {name: p.detach().clone() for name, p in fresh.named_parameters()}


def _assert_engine_is(model, expected) -> None:
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


def _next_step(sources: dict[str, torch.Tensor]) -> None:
    for tensor in sources.values():
        tensor.mul_(2).add_(1)


def _record_staged(model, sources, recompute=None) -> ApplyPlan:
    plan = ApplyPlan.record(model, list(sources.items()), staged=Reload(model).staged(), recompute=recompute)
    plan.check_against_loader()
    return plan


def test_a_reload_that_copies_a_never_staged_tensor_onto_itself_replays_as_copies():
    """The gate's and the experts' e_score_correction_bias: vLLM's reload copies it onto itself when the
    layer completes, which is no copy at all; the old recorder took it for a copy from a temporary and
    refused gate.weight and the experts' last tensor ("not loaded by plain copies through the reload")."""
    model = DeepseekLayer(mla=False)
    sources = model.sources()
    plan = _record_staged(model, sources)
    assert plan.via_loader == [] and plan.copies == len(sources)
    _next_step(sources)
    plan.replay()
    _assert_engine_is(model, _expected(sources, mla=False))


def test_parameters_the_engine_derives_after_a_reload_are_recomputed_each_step():
    model = DeepseekLayer(router=False)
    sources = model.sources()
    plan = _record_staged(model, sources, recompute=recompute_attention)
    assert plan.recomputed == ["mla_attn"] and plan.derived == ["mla_attn.W_UV"]
    assert list(plan.aliases) == ["mla_attn.W_UK_T"]  # a view of the same dequantized tensor: checked too
    w_uv = model.mla_attn.W_UV.data_ptr()
    _next_step(sources)
    plan.replay()
    assert model.mla_attn.W_UV.data_ptr() == w_uv  # recomputed in place, as the engine's processing does
    _assert_engine_is(model, _expected(sources, router=False))


def test_a_deepseek_layer_through_the_receiver():
    model = DeepseekLayer()
    sources = model.sources()
    receiver, layout, report = _open(model, sources, staged=Reload(model).staged(), recompute=recompute_attention)
    assert report["via_loader"] == [] and report["missing"] == [] and report["recomputed"] == ["mla_attn"]
    _next_step(sources)
    receiver.apply(layout.fingerprint)
    _assert_engine_is(model, _expected(sources))


def test_parameters_a_plain_loader_leaves_to_processing_are_recomputed_each_step():
    """An engine that loads quantized weights without a reload: W_UV/W_UK_T are never loaded, only derived."""
    model = DeepseekLayer(router=False)
    sources = model.sources()
    receiver, layout, report = _open(model, sources, recompute=recompute_attention)
    assert report["missing"] == [] and report["recomputed"] == ["mla_attn"] and report["via_loader"] == []
    _next_step(sources)
    receiver.apply(layout.fingerprint)
    _assert_engine_is(model, _expected(sources, router=False))


def test_bf16_mla_needs_no_recompute_its_derived_parameters_are_views_of_the_weight():
    """BF16: get_and_maybe_dequant_weights returns kv_b_proj's weight itself, so W_UV/W_UK_T are strided views
    of it, and the copies into kv_b_proj.weight are all a refit needs."""
    model = DeepseekLayer(router=False, quantized=False)
    sources = model.sources()
    receiver, layout, report = _open(model, sources, recompute=recompute_attention)
    assert report["missing"] == [] and report["recomputed"] == [] and report["via_loader"] == []
    _next_step(sources)
    receiver.apply(layout.fingerprint)
    _assert_engine_is(model, _expected(sources, router=False, quantized=False))


def test_derived_parameters_without_a_way_to_recompute_them_are_refused_by_name():
    model = DeepseekLayer(router=False)
    with pytest.raises(ApplyPlanError, match=r"mla_attn\.W_U.*derived.*no way to recompute"):
        _record_staged(model, model.sources())
    plain = DeepseekLayer(router=False)
    with pytest.raises(EngineRefitError, match=r"received nothing.*mla_attn\.W_U"):
        _open(plain, plain.sources())


def test_a_copy_of_a_tensor_onto_itself_is_not_recorded():
    model = DeepseekLayer(mla=False)

    def loader(weights):
        for _, tensor in weights:
            model.gate.e_score_correction_bias.data.copy_(tensor)
            model.experts.e_score_correction_bias.data.copy_(model.gate.e_score_correction_bias)

    plan = ApplyPlan.record(model, [("bias", torch.randn(DeepseekLayer.EXPERTS))], loader)
    assert plan.via_loader == [] and plan.copies == 1
