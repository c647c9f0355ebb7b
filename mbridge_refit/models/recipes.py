"""Recipes: the tiny models and named parallel layouts that tests and the demo run on.

Owns the ``recipes/`` folder at the repository root (data only): one JSON file per tiny model
(``{"description": ..., "hf_config": {<Hugging Face config.json content>}}``) and
``layouts.json`` (named :class:`~mbridge_refit.plan.layout.ParallelLayout` arguments). This module
loads them into typed objects, says which layouts apply to which model, lists the tensor names a
model's Hugging Face checkpoint holds, and writes seeded random checkpoints whose every tensor is
distinct, so that an export can be checked against the checkpoint on disk by exact equality.
That seeding (``seeded_random_values``, ``seed_parameters``) is the one every tiny model takes: the
tiny models of every registered architecture (``mbridge_refit.testing.tiny_models``, test support)
are filled by it too.

Nothing here downloads anything: models are built from their configs with random weights.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from mbridge_refit.checkpoints.publish import give_new_file_mode
from mbridge_refit.errors import InputError
from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout

if TYPE_CHECKING:  # transformers and torch are imported lazily: loading recipes stays cheap
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DEFAULT_LAYOUT",
    "DEFAULT_MODEL",
    "LAYOUTS",
    "LAYOUTS_FILE",
    "MODEL_RECIPES",
    "MOE_ONLY_LAYOUTS",
    "ModelRecipe",
    "RECIPES_DIR",
    "RecipeError",
    "SHAPES_DIR",
    "UnknownRecipeError",
    "compatible_layouts",
    "full_size_config",
    "full_size_shapes",
    "get_layout",
    "get_model_recipe",
    "make_random_checkpoint",
    "random_hf_model",
    "seed_parameters",
    "seeded_random_values",
]

logger = logging.getLogger(__name__)

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
LAYOUTS_FILE = "layouts.json"

DEFAULT_MODEL = "qwen3-tiny"
DEFAULT_LAYOUT = "tp2_pp2"

# Keys every recipe's hf_config must carry, and the values some of them must have.
_REQUIRED_CONFIG_KEYS = ("architectures", "model_type", "dtype", "tie_word_embeddings")
_REQUIRED_DTYPE = "bfloat16"

# Random fill: matrices ~ N(0, 0.02); norm weights ~ 1 + N(0, 0.1), so they are not all ones
# and differ from each other; any other vector (biases) ~ N(0, 0.02).
_MATRIX_STD = 0.02
_NORM_MEAN, _NORM_STD = 1.0, 0.1
_NORM_SUFFIX = "norm.weight"

# --- Checkpoint names, per model family (data). -------------------------------------------------
# Names are the Hugging Face *checkpoint* names (what Megatron-Bridge's mapping tables expect),
# not transformers' in-memory names: transformers 5 keeps MoE experts fused in memory
# (``mlp.experts.gate_up_proj``) and splits them back into per-expert tensors on save.
_GLOBAL_NAMES = ("model.embed_tokens.weight", "model.norm.weight")
_LM_HEAD = "lm_head.weight"  # absent from the checkpoint when embeddings are tied
_LAYER_NAME_GROUPS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "attention": (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        ),
        "qk_norm": ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
        "dense_mlp": ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"),
        "router": ("mlp.gate.weight",),
    }
)
_EXPERT_NAMES = (
    "mlp.experts.{expert}.gate_proj.weight",
    "mlp.experts.{expert}.up_proj.weight",
    "mlp.experts.{expert}.down_proj.weight",
)
# model_type -> name groups of a layer (a sparse layer swaps "dense_mlp" for router + experts).
_FAMILY_LAYER_GROUPS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "llama": ("attention", "dense_mlp"),
        "qwen3": ("attention", "qk_norm", "dense_mlp"),
        "qwen3_moe": ("attention", "qk_norm", "dense_mlp"),
    }
)


class RecipeError(InputError):
    """A recipe file that is missing or malformed."""


class UnknownRecipeError(InputError, KeyError):
    """A model or layout name that is not registered; the message lists the registered ones."""

    def __str__(self) -> str:  # KeyError would repr() the message and show the quotes
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRecipe:
    """One tiny model: its name, its Hugging Face config (config.json content) and what it is for."""

    name: str
    hf_config: dict[str, Any]
    description: str = ""

    @property
    def model_type(self) -> str:
        return self.hf_config["model_type"]

    @property
    def num_experts(self) -> int:
        return int(self.hf_config.get("num_experts") or self.hf_config.get("num_local_experts") or 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.hf_config["tie_word_embeddings"])

    def to_hf_config(self) -> "PretrainedConfig":
        """A fresh transformers config object built from ``hf_config``."""
        from transformers import AutoConfig

        kwargs = json.loads(json.dumps(dict(self.hf_config)))  # deep copy: configs mutate nested dicts
        model_type = kwargs.pop("model_type")
        return AutoConfig.for_model(model_type, **kwargs)

    def shape(self) -> ModelShape:
        """The dimensions a parallel layout has to divide."""
        return ModelShape.from_hf_config(self.to_hf_config())

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has routed experts (Qwen-MoE's sparse-step rule)."""
        if not self.is_moe:
            return False
        step = int(self.hf_config.get("decoder_sparse_step", 1) or 1)
        return layer not in self.hf_config.get("mlp_only_layers", ()) and (layer + 1) % step == 0

    def checkpoint_names(self) -> tuple[str, ...]:
        """Every tensor name in this model's Hugging Face checkpoint, sorted."""
        if self.model_type not in _FAMILY_LAYER_GROUPS:
            raise RecipeError(
                f"no checkpoint name table for model_type {self.model_type!r} (recipe {self.name!r}); "
                f"supported: {sorted(_FAMILY_LAYER_GROUPS)}. Add its layer groups to _FAMILY_LAYER_GROUPS."
            )
        names = list(_GLOBAL_NAMES)
        if not self.tied_embeddings:
            names.append(_LM_HEAD)
        for layer in range(int(self.hf_config["num_hidden_layers"])):
            prefix = f"model.layers.{layer}."
            for group in _FAMILY_LAYER_GROUPS[self.model_type]:
                if group == "dense_mlp" and self.is_moe_layer(layer):
                    names += [prefix + n for n in _LAYER_NAME_GROUPS["router"]]
                    names += [prefix + n.format(expert=e) for e in range(self.num_experts) for n in _EXPERT_NAMES]
                else:
                    names += [prefix + n for n in _LAYER_NAME_GROUPS[group]]
        return tuple(sorted(names))


