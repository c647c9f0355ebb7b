"""CPU variants of Transformer Engine layer specs that have no local-spec switch.

Megatron-Core's hybrid block spec with an experimental attention variant (Qwen3-Next's and
Qwen3.5's gated delta net, ``get_transformer_block_with_experimental_attention_variant_spec``)
only builds Transformer Engine modules, which need CUDA. This module builds the same spec with
each Transformer Engine class replaced by its local (CPU) counterpart (``TE_TO_LOCAL``), so the
model has the same parameters, with the same names, shapes and tensor-parallel attributes, as
the GPU build: what an export reads.

The one Transformer Engine module without a local counterpart is the fused layer norm + column
parallel linear (``TELayerNormColumnParallelLinear``: GDN's ``in_proj``, attention's
``linear_qkv``); ``LayerNormColumnParallelLinear`` stands in for it with the same two parameters
(``weight``, column parallel, and ``layer_norm_weight``, replicated). Its class name keeps the
substring Megatron-Bridge detects fused norms by, so the bridge maps it as it maps TE's.

Families whose spec is built out of reach (inside a provider's ``provide``: Gemma 3's vision
model, the Qwen3-VL and Qwen3.5 language and vision towers) or whose modules create Transformer
Engine modules themselves (Megatron-Bridge's ``TERowParallelLinearLayerNorm`` builds a ``TENorm``)
are built inside ``te_modules_built_local``: while it is active, constructing a Transformer Engine
class constructs its stand-in instead (``te_to_local``, and ``te_subclass_stand_ins`` for the
subclasses Megatron-Bridge defines). A subclass with no stand-in raises, naming itself: mapping it
to its base's stand-in could drop the parameters it adds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Iterator, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """A norm (``config.normalization``) followed by a column-parallel linear, on CPU.

    The signature and parameters of Transformer Engine's ``TELayerNormColumnParallelLinear``
    (``layer_norm_weight``, and ``layer_norm_bias`` for LayerNorm, replicated over tensor ranks).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.normalization = config.normalization
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = config.layernorm_epsilon
        initial = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(initial(input_size, dtype=config.params_dtype))
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        normed = normalize(input_, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma)
        return super().forward(normed, *args, **kwargs)


class TorchNorm(torch.nn.Module):
    """``TENorm`` on CPU: ``config.normalization`` over the last dimension, with the parameters of
    Transformer Engine's norms (``weight``, and ``bias`` for LayerNorm, in ``config.params_dtype``)
    and their zero-centered gamma (``1 + weight`` when ``config.layernorm_zero_centered_gamma``).
    ``has_residual`` asks for a residual fused into the norm when ``config.fused_residual_rmsnorm``
    is set, which CPU builds turn off (``model_builder.CPU_PROVIDER_OVERRIDES``)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"TENorm supports LayerNorm and RMSNorm, not {config.normalization!r}")
        if has_residual and config.fused_residual_rmsnorm:
            raise ValueError("fused_residual_rmsnorm needs Transformer Engine: set it False to build on CPU.")
        self.normalization = config.normalization
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.eps = eps
        initial = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(initial(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if self.normalization == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return normalize(input_, self.normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)


def normalize(input_: torch.Tensor, normalization: str, weight: torch.Tensor, bias: Optional[torch.Tensor],
              eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm or RMSNorm of ``input_``'s last dimension, the gamma ``1 + weight`` when zero-centered."""
    gamma = weight + 1 if zero_centered_gamma else weight
    shape = (input_.shape[-1],)
    if normalization == "LayerNorm":
        return torch.nn.functional.layer_norm(input_, shape, gamma, bias, eps)
    return torch.nn.functional.rms_norm(input_, shape, gamma, eps)


@functools.cache
def te_to_local() -> dict[type, Any]:
    """Transformer Engine module class -> the class a CPU build uses instead (None: leave unset)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    return {
        te.TELayerNormColumnParallelLinear: LayerNormColumnParallelLinear,
        te.TEColumnParallelLinear: ColumnParallelLinear,
        te.TERowParallelLinear: RowParallelLinear,
        te.TEDotProductAttention: DotProductAttention,
        te.TENorm: TorchNorm,
        te.TEActivationOp: None,  # MLP then uses config.activation_func
    }


def to_local(spec: Any) -> Any:
    """``spec`` with every Transformer Engine class replaced (``te_to_local``), recursively through
    ``ModuleSpec``s, ``functools.partial`` builders, submodule dataclasses and lists."""
    table = te_to_local()
    if isinstance(spec, type) and spec in table:
        return table[spec]
    if isinstance(spec, functools.partial):
        return functools.partial(to_local(spec.func), *map(to_local, spec.args), **{k: to_local(v) for k, v in spec.keywords.items()})
    if isinstance(spec, list):
        return [to_local(item) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{
            f.name: to_local(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.init
        })
    return spec


def experimental_attention_block_spec(config: Any, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> Any:
    """``get_transformer_block_with_experimental_attention_variant_spec`` built for CPU: the same
    layers (its per-layer attention / MLP patterns and pipeline slicing) with local modules."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs

    layer_specs = specs.get_transformer_layer_with_experimental_attention_variant_spec(config=config, backend=TESpecProvider())
    if config.pipeline_model_parallel_layout is not None:
        local_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=specs.LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = specs.get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + specs.get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    rms_norm = config.normalization == "RMSNorm"
    block = specs.TransformerBlockSubmodules(
        layer_specs=[layer_specs[i] for i in local_ids],
        layer_norm=TESpecProvider().layer_norm(rms_norm=rms_norm, for_qk=False),
    )
    return to_local(block)


