"""What vLLM 0.26's DeepGEMM does to block-FP8 layers after loading them, modelled on CPU, and how a
colocated refit into such an engine is exact or refused by name (``engines.vllm.deep_gemm``,
``engines.replay.apply_plan``'s processed parameters).

The stand-ins are vLLM's, cut to what the refit sees (paths under ``vllm/``): ``Fp8LinearMethod`` hands
processing to its kernel; ``DeepGemmFp8BlockScaledMMKernel.process_weights_after_loading``
(``model_executor/kernels/linear/scaled_mm/deep_gemm.py:84-107``) requantizes the weight in place with
power-of-two scales (``layers/quantization/utils/fp8_utils.py:990-1047`` with
``utils/deep_gemm.py:644-680``, E8M0 on by default, Hopper included) and keeps the float32 scale's layout
on Hopper, or packs it into int32 on Blackwell; ``Fp8MoEMethod`` with the DeepGEMM experts requantizes every
expert; ``Reload`` is vLLM's layerwise reload (``model_executor/model_loader/reload/layerwise.py``: staging
tensors in the checkpoint's format, the layer processed when complete, copied into the kernel tensors).
The trainer's tensors are what its export writes (``fp8.reference.quantize_reference``: ``amax / 448``
scales, 1 for an all-zero block), which DeepGEMM's processing rewrites.

Oracle: an engine loaded from a checkpoint of the same weights (``Engine.from_checkpoint``: the loader,
then every layer's processing), compared byte for byte.
"""

from __future__ import annotations

import enum
import math
from types import SimpleNamespace

import pytest
import torch

from mbridge_refit.engines.base import RPC_VERSION
from mbridge_refit.engines.ipc.engine import EngineRefitError, RefitReceiver
from mbridge_refit.engines.ipc.sharing import LayoutRecorder, LocalTransport
from mbridge_refit.engines.replay.apply_plan import ApplyPlanError, StagedLoad
from mbridge_refit.engines.vllm.deep_gemm import reprocess
from mbridge_refit.engines.vllm.worker import RefitWorkerExtension
from mbridge_refit.fp8.format import FP8_DTYPE
from mbridge_refit.fp8.reference import quantize_reference

BLOCK = 128