# --- Loading the recipe folder. ---------------------------------------------------------------


def _recipes_dir() -> Path:
    if not RECIPES_DIR.is_dir():
        raise RecipeError(
            f"recipe folder {RECIPES_DIR} is missing: it ships with the repository next to the "
            f"mbridge_refit package; run from a source checkout (pip install -e .)."
        )
    return RECIPES_DIR


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{path} is not valid JSON: {exc}; fix the file.") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def _load_model_recipe(path: Path) -> ModelRecipe:
    data = _read_json(path)
    hf_config = data.get("hf_config")
    if not isinstance(hf_config, dict):
        raise RecipeError(f"{path} needs an 'hf_config' object holding the Hugging Face config.json content.")
    missing = [k for k in _REQUIRED_CONFIG_KEYS if k not in hf_config]
    if missing:
        raise RecipeError(f"{path}: hf_config lacks {missing}; every recipe must set {list(_REQUIRED_CONFIG_KEYS)}.")
    if hf_config["dtype"] != _REQUIRED_DTYPE:
        raise RecipeError(f"{path}: dtype is {hf_config['dtype']!r}; recipes are {_REQUIRED_DTYPE!r}.")
    return ModelRecipe(name=path.stem, hf_config=hf_config, description=data.get("description", ""))


def _load_model_recipes() -> dict[str, ModelRecipe]:
    folder = _recipes_dir()
    paths = sorted(p for p in folder.glob("*.json") if p.name != LAYOUTS_FILE)
    if not paths:
        raise RecipeError(f"no model recipes (*.json) in {folder}.")
    return {p.stem: _load_model_recipe(p) for p in paths}


