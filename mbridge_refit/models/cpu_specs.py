"""CPU builds of Transformer Engine layer specs and modules: which local stand-in with the same
parameters (``models.cpu_stand_ins``) replaces each Transformer Engine class, and how a build gets it.

Megatron-Core's hybrid block spec with an experimental attention variant (Qwen3-Next's and
Qwen3.5's gated delta net, ``get_transformer_block_with_experimental_attention_variant_spec``)
only builds Transformer Engine modules, which need CUDA. This module builds the same spec with
each Transformer Engine class replaced by its local (CPU) counterpart (``te_to_local``), so the
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
Megatron's decoder block spec (``get_gpt_decoder_block_spec``, bound with
``use_transformer_engine``: DeepSeek-V2/V3, GLM-4.5, MiniMax-M3 ...) has a local variant, but its
parameters differ from the Transformer Engine build: local multi-latent attention splits the
q/kv down projections over tensor-parallel ranks (TE duplicates them) and keeps the q/kv norms
apart (TE fuses them into the up projections), and local experts are ``SequentialMLP``
(``local_experts.N.linear_fc1.weight``) where TE's are grouped (``experts.linear_fc1.weightN``),
which some bridges map only. ``transformer_engine_block_spec`` therefore builds the TE spec with
stand-ins (``mla_and_grouped_expert_stand_ins``): Megatron's modelopt ``Linear`` for the
duplicated ``TELinear`` (the bridge is told it is replicated, as it detects ``TELinear``), a
``DotProductAttention`` taking TE's ``k_channels``/``v_channels`` (core attention has no
parameters), and grouped linears with TE's ``weight0..weightN-1`` and the attributes Megatron
sets on them. The fused norm + linear that multi-latent attention's norm resolver asks Transformer
Engine's backend for is built as its stand-in too (``te_modules_built_local``, below).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Iterator, Optional

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from mbridge_refit.models.cpu_stand_ins import (
    ColumnParallelGroupedLinear,
    CoreAttention,
    Gemma3DotProductAttention,
    Gemma4DotProductAttention,
    LayerNormColumnParallelLinear,
    RowParallelGroupedLinear,
    RowParallelLinearLayerNorm,
    TorchNorm,
    register_stand_in_types,
)

__all__ = [
    "experimental_attention_block_spec",
    "hybrid_stack_spec",
    "mla_and_grouped_expert_stand_ins",
    "stand_in_for",
    "te_modules_built_local",
    "te_subclass_stand_ins",
    "te_to_local",
    "to_local",
    "transformer_engine_block_spec",
]


@functools.cache
def te_to_local() -> dict[type, Any]:
    """Transformer Engine module class -> the class a CPU build uses instead (None: leave unset)."""
    from megatron.core.extensions import transformer_engine as te

    return {
        te.TELayerNormColumnParallelLinear: LayerNormColumnParallelLinear,
        te.TEColumnParallelLinear: ColumnParallelLinear,
        te.TERowParallelLinear: RowParallelLinear,
        te.TENorm: TorchNorm,
        te.TEActivationOp: None,  # MLP then uses config.activation_func
        **mla_and_grouped_expert_stand_ins(),
    }


def mla_and_grouped_expert_stand_ins() -> dict[type, Any]:
    """The stand-ins multi-latent attention and grouped experts need (module docstring)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.post_training.modelopt.layers import Linear

    return {
        te.TEDotProductAttention: CoreAttention,
        te.TELinear: Linear,  # MLA's down projections: duplicated over tensor-parallel ranks
        te.TEColumnParallelGroupedLinear: ColumnParallelGroupedLinear,
        te.TERowParallelGroupedLinear: RowParallelGroupedLinear,
    }