def requant_ue8m0_(weight: torch.Tensor, scale: torch.Tensor) -> None:
    """vLLM's ``requant_weight_ue8m0_inplace`` of one matrix (fp8_utils.py:1029-1047): dequantize with the
    scales, quantize again as ``per_block_cast_to_fp8(..., use_ue8m0=True)`` does (deep_gemm.py:660-680:
    zero-padded blocks, ``amax`` clamped at 1e-4, ``2^ceil(log2(amax / 448))``), copy both back in place."""
    rows, cols = weight.shape
    expanded = scale.to(torch.float32).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    values = weight.to(torch.float32) * expanded
    padded = torch.zeros(math.ceil(rows / BLOCK) * BLOCK, math.ceil(cols / BLOCK) * BLOCK)
    padded[:rows, :cols] = values
    view = padded.view(-1, BLOCK, padded.size(1) // BLOCK, BLOCK)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    quantized = (view * (1.0 / sf)).to(FP8_DTYPE).view_as(padded)[:rows, :cols]
    weight.copy_(quantized)
    scale.copy_(sf.view(view.size(0), view.size(2)))


def replace_parameter(layer: torch.nn.Module, name: str, data: torch.Tensor) -> None:
    """model_executor/utils.py:92-98: a new Parameter around the data, in the old one's place."""
    setattr(layer, name, torch.nn.Parameter(data, requires_grad=False))


class DeepGemmFp8BlockScaledMMKernel:
    """Named as vLLM's (``engines.vllm.deep_gemm`` finds it by name): on Hopper the scale keeps its layout
    (DeepGEMM's ``transform_sf_into_required_layout`` only checks a float32 128x128 scale)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        requant_ue8m0_(layer.weight.data, layer.weight_scale_inv.data)
        replace_parameter(layer, "weight", layer.weight.data)
        replace_parameter(layer, "weight_scale_inv", layer.weight_scale_inv.data)


class BlackwellDeepGemmKernel(DeepGemmFp8BlockScaledMMKernel):
    """On sm100/120 the scale becomes a new int32 tensor of packed UE8M0 exponents, one row per weight row."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        requant_ue8m0_(layer.weight.data, layer.weight_scale_inv.data)
        exponents = (layer.weight_scale_inv.data.view(torch.int32) >> 23).to(torch.uint8)
        rows = exponents.repeat_interleave(BLOCK, 0)[: layer.weight.shape[0]]
        packed = torch.nn.functional.pad(rows, (0, (-rows.shape[1]) % 4)).contiguous().view(torch.int32)
        replace_parameter(layer, "weight_scale_inv", packed)


class CutlassFp8BlockScaledMMKernel:
    """A kernel that takes the checkpoint's bytes as they are."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass


class Fp8LinearMethod:
    """layers/quantization/fp8.py: block-FP8 processing is the kernel's."""

    def __init__(self, kernel) -> None:
        self.fp8_linear = kernel

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.fp8_linear.process_weights_after_loading(layer)


class Fp8MoeBackend(enum.Enum):
    """layers/fused_moe/oracle/fp8.py:42-47 (the values the refit reads)."""

    TRITON = "TRITON"
    DEEPGEMM = "DEEPGEMM"


class Fp8MoEMethod:
    """With DeepGEMM's experts, every expert requantized (fp8_utils.py:1156-1176)."""

    def __init__(self, backend: Fp8MoeBackend) -> None:
        self.fp8_backend = backend

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.fp8_backend is Fp8MoeBackend.DEEPGEMM:
            for expert in range(layer.w13_weight.shape[0]):
                requant_ue8m0_(layer.w13_weight.data[expert], layer.w13_weight_scale_inv.data[expert])
        replace_parameter(layer, "w13_weight", layer.w13_weight.data)
        replace_parameter(layer, "w13_weight_scale_inv", layer.w13_weight_scale_inv.data)


class ModelWeightParameter(torch.nn.Parameter):
    """vLLM's ``BasevLLMParameter``: the loaders call its own methods, which the plain Parameter
    ``replace_parameter`` puts in its place lacks (so ``load_weights`` fails on a processed layer)."""

    def load(self, tensor: torch.Tensor, index: tuple) -> None:
        self.data[index[0] if isinstance(index[0], slice) else int(index[0])].copy_(tensor)


def _fp8(*shape: int) -> torch.nn.Parameter:
    return ModelWeightParameter(torch.zeros(*shape, dtype=FP8_DTYPE), requires_grad=False)


def _scales(*shape: int) -> torch.nn.Parameter:
    return ModelWeightParameter(torch.ones(*shape), requires_grad=False)


class Linear(torch.nn.Module):
    """A block-FP8 linear layer; ``parts``: HF name -> its first row (vLLM's fused loaders narrow to it)."""

    def __init__(self, rows: int, cols: int, kernel, parts: dict[str, int]) -> None:
        super().__init__()
        self.weight, self.weight_scale_inv = _fp8(rows, cols), _scales(rows // BLOCK, cols // BLOCK)
        self.weight_block_size = [BLOCK, BLOCK]
        self.quant_method = Fp8LinearMethod(kernel)
        self.parts = parts


class Experts(torch.nn.Module):
    """``RoutedExperts``' stacked w13 and its scales, one expert per HF tensor."""

    def __init__(self, experts: int, backend: Fp8MoeBackend) -> None:
        super().__init__()
        self.w13_weight, self.w13_weight_scale_inv = _fp8(experts, 256, 128), _scales(experts, 2, 1)
        self.weight_block_size = [BLOCK, BLOCK]
        self.quant_method = Fp8MoEMethod(backend)


class Attention(torch.nn.Module):
    """Like ``MLAAttention``: a parameter derived from another layer's processed weight after loading
    (``W_UV`` from the dequantized ``kv_b_proj``), by its own ``process_weights_after_loading``, which vLLM's
    reload runs last (layerwise.py:293-307)."""

    def __init__(self, source: Linear) -> None:
        super().__init__()
        self.source = [source]  # not a child: its parameters are the linear layer's

    def process_weights_after_loading(self) -> None:
        layer = self.source[0]
        scale = layer.weight_scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        value = layer.weight.to(torch.float32) * scale
        if isinstance(getattr(self, "W", None), torch.Tensor):
            self.W.copy_(value)
        else:
            self.W = torch.nn.Parameter(value, requires_grad=False)


class Engine(torch.nn.Module):
    """A fused q/k projection and a down projection (with ``experts``, an MoE layer; with ``attention``, a
    parameter derived from the down projection after processing), loaded by HF names."""

    EXPERTS = 2

    def __init__(
        self, kernel=DeepGemmFp8BlockScaledMMKernel, experts: Fp8MoeBackend | None = None, attention: bool = False
    ) -> None:
        super().__init__()
        self.qkv = Linear(384, 256, kernel(), {"q": 0, "k": 256})
        self.down = Linear(256, 384, kernel(), {"down": 0})
        if experts is not None:
            self.experts = Experts(self.EXPERTS, experts)
        if attention:
            self.attn = Attention(self.down)  # named before "down": name order would recompute it first
        # vLLM records each layer's parameters as created, before processing (reload/layerwise.py:70-80)
        self.checkpoint_format = {
            layer: {name: (p.shape, p.dtype) for name, p in layer._parameters.items()} for layer in self.layers()
        }

    def layers(self) -> list[torch.nn.Module]:
        return [module for module in self.children() if hasattr(module, "quant_method")]

    @classmethod
    def from_checkpoint(cls, sources: dict[str, torch.Tensor], **kwargs) -> "Engine":
        """The oracle: an engine loaded from these weights by its loader, then processed (as from disk)."""
        engine = cls(**kwargs)
        engine.load_weights(sources.items())
        for layer in engine.layers():
            layer.quant_method.process_weights_after_loading(layer)
        if hasattr(engine, "attn"):
            engine.attn.process_weights_after_loading()
        return engine

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            if name.startswith("experts."):
                _, expert, attribute = name.split(".")
                param = getattr(self.experts, attribute)
                _loader(param)(param, tensor, (expert,))
                continue
            part, attribute = name.split(".")
            layer = next(layer for layer in (self.qkv, self.down) if part in layer.parts)
            first = layer.parts[part] // (1 if attribute == "weight" else BLOCK)
            param = getattr(layer, attribute)
            _loader(param)(param, tensor, (slice(first, first + tensor.shape[0]),))


def _default_loader(param: torch.Tensor, tensor: torch.Tensor, index: tuple) -> None:
    """The layers' loaders (``weight_loader_v2``): the parameter's own method, which narrows and copies."""
    param.load(tensor, index)


def _loader(param):
    return getattr(param, "weight_loader", _default_loader)


class Reload:
    """vLLM's layerwise reload (layerwise.py:84-225, 335-411), the parts the recorder sees: each layer's
    kernel tensors kept, staging tensors of the checkpoint's format in their place whose loaders buffer
    until the layer is complete; then loaded, processed by ``quant_method``, copied into the kernel tensors."""

    def __init__(self, model: Engine) -> None:
        self.model = model
        self.kernel: dict[torch.nn.Module, dict[str, torch.nn.Parameter]] = {}

    def staged(self) -> StagedLoad:
        return StagedLoad(begin=self.begin, end=self.end)

    def end(self) -> None:
        """_finalize_attention_layer: attention processed after every other layer."""
        if hasattr(self.model, "attn"):
            self.model.attn.process_weights_after_loading()

    def begin(self) -> None:
        for layer in self.model.layers():
            self.kernel[layer] = dict(layer._parameters)
            formats = self.model.checkpoint_format[layer]
            pending, size = [], sum(math.prod(shape) for shape, _ in formats.values())
            for name, (shape, dtype) in formats.items():
                staging = ModelWeightParameter(torch.empty(shape, dtype=dtype), requires_grad=False)
                staging.weight_loader = self._buffering(layer, pending, size)
                setattr(layer, name, staging)

    def _buffering(self, layer, pending, size):
        def online_process_loader(param, tensor, index):
            pending.append((param, tensor, index))
            if sum(t.numel() for _, t, _ in pending) >= size:
                for staging, loaded, where in pending:
                    _default_loader(staging, loaded, where)
                layer.quant_method.process_weights_after_loading(layer)
                for name, kernel in self.kernel[layer].items():
                    kernel.data.copy_(getattr(layer, name))
                    setattr(layer, name, kernel)

        return online_process_loader


class _Worker(RefitWorkerExtension):
    """The vLLM worker extension on CPU over ``model``, its layerwise reload the stand-in above."""

    def __init__(self, model: Engine) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.device = "cpu"
        self._reload = Reload(model)

    def _mbridge_staged_load(self, model):
        return self._reload.staged()


class _Trainer:
    """The trainer's exported FP8 tensors (its export's quantizer), rewritten in place each step."""

    def __init__(self, experts: bool = False) -> None:
        self.generator = torch.Generator().manual_seed(5)
        self.shapes = {"q": (256, 256), "k": (128, 256), "down": (256, 384)}
        if experts:
            self.shapes |= {f"experts.{e}": (256, 128) for e in range(Engine.EXPERTS)}
        self.sources: dict[str, torch.Tensor] = {}
        self.step()

    def step(self) -> None:
        for name, shape in self.shapes.items():
            weight = (torch.randn(*shape, generator=self.generator) * 0.05).bfloat16()
            weight[:BLOCK, :BLOCK] = 0  # an all-zero block: its exported scale is 1
            q, scale = quantize_reference(weight)
            prefix = f"{name}.w13_" if name.startswith("experts.") else f"{name}."
            weight_name, scale_name = f"{prefix}weight", f"{prefix}weight_scale_inv"
            if weight_name in self.sources:
                self.sources[weight_name].copy_(q)
                self.sources[scale_name].copy_(scale)
            else:
                self.sources[weight_name], self.sources[scale_name] = q, scale


def _open(worker_or_receiver, trainer: _Trainer, check: bool = True) -> tuple[str, dict]:
    recorder = LayoutRecorder()
    for name, tensor in trainer.sources.items():
        recorder.add(name, tensor)
    layout, storages = recorder.layout()
    transport = LocalTransport()
    payload = transport.share(storages)
    if isinstance(worker_or_receiver, RefitReceiver):
        report = worker_or_receiver.open(layout.to_wire(), payload, transport.name, check=check)
    else:
        report = worker_or_receiver.mbridge_refit_open(
            layout.to_wire(), payload, transport.name, check, False, rpc_version=RPC_VERSION
        )
    return layout.fingerprint, report


def _bytes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone().view(torch.uint8) for name, p in model.named_parameters()}


def _assert_engine_is(engine: torch.nn.Module, oracle: torch.nn.Module) -> None:
    expected = _bytes(oracle)
    actual = _bytes(engine)
    assert actual.keys() == expected.keys()
    wrong = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not wrong, f"engine parameters differ from an engine loaded from the same weights: {wrong}"


def test_deep_gemm_requantizes_what_the_trainer_exports():
    """The stand-in does what vLLM's DeepGEMM does to an exported checkpoint: other bytes in every weight
    and scale (power-of-two scales; the all-zero block's 1 becomes 2^-22), so copies alone cannot be exact."""
    trainer = _Trainer()
    engine = Engine.from_checkpoint(trainer.sources)
    assert not torch.equal(engine.qkv.weight_scale_inv[:2], trainer.sources["q.weight_scale_inv"])
    assert not torch.equal(engine.down.weight.view(torch.uint8), trainer.sources["down.weight"].view(torch.uint8))
    assert engine.down.weight_scale_inv[0, 0].item() == 2.0**-22
    assert torch.equal(torch.log2(engine.qkv.weight_scale_inv), torch.log2(engine.qkv.weight_scale_inv).round())


def test_a_refit_into_deep_gemm_layers_equals_an_engine_loaded_from_the_same_weights():
    """Through the vLLM worker extension: the open records the loader through the reload, finds the
    parameters DeepGEMM's processing rewrote, and has the worker process them again after every replay's
    copies; the engine then holds what an engine loaded from the same weights holds, at the open and at
    each later step. (Before: the open's check failed, "replaying the recorded copies does not reproduce
    the engine's loader".)"""
    trainer = _Trainer()
    engine = Engine.from_checkpoint(trainer.sources)
    trainer.step()
    worker = _Worker(engine)
    fingerprint, report = _open(worker, trainer)
    assert report["recomputed"] == ["down", "qkv"] and report["via_loader"] == [] and report["missing"] == []
    _assert_engine_is(engine, Engine.from_checkpoint(trainer.sources))
    storages = {name: p.untyped_storage().data_ptr() for name, p in engine.named_parameters()}
    for _ in range(2):
        trainer.step()
        worker.mbridge_refit_apply(fingerprint)
        _assert_engine_is(engine, Engine.from_checkpoint(trainer.sources))
    assert {name: p.untyped_storage().data_ptr() for name, p in engine.named_parameters()} == storages


def test_a_kernel_that_keeps_the_loaded_bytes_is_replayed_as_copies_alone():
    trainer = _Trainer()
    engine = Engine.from_checkpoint(trainer.sources, kernel=CutlassFp8BlockScaledMMKernel)
    trainer.step()
    worker = _Worker(engine)
    fingerprint, report = _open(worker, trainer)
    assert report["recomputed"] == [] and report["via_loader"] == []
    trainer.step()
    worker.mbridge_refit_apply(fingerprint)
    _assert_engine_is(engine, Engine.from_checkpoint(trainer.sources, kernel=CutlassFp8BlockScaledMMKernel))


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_parameters_processing_rewrote_without_a_way_to_process_them_again_are_refused(check):
    """An engine that names no way to process its layers again: refused by name when the plan is made, also
    when the open is not checked (before: an unchecked open replayed the exported bytes where the engine
    computes with requantized ones)."""
    trainer = _Trainer()
    engine = Engine.from_checkpoint(trainer.sources)
    receiver = RefitReceiver(engine, torch.device("cpu"), staged=Reload(engine).staged())
    with pytest.raises(ApplyPlanError, match=r"processing rewrote 4 parameter.*'down\.weight'.*VLLM_USE_DEEP_GEMM=0"):
        _open(receiver, trainer, check=check)


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (
            {"experts": Fp8MoeBackend.DEEPGEMM},
            ("1 MoE layer(s) run DeepGEMM's FP8 experts", "['experts']", "VLLM_MOE_USE_DEEP_GEMM=0"),
        ),
        (
            {"kernel": BlackwellDeepGemmKernel},
            ("2 linear layer(s) hold scales DeepGEMM re-laid out", "qkv (int32 (384, 1)", "VLLM_USE_DEEP_GEMM=0"),
        ),
    ],
    ids=["moe-experts", "packed-scales"],
)
def test_deep_gemm_processing_a_refit_cannot_redo_is_refused_by_name_before_anything_moves(kwargs, needles):
    trainer = _Trainer(experts="experts" in kwargs)
    engine = Engine.from_checkpoint(trainer.sources, **kwargs)
    before = _bytes(engine)
    trainer.step()
    with pytest.raises(EngineRefitError, match="post-processed by DeepGEMM") as refused:
        _open(_Worker(engine), trainer)
    for needle in needles:
        assert needle in str(refused.value), str(refused.value)
    after = _bytes(engine)
    assert all(torch.equal(after[name], before[name]) for name in before), "the refused open moved weights"