def _load_layouts() -> tuple[dict[str, ParallelLayout], frozenset[str]]:
    path = _recipes_dir() / LAYOUTS_FILE
    if not path.is_file():
        raise RecipeError(f"{path} is missing: it names the parallel layouts (see the repository's recipes/).")
    entries = _read_json(path).get("layouts")
    if not isinstance(entries, dict) or not entries:
        raise RecipeError(f"{path} needs a non-empty 'layouts' object mapping names to layouts.")
    layouts: dict[str, ParallelLayout] = {}
    moe_only: set[str] = set()
    for name, entry in entries.items():
        try:
            layout = ParallelLayout(**entry.get("parallel", {}))
        except (TypeError, LayoutError) as exc:
            raise RecipeError(f"{path}: layout {name!r} is not a valid ParallelLayout: {exc}") from exc
        if layout.name != name:
            raise RecipeError(f"{path}: layout {name!r} describes {layout.name!r}; rename the key to {layout.name!r}.")
        needs_experts = layout.ep > 1 or layout.etp > 1
        if bool(entry.get("requires_moe", False)) != needs_experts:
            raise RecipeError(
                f"{path}: layout {name!r} must set requires_moe to {needs_experts} (ep={layout.ep}, etp={layout.etp})."
            )
        layouts[name] = layout
        if needs_experts:
            moe_only.add(name)
    return layouts, frozenset(moe_only)


MODEL_RECIPES: Mapping[str, ModelRecipe] = MappingProxyType(_load_model_recipes())
_LAYOUTS, MOE_ONLY_LAYOUTS = _load_layouts()
LAYOUTS: Mapping[str, ParallelLayout] = MappingProxyType(_LAYOUTS)


def get_model_recipe(name: str | ModelRecipe) -> ModelRecipe:
    """The registered model recipe called ``name`` (a recipe passes through)."""
    if isinstance(name, ModelRecipe):
        return name
    try:
        return MODEL_RECIPES[name]
    except KeyError:
        raise UnknownRecipeError(
            f"unknown model recipe {name!r}; supported: {sorted(MODEL_RECIPES)} (files in {RECIPES_DIR})."
        ) from None


def get_layout(name: str) -> ParallelLayout:
    """The registered parallel layout called ``name``."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise UnknownRecipeError(
            f"unknown layout {name!r}; supported: {sorted(LAYOUTS)} (see {RECIPES_DIR / LAYOUTS_FILE})."
        ) from None


def compatible_layouts(recipe: ModelRecipe | str) -> dict[str, ParallelLayout]:
    """Registered layouts that can hold ``recipe``: expert-parallel ones only for MoE models, and
    only layouts whose splits divide the model (e.g. ``pp2_vpp2`` needs 4 layers)."""
    recipe = get_model_recipe(recipe)
    shape = recipe.shape()
    out: dict[str, ParallelLayout] = {}
    for name, layout in LAYOUTS.items():
        if name in MOE_ONLY_LAYOUTS and not recipe.is_moe:
            continue
        try:
            layout.validate_model(shape)
        except LayoutError as exc:
            logger.debug("layout %s does not fit recipe %s: %s", name, recipe.name, exc)
            continue
        out[name] = layout
    return out


# --- Random checkpoints. ----------------------------------------------------------------------


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per (seed, tensor name): a tensor's values do not depend on any other tensor."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_random_values(name: str, like: "torch.Tensor", seed: int) -> "torch.Tensor":
    """Random values for the HF tensor ``name`` shaped and typed like ``like``: seeded by (seed, name),
    norms near 1, other tensors small (what the random checkpoints hold)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(_tensor_seed(seed, name))
    values = torch.randn(like.shape, generator=gen, dtype=torch.float32)
    if like.ndim == 1 and name.endswith(_NORM_SUFFIX):
        values = _NORM_MEAN + _NORM_STD * values
    else:
        values = _MATRIX_STD * values
    return values.to(like.dtype)