# --- Transformer Engine classes constructed during a CPU build. ----------------------------------


class RowParallelLinearLayerNorm(RowParallelLinear):
    """A row-parallel linear whose output goes through a norm (``config.normalization``), on CPU.

    The signature and parameters of Megatron-Bridge's ``TERowParallelLinearLayerNorm`` (Gemma 2 and
    3, EXAONE 4: the post-attention and post-MLP norms): the linear's ``weight`` (row parallel) and
    ``post_layernorm.weight`` (a ``TENorm`` there, replicated over tensor ranks).
    """

    def __init__(self, input_size: int, output_size: int, *, config: Any, **kwargs: Any):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.post_layernorm = TorchNorm(config, output_size)

    def forward(self, input_: torch.Tensor):
        output, bias = super().forward(input_)
        if bias is not None:
            raise ValueError("RowParallelLinearLayerNorm needs add_bias_linear=False: a deferred bias would be added after the norm.")
        return self.post_layernorm(output), bias


class Gemma3DotProductAttention(DotProductAttention):
    """Megatron-Bridge's ``Gemma3TEDotProductAttention`` on CPU (no parameters): a sliding window of
    ``config.window_size`` on Gemma 3's local layers, global attention on the others, and the
    vision-language model's own mask (no mask type: its attention bias carries it)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: Optional[float] = None, **kwargs: Any):
        from megatron.bridge.models.gemma.gemma3_provider import _is_local_attn_layer
        from megatron.core.transformer.enums import AttnMaskType

        config = copy.deepcopy(config)
        local = _is_local_attn_layer(layer_number, config.interleaved_attn_pattern)
        config.window_size = (config.window_size - 1, 0) if local and not config.is_vision_language else None
        if config.is_vision_language:
            attn_mask_type = AttnMaskType.no_mask
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout, **kwargs)


@functools.cache
def te_subclass_stand_ins() -> dict[type, type]:
    """Megatron-Bridge's subclasses of Transformer Engine modules -> the class a CPU build uses."""
    from megatron.bridge.models.common.te_layers import TERowParallelLinearLayerNorm
    from megatron.bridge.models.gemma.gemma3_provider import Gemma3TEDotProductAttention

    return {
        TERowParallelLinearLayerNorm: RowParallelLinearLayerNorm,
        Gemma3TEDotProductAttention: Gemma3DotProductAttention,
    }


def stand_in_for(te_class: type) -> type:
    """The CPU class constructed in place of ``te_class`` (raises when there is none)."""
    stand_ins = {**te_to_local(), **te_subclass_stand_ins()}
    stand_in = stand_ins.get(te_class)
    if stand_in is None:
        raise NotImplementedError(
            f"{te_class.__module__}.{te_class.__qualname__} is a Transformer Engine module with no CPU stand-in "
            "with the same parameters: add one to mbridge_refit/tools/cpu_specs.py (te_to_local for Megatron-Core's classes, "
            "te_subclass_stand_ins for Megatron-Bridge's), or build on a GPU."
        )
    return stand_in


@contextlib.contextmanager
def te_modules_built_local() -> Iterator[None]:
    """Inside the block, constructing a Transformer Engine module (any subclass of its base module,
    or a factory of ``te_to_local``) constructs its stand-in (``stand_in_for``) with the same
    arguments, or raises naming the class when it has none."""

    def construct_stand_in(cls: type, *args: Any, **kwargs: Any) -> Any:
        return stand_in_for(cls)(*args, **kwargs)  # not a cls instance: Python skips cls.__init__

    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    # Every Transformer Engine module derives from its base module; TENorm and TEActivationOp are factories.
    te_classes = [TransformerEngineBaseModule, *(cls for cls in te_to_local() if not issubclass(cls, TransformerEngineBaseModule))]
    own_new = {cls: cls.__dict__["__new__"] for cls in te_classes if "__new__" in cls.__dict__}
    try:
        for cls in te_classes:
            cls.__new__ = staticmethod(construct_stand_in)
        yield
    finally:
        for cls in te_classes:
            if cls in own_new:
                cls.__new__ = own_new[cls]
            else:
                del cls.__new__