def test_triton_experts_keep_their_bytes_and_are_refit_by_copies():
    """vLLM's default for block-FP8 MoE at tensor parallelism on Hopper (Triton experts) alongside DeepGEMM
    linear layers: the experts are plain copies, the linear layers processed again."""
    trainer = _Trainer(experts=True)
    kwargs = {"experts": Fp8MoeBackend.TRITON}
    engine = Engine.from_checkpoint(trainer.sources, **kwargs)
    trainer.step()
    worker = _Worker(engine)
    fingerprint, report = _open(worker, trainer)
    assert report["recomputed"] == ["down", "qkv"]
    trainer.step()
    worker.mbridge_refit_apply(fingerprint)
    _assert_engine_is(engine, Engine.from_checkpoint(trainer.sources, **kwargs))


def test_a_parameter_derived_from_a_processed_layer_is_recomputed_after_that_layer_is_processed_again():
    """The replay processes the DeepGEMM layers again before it recomputes what the engine derives from them
    (MLA's W_UV reads the requantized kv_b_proj), whatever their names' order."""
    trainer = _Trainer()
    engine = Engine.from_checkpoint(trainer.sources, attention=True)
    trainer.step()

    def recompute(module):
        return module.process_weights_after_loading if isinstance(module, Attention) else reprocess(module)

    receiver = RefitReceiver(engine, torch.device("cpu"), staged=Reload(engine).staged(), recompute=recompute)
    fingerprint, report = _open(receiver, trainer)
    assert report["recomputed"] == ["down", "qkv", "attn"]
    _assert_engine_is(engine, Engine.from_checkpoint(trainer.sources, attention=True))
    trainer.step()
    receiver.apply(fingerprint)
    _assert_engine_is(engine, Engine.from_checkpoint(trainer.sources, attention=True))