def seed_parameters(model: "torch.nn.Module", *, seed: int = 0, float32: tuple[str, ...] = ()) -> "torch.nn.Module":
    """``model`` (a transformers model) with every parameter set to ``seeded_random_values`` of its
    name, and those whose name matches a pattern of ``float32`` (fnmatch) made float32 afterwards.

    Tied parameters are filled once (``named_parameters`` lists a shared tensor once).
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(seeded_random_values(name, param, seed))
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in float32):
                param.data = param.data.float()
    return model


def random_hf_model(recipe: ModelRecipe | str, *, seed: int = 0) -> "PreTrainedModel":
    """The transformers model for ``recipe`` on CPU in bfloat16, every parameter seeded-random
    (``seed_parameters``)."""
    import torch
    from transformers import AutoModelForCausalLM

    recipe = get_model_recipe(recipe)
    model = AutoModelForCausalLM.from_config(recipe.to_hf_config(), dtype=torch.bfloat16)
    return seed_parameters(model, seed=seed).eval()


def _checkpoint_files(out_dir: Path) -> list[Path]:
    return sorted(p for p in out_dir.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json")))


def _names_on_disk(out_dir: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in out_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def make_random_checkpoint(
    recipe: ModelRecipe | str,
    out_dir: Path,
    *,
    seed: int = 0,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face checkpoint of ``recipe`` with seeded random weights to ``out_dir``.

    Writes ``config.json``, ``generation_config.json`` and safetensors shards (one file, or several
    plus ``model.safetensors.index.json`` when ``max_shard_bytes`` is small). Tensor names are the
    checkpoint names of :meth:`ModelRecipe.checkpoint_names` (per-expert for MoE, no
    ``lm_head.weight`` when tied); the same seed gives byte-identical files.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty, and ``overwrite`` is false.
        RuntimeError: the written tensor names differ from the expected ones.
    """
    recipe = get_model_recipe(recipe)
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory: pass a directory path.")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out_dir} is not empty: choose an empty or new directory, or pass overwrite=True "
                f"to replace the checkpoint files in it."
            )
        stale = _checkpoint_files(out_dir) + [
            p for p in (out_dir / "config.json", out_dir / "generation_config.json") if p.exists()
        ]
        for path in stale:  # only what a checkpoint consists of: never other files in the folder
            path.unlink()
        logger.info("overwrite: removed %d checkpoint files from %s", len(stale), out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = random_hf_model(recipe, seed=seed)
    save_kwargs: dict[str, Any] = {"save_original_format": True}  # per-expert names, not fused ones
    if max_shard_bytes is not None:
        save_kwargs["max_shard_size"] = int(max_shard_bytes)
    model.save_pretrained(out_dir, **save_kwargs)
    for shard in out_dir.glob("*.safetensors"):  # safetensors writes them 0o600; config.json gets the umask's mode
        give_new_file_mode(shard)

    expected, written = set(recipe.checkpoint_names()), _names_on_disk(out_dir)
    if written != expected:
        raise RuntimeError(
            f"checkpoint in {out_dir} for recipe {recipe.name!r} does not hold the expected tensor names "
            f"(the installed transformers saves a different format?). missing: {sorted(expected - written)}; "
            f"unexpected: {sorted(written - expected)}."
        )
    logger.info(
        "wrote random checkpoint %s (seed %d, %d tensors, %d safetensors files) to %s",
        recipe.name,
        seed,
        len(written),
        len(list(out_dir.glob("*.safetensors"))),
        out_dir,
    )
    return out_dir


# --- full-size shapes (benchmarks only: configs, never checkpoints) -------------------------------

SHAPES_DIR = RECIPES_DIR / "shapes"


def full_size_shapes() -> list[str]:
    """Names of the full-size model shapes in ``recipes/shapes/`` (for plan and export benchmarks)."""
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def full_size_config(name: str) -> "PretrainedConfig":
    """The HF config of a full-size shape, e.g. ``qwen3-8b``; random weights are the caller's business."""
    path = SHAPES_DIR / f"{name}.json"
    if not path.is_file():
        raise UnknownRecipeError(f"unknown shape {name!r}; supported: {', '.join(full_size_shapes())}")
    recipe = ModelRecipe(name=name, **_read_json(path))
    config = recipe.to_hf_config()
    config.architectures = list(recipe.hf_config["architectures"])  # the bridge dispatches on it
    return config
