"""Tiny random Hugging Face checkpoints of the conformance matrix's models, in their published layout.

Owns how a matrix model (an architecture, or an architecture with a checkpoint variant:
``tools.tiny_configs.split_variant``) becomes a checkpoint on disk: a tiny transformers model of
its config (``tools.tiny_configs.tiny_config``) with seeded random values per tensor name, saved
with ``save_pretrained`` and then written as the family's published checkpoints hold it. All of
that knowledge is data:

* ``PUBLISHED_NAMES``: tensors transformers saves under another name than the published
  checkpoints (and Megatron-Bridge's mapping) use, renamed to theirs;
* ``FLOAT32_TENSORS``: tensors the published checkpoints store in float32 (as Megatron-Core holds them);
* ``PUBLISHED_TRANSPOSED``: packed expert tensors the published checkpoints store with their last
  two dimensions swapped relative to transformers' in-memory layout (Qwen3-VL-MoE: ``gate_up_proj``
  [E, hidden, 2*ffn], ``down_proj`` [E, ffn, hidden]; transformers 5.12.1 transposes them on load
  and does not transpose them back on save);
* ``CHECKPOINT_VARIANTS`` (``tiny_configs``): ``packed_experts`` saves transformers' own layout
  (``save_original_format=False``: routed experts as one [E, ...] tensor per projection), which
  checkpoints saved by transformers 5 without the original-format conversion hold.

The roundtrip cells compare ``convert roundtrip``'s output with these files (``checkpoint_tensors``
reads them back with plain safetensors); the export cells of a variant build their bridge from one,
as ``RefitBridge.from_hf_pretrained`` users do. ``write_checkpoint_shell`` writes the same layout
at full size with uninitialized values (benchmarks: the bridge needs the checkpoint's keys and
shapes, not its values).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Mapping

import torch

from mbridge_refit.tools.tiny_configs import (
    PACKED_EXPERTS,
    TinyConfigError,
    split_variant,
    tiny_config,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SEED = 0

# Architecture -> {name transformers writes: name the family's published checkpoints use}, where
# ``save_pretrained(save_original_format=True)`` writes a tensor under another name than the
# published checkpoints (and Megatron-Bridge's mapping) do. transformers 5.12.1 undoes its
# Nemotron-H load rename ``embedding.weight -> embeddings.weight`` (meant for checkpoints in
# Mamba's own naming) on save; NVIDIA's Nemotron-H checkpoints name it ``backbone.embeddings.weight``.
PUBLISHED_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "NemotronHForCausalLM": MappingProxyType({"backbone.embedding.weight": "backbone.embeddings.weight"}),
})

# Architecture -> HF tensors the tiny checkpoint stores in float32, as the family's checkpoints do
# and as Megatron-Core holds them (``tools.model_builder.FLOAT32_PARAMETERS``): Nemotron-H's Mamba
# A_log and D (radixark/miles#1546: its checkpoints are mixed dtype, Mamba's A_log, D, dt_bias in
# fp32; Megatron keeps dt_bias in the model dtype, so a roundtrip returns it in bf16: kept bf16 here).
FLOAT32_TENSORS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "NemotronHForCausalLM": ("*.mixer.A_log", "*.mixer.D"),
})

# Architecture -> packed expert tensors its published checkpoints store transposed in their last two
# dimensions relative to transformers' in-memory layout (Qwen/Qwen3-VL-30B-A3B-Instruct:
# gate_up_proj [128, 2048, 1536] = [E, hidden, 2*ffn]; transformers' conversion_mapping
# transposes both on load).
PUBLISHED_TRANSPOSED: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "Qwen3VLMoeForConditionalGeneration": ("*.mlp.experts.gate_up_proj", "*.mlp.experts.down_proj"),
})

PACKED_EXPERT_TENSORS = ("*.experts.gate_up_proj*", "*.experts.down_proj*")  # what a packed-experts checkpoint must hold


def write_tiny_checkpoint(model: str, out_dir: Path, *, seed: int = SEED) -> Path:
    """Save a tiny transformers model of ``model`` (an architecture, or ``architecture+variant``)
    in bf16 with seeded random values per tensor name, as the family's published checkpoints hold
    it (module docstring), in ``out_dir``."""
    import transformers

    from mbridge_refit.tools.recipes import seeded_random_values

    architecture, variant = split_variant(model)
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise TinyConfigError(f"transformers {transformers.__version__} has no model class {architecture}")
    hf_model = model_class._from_config(tiny_config(model), dtype=torch.bfloat16)
    float32 = FLOAT32_TENSORS.get(architecture, ())
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.copy_(seeded_random_values(name, param, seed))
            if _matches(name, float32):
                param.data = param.data.float()
    hf_model.save_pretrained(out_dir, save_original_format=variant != PACKED_EXPERTS)
    transposed = PUBLISHED_TRANSPOSED.get(architecture, ())
    _rewrite_tensors(
        Path(out_dir), PUBLISHED_NAMES.get(architecture, {}),
        lambda name, tensor: tensor.transpose(-1, -2).contiguous() if _matches(name, transposed) else tensor,
        touches=lambda name: _matches(name, transposed),
    )
    if variant == PACKED_EXPERTS and not any(_matches(name, PACKED_EXPERT_TENSORS) for name, _ in checkpoint_tensors(Path(out_dir))):
        raise TinyConfigError(f"{model}: transformers saves no packed expert tensor for {architecture} (the variant does not apply)")
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
    checkpoint_dir: Path, renames: Mapping[str, str], transform: Callable[[str, torch.Tensor], torch.Tensor],
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