def to_local(spec: Any) -> Any:
    """``spec`` with every Transformer Engine class replaced (``te_to_local``), recursively through
    ``ModuleSpec``s, ``functools.partial`` builders, submodule dataclasses and lists."""
    table = te_to_local()
    if isinstance(spec, type) and spec in table:
        return table[spec]
    if isinstance(spec, functools.partial):
        return functools.partial(
            to_local(spec.func), *map(to_local, spec.args), **{k: to_local(v) for k, v in spec.keywords.items()}
        )
    if isinstance(spec, list):
        return [to_local(item) for item in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(
            spec, **{f.name: to_local(getattr(spec, f.name)) for f in dataclasses.fields(spec) if f.init}
        )
    return spec


def experimental_attention_block_spec(
    config: Any, vp_stage: Optional[int] = None, pp_rank: Optional[int] = None
) -> Any:
    """``get_transformer_block_with_experimental_attention_variant_spec`` built for CPU: the same
    layers (its per-layer attention / MLP patterns and pipeline slicing) with local modules."""
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import (
        experimental_attention_variant_module_specs as specs,
    )

    layer_specs = specs.get_transformer_layer_with_experimental_attention_variant_spec(
        config=config, backend=TESpecProvider()
    )
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


@functools.cache
def te_subclass_stand_ins() -> dict[type, type]:
    """Megatron-Bridge's subclasses of Transformer Engine modules -> the class a CPU build uses."""
    from megatron.bridge.models.common.te_layers import TERowParallelLinearLayerNorm
    from megatron.bridge.models.gemma.gemma3_provider import Gemma3TEDotProductAttention
    from megatron.bridge.models.gemma.modeling_gemma4 import Gemma4TEDotProductAttention

    return {
        TERowParallelLinearLayerNorm: RowParallelLinearLayerNorm,
        Gemma3TEDotProductAttention: Gemma3DotProductAttention,
        Gemma4TEDotProductAttention: Gemma4DotProductAttention,
    }


def stand_in_for(te_class: type) -> type:
    """The CPU class constructed in place of ``te_class`` (raises when there is none)."""
    stand_ins = {**te_to_local(), **te_subclass_stand_ins()}
    stand_in = stand_ins.get(te_class)
    if stand_in is None:
        raise NotImplementedError(
            f"{te_class.__module__}.{te_class.__qualname__} is a Transformer Engine module with no CPU stand-in "
            "with the same parameters: add one to mbridge_refit/models/cpu_stand_ins.py and map it in mbridge_refit/models/cpu_specs.py "
            "(te_to_local for Megatron-Core's classes, te_subclass_stand_ins for Megatron-Bridge's), or build on a GPU."
        )
    return stand_in


@contextlib.contextmanager
def te_modules_built_local() -> Iterator[None]:
    """Inside the block, constructing a Transformer Engine module (any subclass of its base module,
    or a factory of ``te_to_local``) constructs its stand-in (``stand_in_for``) with the same
    arguments, or raises naming the class when it has none."""

    def construct_stand_in(cls: type, *args: Any, **kwargs: Any) -> Any:
        return stand_in_for(cls)(*args, **kwargs)  # not a cls instance: Python skips cls.__init__

    register_stand_in_types()

    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    # Every Transformer Engine module derives from its base module; TENorm and TEActivationOp are factories.
    te_classes = [
        TransformerEngineBaseModule,
        *(cls for cls in te_to_local() if not issubclass(cls, TransformerEngineBaseModule)),
    ]
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


def transformer_engine_block_spec(spec: functools.partial, config: Any, vp_stage: Optional[int] = None) -> Any:
    """A block spec builder that takes ``use_transformer_engine`` (Megatron's decoder block spec:
    multi-latent attention, grouped experts, dense first layers) built for CPU: its Transformer
    Engine spec, the same layers and parameters as the GPU build, with local modules (``to_local``).
    Bind ``spec`` with ``functools.partial``; the provider passes ``config`` and ``vp_stage``."""
    keywords = {**spec.keywords, "use_transformer_engine": True}
    if "vp_stage" in inspect.signature(spec.func).parameters:
        keywords["vp_stage"] = vp_stage
    return to_local(spec.func(config, *spec.args, **keywords))


def hybrid_stack_spec(configured: Any, config: Any) -> Any:
    """Megatron-Core's hybrid stack spec (Mamba, attention, MLP and MoE layers: Nemotron-H) built
    for CPU: the spec the provider resolves from ``configured`` (its ``hybrid_stack_spec`` field:
    None for Megatron-Bridge's default, a ``ModuleSpec``, or a builder), with local modules.

    The stack's Transformer Engine classes are replaced as in ``to_local``. Its MoE layer is built
    upstream with Transformer Engine's grouped experts (``TEGroupedMLP``, ``weight0..N``); the CPU
    build uses Megatron's sequential experts (``local_experts.N``), as every CPU build here does:
    the bridge maps both to the same HF tensors.
    """
    from megatron.bridge.models.hybrid.hybrid_provider import (
        get_default_hybrid_stack_spec,
    )
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
