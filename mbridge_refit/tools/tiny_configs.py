"""Tiny Hugging Face configs for every architecture Megatron-Bridge registers.

Owns the per-family config knowledge of the conformance checks (``tools.conformance``,
``scripts/check_families_gpu.py``): for an architecture name, transformers' own config class for
its model type, with the size fields it has set small (2 layers, hidden 256, 8 experts, ...), and
a few per-architecture fields its defaults get wrong at that size. All of it is data: the size
tables, ``MODEL_TYPES`` and ``CONFIG_OVERRIDES``. The architectures come from
``AutoBridge.list_supported_models()`` (``registered_architectures``), never from a hand list.

A matrix model is an architecture name, or an architecture with a checkpoint variant:
``"<architecture>+<variant>"`` (``split_variant``; ``CHECKPOINT_VARIANTS`` says what each means).
A variant changes how its tiny checkpoint is written (``tools.tiny_checkpoints``) or a few config
fields (``VARIANT_CONFIG_OVERRIDES``), and a bridge built from that checkpoint reads it with other
mappings.

Nothing here makes weights: the conformance checks fill the built Megatron model with seeded
random values.
"""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from mbridge_refit.errors import InputError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Size fields of a language model, applied where the config class has the field.
TEXT_SIZES: Mapping[str, Any] = MappingProxyType({
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 4096,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts": 8, "num_local_experts": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "n_group": 1, "topk_group": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 2,
    "vocab_size_per_layer_input": 2048,
})
# Size fields of a vision tower (``vision_config``).
VISION_SIZES: Mapping[str, Any] = MappingProxyType({
    "depth": 2, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
    "num_attention_heads": 4, "out_hidden_size": 256, "embed_dim": 256,
})
# Configs with per-layer type lists keep the first this many entries: one period of the hybrids
# registered today (linear/full attention, sliding/full) holds one layer of each kind.
HYBRID_LAYERS = 4
NESTED_SIZES: Mapping[str, Mapping[str, Any]] = MappingProxyType({"text_config": TEXT_SIZES, "vision_config": VISION_SIZES})

# Architecture -> config fields set after the sizes (nested configs as dicts, merged). For
# defaults that do not fit the tiny sizes, or fields the bridge reads that the config class
# does not define.
CONFIG_OVERRIDES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "HYV3ForCausalLM": {"first_k_dense_replace": 1},
    "GlmMoeDsaForCausalLM": {"indexer_rope_interleave": False},
    "Glm4vMoeForConditionalGeneration": {"text_config": {"head_dim": 64, "use_qk_norm": False}},
    "Glm4MoeLiteForCausalLM": {"head_dim": 32},  # an alias of qk_rope_head_dim there: keep it TEXT_SIZES'
    "Ernie4_5_VLMoeForConditionalGeneration": {"text_config": {"moe_intermediate_size": [128, 128]}},
    # Deepstack features feed the first language layers: at most as many as the first stage holds (PP2: 1).
    "Qwen3VLForConditionalGeneration": {"vision_config": {"deepstack_visual_indexes": [1]}},
    # Gemma 3's published configs switch SigLIP's attention-pooling head off (their checkpoints have
    # none, and Megatron-Bridge maps none); transformers' SigLIP builds one unless told so.
    "Gemma3ForConditionalGeneration": {"vision_config": {"vision_use_head": False}},
    # ffn 64 so an expert's gate_up slot [2*ffn, hidden] is not square: its published checkpoints
    # store it transposed, which stock tells (and a transposed read shows) only from a non-square shape.
    "Qwen3VLMoeForConditionalGeneration": {"vision_config": {"deepstack_visual_indexes": [1]}, "text_config": {"moe_intermediate_size": 64}},
})

