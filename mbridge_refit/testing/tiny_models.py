"""Tiny models of every architecture Megatron-Bridge registers: their configs and their random
checkpoints in the published layout (test support: the conformance matrix, its GPU run and the
benchmarks that need a checkpoint's keys and shapes).

Configs. For an architecture name, transformers' own config class for its model type, with the
size fields it has set small (2 layers, hidden 256, 8 experts, ...), and a few per-architecture
fields its defaults get wrong at that size. All of it is data: the size tables, ``MODEL_TYPES`` and
``CONFIG_OVERRIDES``. The architectures come from ``AutoBridge.list_supported_models()``
(``registered_architectures``), never from a hand list.

A matrix model is an architecture name, or an architecture with a checkpoint variant:
``"<architecture>+<variant>"`` (``split_variant``; ``CHECKPOINT_VARIANTS`` says what each means).
A variant changes how its tiny checkpoint is written or a few config fields
(``VARIANT_CONFIG_OVERRIDES``), and a bridge built from that checkpoint reads it with other mappings.

Checkpoints (``write_tiny_checkpoint``). A tiny transformers model of the config, every tensor
seeded by its name as the named recipes' checkpoints are (``models.recipes.seed_parameters``: one
seeding for every tiny model), saved with ``save_pretrained`` and then written as the family's
published checkpoints hold it. That knowledge is data too:

* ``PUBLISHED_NAMES``: tensors transformers saves under another name than the published
  checkpoints (and Megatron-Bridge's mapping) use, renamed to theirs;
* ``FLOAT32_TENSORS``: tensors the published checkpoints store in float32 (as Megatron-Core holds them);
* ``PUBLISHED_TRANSPOSED``: packed expert tensors the published checkpoints store with their last
  two dimensions swapped relative to transformers' in-memory layout (Qwen3-VL-MoE: ``gate_up_proj``
  [E, hidden, 2*ffn], ``down_proj`` [E, ffn, hidden]; transformers 5.12.1 transposes them on load
  and does not transpose them back on save);
* ``PACKED_EXPERTS`` saves transformers' own layout (``save_original_format=False``: routed experts
  as one [E, ...] tensor per projection), which checkpoints saved by transformers 5 without the
  original-format conversion hold.

The roundtrip cells compare ``convert roundtrip``'s output with these files (``checkpoint_tensors``
reads them back with plain safetensors); the export cells of a variant build their bridge from one,
as ``RefitBridge.from_hf_pretrained`` users do. ``write_checkpoint_shell`` writes the same layout
at full size with uninitialized values (benchmarks: the bridge needs the checkpoint's keys and
shapes, not its values).
"""

from __future__ import annotations

import copy
import fnmatch
import json
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from mbridge_refit.errors import InputError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "CHECKPOINT_VARIANTS",
    "CONFIG_OVERRIDES",
    "FLOAT32_TENSORS",
    "HYBRID_LAYERS",
    "MODEL_TYPES",
    "MOE_BLOCK",
    "NESTED_SIZES",
    "PACKED_EXPERTS",
    "PACKED_EXPERT_TENSORS",
    "PUBLISHED_NAMES",
    "PUBLISHED_TRANSPOSED",
    "SEED",
    "TEXT_SIZES",
    "TinyConfigError",
    "VARIANT_CONFIG_OVERRIDES",
    "VISION_SIZES",
    "checkpoint_tensors",
    "registered_architectures",
    "split_variant",
    "tiny_config",
    "write_checkpoint_shell",
    "write_tiny_checkpoint",
]

# Size fields of a language model, applied where the config class has the field.
TEXT_SIZES: Mapping[str, Any] = MappingProxyType(
    {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 2048,
        "max_position_embeddings": 4096,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "num_experts": 8,
        "num_local_experts": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "n_group": 1,
        "topk_group": 1,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 2,
        "vocab_size_per_layer_input": 2048,
    }
)
# Size fields of a vision tower (``vision_config``).
VISION_SIZES: Mapping[str, Any] = MappingProxyType(
    {
        "depth": 2,
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 4,
        "num_attention_heads": 4,
        "out_hidden_size": 256,
        "embed_dim": 256,
    }
)
# Configs with per-layer type lists keep the first this many entries: one period of the hybrids
# registered today (linear/full attention, sliding/full) holds one layer of each kind.
HYBRID_LAYERS = 4
NESTED_SIZES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {"text_config": TEXT_SIZES, "vision_config": VISION_SIZES}
)

