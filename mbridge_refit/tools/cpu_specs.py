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
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear


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
        gamma = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        shape = (input_.shape[-1],)
        if self.normalization == "LayerNorm":
            normed = torch.nn.functional.layer_norm(input_, shape, gamma, self.layer_norm_bias, self.eps)
        else:
            normed = torch.nn.functional.rms_norm(input_, shape, gamma, self.eps)
        return super().forward(normed, *args, **kwargs)


@functools.cache
def te_to_local() -> dict[type, Any]:
    """Transformer Engine module class -> the class a CPU build uses instead (None: leave unset)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return {
        te.TELayerNormColumnParallelLinear: LayerNormColumnParallelLinear,
        te.TEColumnParallelLinear: ColumnParallelLinear,
        te.TERowParallelLinear: RowParallelLinear,
        te.TEDotProductAttention: DotProductAttention,
        te.TENorm: WrappedTorchNorm,
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


def hybrid_stack_spec(configured: Any, config: Any) -> Any:
    """Megatron-Core's hybrid stack spec (Mamba, attention, MLP and MoE layers: Nemotron-H) built
    for CPU: the spec the provider resolves from ``configured`` (its ``hybrid_stack_spec`` field:
    None for Megatron-Bridge's default, a ``ModuleSpec``, or a builder), with local modules.

    The stack's Transformer Engine classes are replaced as in ``to_local``. Its MoE layer is built
    upstream with Transformer Engine's grouped experts (``TEGroupedMLP``, ``weight0..N``); the CPU
    build uses Megatron's sequential experts (``local_experts.N``), as every CPU build here does:
    the bridge maps both to the same HF tensors.
    """
    from megatron.bridge.models.hybrid.hybrid_provider import get_default_hybrid_stack_spec
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if configured is None:
        spec = get_default_hybrid_stack_spec(config)
    elif isinstance(configured, ModuleSpec):
        spec = configured
    else:
        spec = configured(config) if inspect.signature(configured).parameters else configured()
    local = to_local(spec)
    moe_layer = local.submodules.moe_layer
    sequential_moe = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts or 1, moe_grouped_gemm=False)
    moe_layer = dataclasses.replace(moe_layer, submodules=dataclasses.replace(moe_layer.submodules, mlp=sequential_moe))
    return dataclasses.replace(local, submodules=dataclasses.replace(local.submodules, moe_layer=moe_layer))
