"""Tests for mbridge_refit.models.recipes: every recipe builds a checkpoint that transformers loads back
exactly, with the checkpoint names Megatron-Bridge expects; layouts load and fit their models."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from mbridge_refit.models import recipes
from mbridge_refit.models.recipes import (
    LAYOUTS,
    MODEL_RECIPES,
    ModelRecipe,
    RecipeError,
    UnknownRecipeError,
    compatible_layouts,
    get_layout,
    get_model_recipe,
    make_random_checkpoint,
    random_hf_model,
)
from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout

RECIPE_NAMES = sorted(MODEL_RECIPES)
DENSE = [n for n in RECIPE_NAMES if not MODEL_RECIPES[n].is_moe]
MOE = [n for n in RECIPE_NAMES if MODEL_RECIPES[n].is_moe]
SMALL_SHARD = 16_000  # bytes: every tiny model needs several shards at this size


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    return tensors


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# --- registry -------------------------------------------------------------------------------


def test_registered_recipes_and_defaults():
    assert {"qwen3-tiny", "qwen3-moe-tiny", "llama-tied-tiny", "qwen3-tiny-3layer"} <= set(MODEL_RECIPES)
    assert recipes.DEFAULT_MODEL in MODEL_RECIPES and recipes.DEFAULT_LAYOUT in LAYOUTS
    assert recipes.DEFAULT_LAYOUT in compatible_layouts(recipes.DEFAULT_MODEL)
    assert get_layout(recipes.DEFAULT_LAYOUT).expected_world_size == 4
    assert MODEL_RECIPES["qwen3-moe-tiny"].is_moe and not MODEL_RECIPES["qwen3-tiny"].is_moe
    assert MODEL_RECIPES["llama-tied-tiny"].tied_embeddings and not MODEL_RECIPES["qwen3-tiny"].tied_embeddings


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipe_config(name):
    recipe = get_model_recipe(name)
    assert get_model_recipe(recipe) is recipe
    cfg = recipe.to_hf_config()
    assert cfg.model_type == recipe.hf_config["model_type"]
    assert cfg.architectures == recipe.hf_config["architectures"]
    assert cfg.tie_word_embeddings == recipe.tied_embeddings
    assert recipe.hf_config["dtype"] == "bfloat16"
    assert (cfg.hidden_size, cfg.head_dim, cfg.max_position_embeddings) == (64, 16, 128)
    assert cfg.vocab_size in (256, 512)
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    recipe.to_hf_config().rope_parameters["rope_theta"] = 0.0  # a fresh object each call
    assert recipe.to_hf_config().rope_parameters["rope_theta"] != 0.0


@pytest.mark.parametrize("getter", [get_model_recipe, get_layout])
def test_unknown_name_lists_supported(getter):
    with pytest.raises(UnknownRecipeError) as info:
        getter("no-such-thing")
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)
    message = str(info.value)
    assert "no-such-thing" in message
    supported = MODEL_RECIPES if getter is get_model_recipe else LAYOUTS
    assert all(name in message for name in supported)


def test_checkpoint_names_unknown_family_errors():
    recipe = dataclasses.replace(
        MODEL_RECIPES["qwen3-tiny"], hf_config={"model_type": "gpt2", "tie_word_embeddings": False}
    )
    with pytest.raises(RecipeError, match=r"gpt2.*supported: \['llama', 'qwen3', 'qwen3_moe'\]"):
        recipe.checkpoint_names()


# --- layouts --------------------------------------------------------------------------------


def test_layouts_file_matches_parallel_layout():
    entries = json.loads((recipes.RECIPES_DIR / "layouts.json").read_text())["layouts"]
    expected = {
        "tp1": ParallelLayout(),
        "tp2": ParallelLayout(tp=2),
        "pp2": ParallelLayout(pp=2),
        "pp2_vpp2": ParallelLayout(pp=2, vpp=2),
        "ep2": ParallelLayout(ep=2),
        "tp2_ep2": ParallelLayout(tp=2, ep=2, etp=1),
        "tp2_pp2": ParallelLayout(tp=2, pp=2),
        "tp2_etp2": ParallelLayout(tp=2, etp=2),
        "tp2_pp2_etp2": ParallelLayout(tp=2, pp=2, etp=2),
        "tp2_ep2_etp2": ParallelLayout(tp=2, ep=2, etp=2),
        "etp2": ParallelLayout(etp=2),
    }
    assert dict(LAYOUTS) == expected
    for name, entry in entries.items():
        layout = ParallelLayout(**entry["parallel"])
        assert layout == LAYOUTS[name] and layout.name == name
        assert entry["requires_moe"] == (layout.ep > 1 or layout.etp > 1) == (name in recipes.MOE_ONLY_LAYOUTS)


def test_compatible_layouts_table():
    everything, moe_only = set(LAYOUTS), {"ep2", "tp2_ep2", "tp2_etp2", "tp2_pp2_etp2", "tp2_ep2_etp2", "etp2"}
    assert set(compatible_layouts("qwen3-tiny")) == everything - moe_only
    assert set(compatible_layouts("llama-tied-tiny")) == everything - moe_only
    assert set(compatible_layouts("qwen3-moe-tiny")) == everything
    # 3 layers: no registered PP layout fits (pp=2 needs explicit first/last stage layer counts,
    # which Megatron requires for an uneven split; pp2*vpp2 = 4 stages cannot hold 3 layers).
    assert set(compatible_layouts("qwen3-tiny-3layer")) == {"tp1", "tp2"}


def test_three_layer_recipe_fits_pp2_only_with_explicit_stage_sizes():
    shape = get_model_recipe("qwen3-tiny-3layer").shape()
    with pytest.raises(LayoutError, match="first-stage-layers"):
        ParallelLayout(pp=2).validate_model(shape)
    ParallelLayout(pp=2, first_stage_layers=2).validate_model(shape)


@pytest.mark.parametrize(
    "name,layout",
    [(n, layout) for n in RECIPE_NAMES for layout in compatible_layouts(n)],
)
def test_compatible_pairs_validate(name, layout):
    shape = ModelShape.from_hf_config(get_model_recipe(name).to_hf_config())
    get_layout(layout).validate_model(shape)
    assert get_model_recipe(name).shape() == shape


def test_deepseek_v3_shape_is_what_vllm_builds_as_deepseek_v3():
    """recipes/shapes/deepseek-v3-cut.json (the GPU refit check's DeepSeek-V3): V3's MLA, a router vLLM
    builds with e_score_correction_bias, groups the grouped top-k can choose from, block-FP8 tileable sizes;
    and the GPU script takes it."""

    config = recipes.full_size_config("deepseek-v3-cut")
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    # vllm deepseek_v2.py:314: the bias exists only for noaux_tc; fused_moe's grouped top-k scores with sigmoid
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")
    mla = (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim)
    assert mla == (1536, 512, 128, 64, 128)  # V3's
    per_group = config.n_routed_experts // config.n_group
    assert config.n_routed_experts % config.n_group == 0 and config.num_experts_per_tok <= config.topk_group * per_group
    assert (config.first_k_dense_replace, config.n_shared_experts, config.num_hidden_layers) == (1, 1, 4)
    heads = config.num_attention_heads
    blocked = (config.hidden_size, config.intermediate_size, config.moe_intermediate_size, heads * config.v_head_dim)
    assert all(size % 128 == 0 for size in blocked)  # Fp8MoEMethod refuses partitions block_n does not divide
    from mbridge_refit.testing.vllm_harness import model_config, parser_with_engine_arguments

    args = parser_with_engine_arguments("").parse_args(["--model", "deepseek-v3-cut", "--fp8", "--out-dir", "x"])
    assert model_config(args).to_dict() == config.to_dict()


@pytest.mark.parametrize("name", DENSE)
def test_dense_models_refuse_expert_layouts(name):
    shape = get_model_recipe(name).shape()
    for layout in recipes.MOE_ONLY_LAYOUTS:
        with pytest.raises(LayoutError, match="mixture-of-experts"):
            get_layout(layout).validate_model(shape)


# --- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_checkpoint_names_dtypes_and_roundtrip(name, tmp_path):
    recipe = get_model_recipe(name)
    out = make_random_checkpoint(name, tmp_path / "ckpt", seed=3)
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    on_disk = read_checkpoint(out)
    assert sorted(on_disk) == list(recipe.checkpoint_names())
    assert all(t.dtype == torch.bfloat16 for t in on_disk.values())
    assert not [n for n in on_disk if "gate_up_proj" in n or n.endswith("mlp.experts.down_proj")]
    assert ("lm_head.weight" in on_disk) == (not recipe.tied_embeddings)
    saved_config = json.loads((out / "config.json").read_text())
    assert saved_config["architectures"] == recipe.hf_config["architectures"]
    assert saved_config["tie_word_embeddings"] == recipe.tied_embeddings

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing/unexpected/mismatched keys
    reference = random_hf_model(name, seed=3).state_dict()
    state = loaded.state_dict()
    assert set(state) == set(reference)
    for key, tensor in reference.items():
        assert state[key].dtype == tensor.dtype, key
        assert torch.equal(state[key], tensor), key
    if recipe.tied_embeddings:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_tensor_distinct_and_norms_not_ones(name, tmp_path):
    tensors = read_checkpoint(make_random_checkpoint(name, tmp_path / "ckpt"))
    digests = {hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest(): n for n, t in tensors.items()}
    assert len(digests) == len(tensors), "two tensors hold the same bytes"
    for n, t in tensors.items():
        if n.endswith("norm.weight"):
            assert 0.8 < t.float().mean() < 1.2 and not torch.all(t == 1), n
        else:
            assert t.float().abs().mean() < 0.05 and t.float().std() > 0.005, n


@pytest.mark.parametrize("name", MOE)
def test_per_expert_tensors_split_the_fused_ones(name, tmp_path):
    """On disk gate_proj/up_proj/down_proj of expert e are exactly the slices of transformers' fused
    in-memory experts (gate first, then up), in the layout Megatron-Bridge's mappings read."""
    recipe = get_model_recipe(name)
    tensors = read_checkpoint(make_random_checkpoint(name, tmp_path / "ckpt", seed=1))
    model = random_hf_model(name, seed=1)
    inter, hidden = recipe.hf_config["moe_intermediate_size"], recipe.hf_config["hidden_size"]
    for layer in range(recipe.hf_config["num_hidden_layers"]):
        experts = model.model.layers[layer].mlp.experts
        prefix = f"model.layers.{layer}.mlp"
        assert torch.equal(tensors[f"{prefix}.gate.weight"], model.model.layers[layer].mlp.gate.weight)
        for e in range(recipe.num_experts):
            gate, up, down = (tensors[f"{prefix}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            assert gate.shape == up.shape == (inter, hidden) and down.shape == (hidden, inter)
            assert torch.equal(gate, experts.gate_up_proj[e, :inter])
            assert torch.equal(up, experts.gate_up_proj[e, inter:])
            assert torch.equal(down, experts.down_proj[e])


def test_sparse_layer_rules_match_transformers(tmp_path):
    """Names follow decoder_sparse_step and mlp_only_layers the way transformers builds layers."""
    base = MODEL_RECIPES["qwen3-moe-tiny"]
    variant = ModelRecipe(
        name="qwen3-moe-mixed",
        hf_config={**base.hf_config, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
    )
    assert [variant.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    names = variant.checkpoint_names()
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.3.mlp.down_proj.weight" in names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    out = make_random_checkpoint(variant, tmp_path / "ckpt")  # raises if transformers disagrees
    assert sorted(read_checkpoint(out)) == list(names)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_seeded_determinism(name, tmp_path):
    a = make_random_checkpoint(name, tmp_path / "a", seed=7, max_shard_bytes=SMALL_SHARD)
    b = make_random_checkpoint(name, tmp_path / "b", seed=7, max_shard_bytes=SMALL_SHARD)
    assert file_bytes(a) == file_bytes(b)
    c = read_checkpoint(make_random_checkpoint(name, tmp_path / "c", seed=8))
    for key, tensor in read_checkpoint(a).items():
        assert not torch.equal(tensor, c[key]), key


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_small_shards_write_an_index(name, tmp_path):
    recipe = get_model_recipe(name)
    out = make_random_checkpoint(name, tmp_path / "ckpt", max_shard_bytes=SMALL_SHARD)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == list(recipe.checkpoint_names())
    assert set(index["weight_map"].values()) == set(shards)
    for key, file in index["weight_map"].items():
        with safe_open(str(out / file), framework="pt") as f:
            assert key in f.keys()
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info


def test_refuses_non_empty_dir_unless_overwrite(tmp_path):
    out = tmp_path / "ckpt"
    make_random_checkpoint("qwen3-tiny", out, max_shard_bytes=SMALL_SHARD)
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"ckpt.*overwrite=True"):
        make_random_checkpoint("qwen3-tiny", out)
    make_random_checkpoint("qwen3-tiny", out, seed=1, overwrite=True)  # unsharded this time
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes.txt",
    }
    empty = tmp_path / "empty"
    empty.mkdir()
    make_random_checkpoint("llama-tied-tiny", empty)  # an existing empty folder is fine


def test_unexpected_names_on_disk_are_caught(tmp_path, monkeypatch):
    """Drop one expected name: the post-save completeness check must name it."""
    original = ModelRecipe.checkpoint_names
    monkeypatch.setattr(ModelRecipe, "checkpoint_names", lambda self: original(self)[1:])
    dropped = original(MODEL_RECIPES["qwen3-moe-tiny"])[0]
    with pytest.raises(RuntimeError, match=rf"unexpected: \['{dropped}'\]"):
        make_random_checkpoint("qwen3-moe-tiny", tmp_path / "ckpt")