# Architecture -> config fields set after the sizes (nested configs as dicts, merged). For
# defaults that do not fit the tiny sizes, or fields the bridge reads that the config class
# does not define.
CONFIG_OVERRIDES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
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
        "Qwen3VLMoeForConditionalGeneration": {
            "vision_config": {"deepstack_visual_indexes": [1]},
            "text_config": {"moe_intermediate_size": 64},
        },
    }
)

# Checkpoint variant -> what its tiny checkpoint holds differently (``write_tiny_checkpoint``).
PACKED_EXPERTS = "packed_experts"
MOE_BLOCK = "moe_block"
CHECKPOINT_VARIANTS: Mapping[str, str] = MappingProxyType(
    {
        PACKED_EXPERTS: "routed experts packed in one tensor per projection ([E, ...]: transformers' own layout, "
        "which checkpoints saved without save_original_format hold), read by the bridge's packed-expert mappings",
        MOE_BLOCK: "Gemma 4's MoE model (enable_moe_block: 26B-A4B), which the bridge builds with other layers "
        "(a MoE block beside each dense MLP, experts packed as the checkpoints hold them)",
    }
)
# Variant -> config fields set after the architecture's own (a variant of one model class whose
# config switches the bridge to another provider). Gemma 4's MoE provider maps no per-layer input
# embeddings (with them, the plan sees checkpoint tensors no mapping reads and falls back to stock,
# which drops them): hidden_size_per_layer_input 0.
VARIANT_CONFIG_OVERRIDES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        MOE_BLOCK: {"enable_moe_block": True, "hidden_size_per_layer_input": 0, "top_k_experts": 2},
    }
)


# Architecture -> the model type whose config class to use, where transformers maps several model
# types to one model class and the first is not the one the bridge reads (a composite config whose
# language fields sit under ``text_config``).
MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "Qwen3_5ForCausalLM": "qwen3_5_text",
        "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    }
)


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
        raise TinyConfigError(
            f"{model}: unknown checkpoint variant {variant!r} (known: {', '.join(CHECKPOINT_VARIANTS)})"
        )
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
    per_layer = {
        k: v for k, v in vars(config).items() if k.endswith("layer_types") and isinstance(v, (list, tuple)) and v
    }
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


# --- Checkpoints. -------------------------------------------------------------------------------

SEED = 0

# Architecture -> {name transformers writes: name the family's published checkpoints use}, where
# ``save_pretrained(save_original_format=True)`` writes a tensor under another name than the
# published checkpoints (and Megatron-Bridge's mapping) do. transformers 5.12.1 undoes its
# Nemotron-H load rename ``embedding.weight -> embeddings.weight`` (meant for checkpoints in
# Mamba's own naming) on save; NVIDIA's Nemotron-H checkpoints name it ``backbone.embeddings.weight``.
PUBLISHED_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "NemotronHForCausalLM": MappingProxyType({"backbone.embedding.weight": "backbone.embeddings.weight"}),
    }
)

# Architecture -> HF tensors the tiny checkpoint stores in float32, as the family's checkpoints do
# and as Megatron-Core holds them (``models.builder.FLOAT32_PARAMETERS``): Nemotron-H's Mamba
# A_log and D (radixark/miles#1546: its checkpoints are mixed dtype, Mamba's A_log, D, dt_bias in
# fp32; Megatron keeps dt_bias in the model dtype, so a roundtrip returns it in bf16: kept bf16 here).
FLOAT32_TENSORS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "NemotronHForCausalLM": ("*.mixer.A_log", "*.mixer.D"),
    }
)