# Checkpoint variant -> what its tiny checkpoint holds differently (``tools.tiny_checkpoints``).
PACKED_EXPERTS = "packed_experts"
MOE_BLOCK = "moe_block"
CHECKPOINT_VARIANTS: Mapping[str, str] = MappingProxyType({
    PACKED_EXPERTS: "routed experts packed in one tensor per projection ([E, ...]: transformers' own layout, "
                    "which checkpoints saved without save_original_format hold), read by the bridge's packed-expert mappings",
    MOE_BLOCK: "Gemma 4's MoE model (enable_moe_block: 26B-A4B), which the bridge builds with other layers "
               "(a MoE block beside each dense MLP, experts packed as the checkpoints hold them)",
})
# Variant -> config fields set after the architecture's own (a variant of one model class whose
# config switches the bridge to another provider). Gemma 4's MoE provider maps no per-layer input
# embeddings (with them, the plan sees checkpoint tensors no mapping reads and falls back to stock,
# which drops them): hidden_size_per_layer_input 0.
VARIANT_CONFIG_OVERRIDES: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    MOE_BLOCK: {"enable_moe_block": True, "hidden_size_per_layer_input": 0, "top_k_experts": 2},
})


# Architecture -> the model type whose config class to use, where transformers maps several model
# types to one model class and the first is not the one the bridge reads (a composite config whose
# language fields sit under ``text_config``).
MODEL_TYPES: Mapping[str, str] = MappingProxyType({
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
})


class TinyConfigError(InputError, LookupError):
    """An architecture this module cannot make a config for (the message says why)."""


def registered_architectures() -> list[str]:
    """Every architecture Megatron-Bridge registers a bridge for, sorted."""
    from megatron.bridge import AutoBridge

    return sorted(AutoBridge.list_supported_models())


def split_variant(model: str) -> tuple[str, str | None]:
    """``(architecture, variant)`` of a matrix model name (``variant`` None for a plain architecture)."""
    architecture, _, variant = model.partition("+")
    if variant and variant not in CHECKPOINT_VARIANTS:
        raise TinyConfigError(f"{model}: unknown checkpoint variant {variant!r} (known: {', '.join(CHECKPOINT_VARIANTS)})")
    return architecture, variant or None


def tiny_config(model: str, *, dtype: str = "bfloat16") -> "PretrainedConfig":
    """A tiny transformers config of ``model``'s architecture (deterministic: the same on every call).

    Raises ``TinyConfigError`` when the installed transformers has no config class for it.
    """
    architecture, variant = split_variant(model)
    config_class = _config_class(architecture)
    defaults = config_class()
    kwargs = _small_fields(defaults, TEXT_SIZES)
    for nested, sizes in NESTED_SIZES.items():
        sub = getattr(defaults, nested, None)
        if sub is not None:
            kwargs[nested] = {**sub.to_dict(), **_small_fields(sub, sizes)}
    _merge(kwargs, CONFIG_OVERRIDES.get(architecture, {}))
    _merge(kwargs, VARIANT_CONFIG_OVERRIDES.get(variant, {}))
    config = config_class(**kwargs)
    config.architectures = [architecture]
    config.torch_dtype = dtype
    return config


def _config_class(architecture: str) -> type:
    """transformers' config class for the model type whose model class is ``architecture``."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    if architecture in MODEL_TYPES:
        return CONFIG_MAPPING[MODEL_TYPES[architecture]]

    mappings = (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        modeling_auto.MODEL_MAPPING_NAMES,
    )
    for mapping in mappings:
        model_type = next((t for t, arch in mapping.items() if arch == architecture), None)
        if model_type is not None and model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type]
    raise TinyConfigError(
        f"transformers {transformers.__version__} has no config class for {architecture} "
        f"(its checkpoints ship their own code)"
    )


def _small_fields(config: Any, sizes: Mapping[str, Any]) -> dict[str, Any]:
    """The size fields ``config`` has, set small; per-layer type lists (``layer_types``,
    ``mlp_layer_types``, ...) cut to their first ``HYBRID_LAYERS`` entries."""
    small = {k: v for k, v in sizes.items() if hasattr(config, k)}
    per_layer = {k: v for k, v in vars(config).items() if k.endswith("layer_types") and isinstance(v, (list, tuple)) and v}
    if per_layer:
        small.update(num_hidden_layers=HYBRID_LAYERS, **{k: list(v[:HYBRID_LAYERS]) for k, v in per_layer.items()})
    return small


def _merge(kwargs: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """``overrides`` into ``kwargs``, dicts merged key by key (a nested config keeps its other fields)."""
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(kwargs.get(key), dict):
            _merge(kwargs[key], value)
        else:
            kwargs[key] = copy.deepcopy(value)