# Architecture -> packed expert tensors its published checkpoints store transposed in their last two
# dimensions relative to transformers' in-memory layout (Qwen/Qwen3-VL-30B-A3B-Instruct:
# gate_up_proj [128, 2048, 1536] = [E, hidden, 2*ffn]; transformers' conversion_mapping
# transposes both on load).
PUBLISHED_TRANSPOSED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "Qwen3VLMoeForConditionalGeneration": ("*.mlp.experts.gate_up_proj", "*.mlp.experts.down_proj"),
    }
)

PACKED_EXPERT_TENSORS = (
    "*.experts.gate_up_proj*",
    "*.experts.down_proj*",
)  # what a packed-experts checkpoint must hold


def write_tiny_checkpoint(model: str, out_dir: Path, *, seed: int = SEED) -> Path:
    """Save a tiny transformers model of ``model`` (an architecture, or ``architecture+variant``)
    in bf16 with seeded random values per tensor name, as the family's published checkpoints hold
    it (module docstring), in ``out_dir``."""
    import transformers

    from mbridge_refit.models.recipes import seed_parameters

    architecture, variant = split_variant(model)
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise TinyConfigError(f"transformers {transformers.__version__} has no model class {architecture}")
    hf_model = model_class._from_config(tiny_config(model), dtype=torch.bfloat16)
    seed_parameters(hf_model, seed=seed, float32=FLOAT32_TENSORS.get(architecture, ()))
    hf_model.save_pretrained(out_dir, save_original_format=variant != PACKED_EXPERTS)
    transposed = PUBLISHED_TRANSPOSED.get(architecture, ())
    _rewrite_tensors(
        Path(out_dir),
        PUBLISHED_NAMES.get(architecture, {}),
        lambda name, tensor: tensor.transpose(-1, -2).contiguous() if _matches(name, transposed) else tensor,
        touches=lambda name: _matches(name, transposed),
    )
    if variant == PACKED_EXPERTS and not any(
        _matches(name, PACKED_EXPERT_TENSORS) for name, _ in checkpoint_tensors(Path(out_dir))
    ):
        raise TinyConfigError(
            f"{model}: transformers saves no packed expert tensor for {architecture} (the variant does not apply)"
        )
    return Path(out_dir)


def checkpoint_tensors(checkpoint_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors files in ``checkpoint_dir``, sorted by name (plain safetensors)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys())
    return sorted(tensors.items())


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _rewrite_tensors(
    checkpoint_dir: Path,
    renames: Mapping[str, str],
    transform: Callable[[str, torch.Tensor], torch.Tensor],
    touches: Callable[[str], bool],
) -> None:
    """Rewrite the checkpoint's files that hold a tensor to rename (``renames``) or to change
    (``touches``): each tensor renamed and passed through ``transform``; the index follows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
            if not any(name in renames or touches(name) for name in names):
                continue
            metadata = handle.metadata()
            tensors = {renames.get(name, name): transform(name, handle.get_tensor(name)) for name in names}
        save_file(tensors, str(path), metadata=metadata)
    index = checkpoint_dir / "model.safetensors.index.json"
    if renames and index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {renames.get(name, name): file for name, file in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def write_checkpoint_shell(config: "PretrainedConfig", out_dir: Path) -> Path:
    """A checkpoint of ``config``'s model at its full size whose tensors have the names and shapes
    the family's published checkpoints hold (``PUBLISHED_NAMES``, ``PUBLISHED_TRANSPOSED``) and
    uninitialized values, with its ``config.json``: for building a bridge the way users build it
    (``from_hf_pretrained``: mappings chosen from the checkpoint's keys and shapes) when the values
    do not matter (benchmarks of models whose weights are random anyway). transformers' in-memory
    layout is taken as the published one apart from those tables (experts packed where transformers
    packs them)."""
    import transformers
    from safetensors.torch import save_file

    architecture = config.architectures[0]
    with torch.device("meta"):
        hf_model = getattr(transformers, architecture)._from_config(config, dtype=torch.bfloat16)
    renames, transposed = PUBLISHED_NAMES.get(architecture, {}), PUBLISHED_TRANSPOSED.get(architecture, ())
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        shape = tuple(tensor.shape)
        if _matches(name, transposed):
            shape = (*shape[:-2], shape[-1], shape[-2])
        tensors[renames.get(name, name)] = torch.empty(shape, dtype=tensor.dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
