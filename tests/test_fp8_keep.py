"""Which weights the blockwise FP8 export keeps, per family (``mbridge_refit.fp8.keep``).

The oracle is written here from the published checkpoints and vLLM's model code (the sources
``fp8/keep.py`` cites), not from the table's patterns: for each family, its 2-D linear weights as
the bridge exports them (Megatron-Bridge 0.6.2's mapping registry, layer and expert 0) and which of
them the published FP8 checkpoint (or, without one, the safe default) keeps in high precision.
"""

from __future__ import annotations

import argparse

import pytest
from test_fp8 import _plan_with

from mbridge_refit.fp8.format import BlockwiseFP8Config, FP8FormatError
from mbridge_refit.fp8.keep import KEEP_BY_ARCHITECTURE
from mbridge_refit.fp8.plan import fp8_plan

ATTENTION = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
]
DENSE_MLP = [
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
]
EXPERTS = [f"model.layers.0.mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
SHARED_EXPERTS = [f"model.layers.0.mlp.shared_experts.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
MLA = [
    f"model.layers.0.self_attn.{p}.weight"
    for p in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
]
TEXT_ENDS = ["model.embed_tokens.weight", "lm_head.weight"]


def _qwen3_next_names(layer: str, *, linear_attention: bool) -> list[str]:
    return [
        *(f"{layer}.linear_attn.{p}.weight" for p in ("in_proj_qkvz", "in_proj_ba", "out_proj") if linear_attention),
        *(f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"{layer}.mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
        *(f"{layer}.mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")),
        f"{layer}.mlp.gate.weight",
        f"{layer}.mlp.shared_expert_gate.weight",
    ]


# family -> (its 2-D linear weights as exported, the ones its FP8 checkpoint keeps)
FAMILIES: dict[str, tuple[list[str], set[str]]] = {
    # deepseek-ai/DeepSeek-V3: MLA projections, dense/shared/routed MLPs FP8; embeddings, lm_head and the router BF16.
    "DeepseekV3ForCausalLM": (
        [*TEXT_ENDS, *MLA, *DENSE_MLP, *EXPERTS, *SHARED_EXPERTS, "model.layers.0.mlp.gate.weight"],
        {*TEXT_ENDS, "model.layers.0.mlp.gate.weight"},
    ),
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3's architecture, shipped in FP8.
    "KimiK2ForCausalLM": (
        [*TEXT_ENDS, *MLA, *DENSE_MLP, *EXPERTS, *SHARED_EXPERTS, "model.layers.0.mlp.gate.weight"],
        {*TEXT_ENDS, "model.layers.0.mlp.gate.weight"},
    ),
    # MiniMaxAI/MiniMax-M2: attention and experts FP8; router (fp32), embeddings, lm_head not.
    "MiniMaxM2ForCausalLM": (
        [
            *TEXT_ENDS,
            *ATTENTION,
            "model.layers.0.block_sparse_moe.gate.weight",
            *(f"model.layers.0.block_sparse_moe.experts.0.w{i}.weight" for i in (1, 2, 3)),
        ],
        {*TEXT_ENDS, "model.layers.0.block_sparse_moe.gate.weight"},
    ),
    # Qwen3.6-FP8 (same gated-delta-net layers): in_proj_ba kept; vLLM builds gate and
    # shared_expert_gate unquantized; the MTP input projection kept like DeepSeek-V3's eh_proj.
    "Qwen3NextForCausalLM": (
        [
            *TEXT_ENDS,
            *_qwen3_next_names("model.layers.0", linear_attention=True),
            *_qwen3_next_names("mtp.layers.0", linear_attention=False),
            "mtp.fc.weight",
        ],
        {
            *TEXT_ENDS,
            "model.layers.0.linear_attn.in_proj_ba.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.shared_expert_gate.weight",
            "mtp.layers.0.mlp.gate.weight",
            "mtp.layers.0.mlp.shared_expert_gate.weight",
            "mtp.fc.weight",
        },
    ),
    # Qwen3.6-35B-A3B-FP8 (Qwen3.5 MoE VL architecture): in_proj_a / in_proj_b and the vision tower kept.
    "Qwen3_5MoeForConditionalGeneration": (
        [
            "lm_head.weight",
            "model.language_model.embed_tokens.weight",
            "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
            "model.language_model.layers.0.linear_attn.in_proj_z.weight",
            "model.language_model.layers.0.linear_attn.in_proj_a.weight",
            "model.language_model.layers.0.linear_attn.in_proj_b.weight",
            "model.language_model.layers.0.linear_attn.out_proj.weight",
            "model.language_model.layers.0.mlp.gate.weight",
            "model.language_model.layers.0.mlp.shared_expert_gate.weight",
            "model.language_model.layers.0.mlp.experts.0.up_proj.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.linear_fc1.weight",
            "model.visual.pos_embed.weight",
        ],
        {
            "lm_head.weight",
            "model.language_model.embed_tokens.weight",
            "model.language_model.layers.0.linear_attn.in_proj_a.weight",
            "model.language_model.layers.0.linear_attn.in_proj_b.weight",
            "model.language_model.layers.0.mlp.gate.weight",
            "model.language_model.layers.0.mlp.shared_expert_gate.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.linear_fc1.weight",
            "model.visual.pos_embed.weight",
        },
    ),
    # zai-org/GLM-5.x FP8: mlp.gate, lm_head, embed_tokens, eh_proj and the indexer's weights_proj unquantized.
    "GlmMoeDsaForCausalLM": (
        [
            *TEXT_ENDS,
            *MLA,
            *EXPERTS,
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.self_attn.indexer.wq_b.weight",
            "model.layers.0.self_attn.indexer.wk.weight",
            "model.layers.0.self_attn.indexer.weights_proj.weight",
            "model.layers.1.eh_proj.weight",
        ],
        {
            *TEXT_ENDS,
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.self_attn.indexer.weights_proj.weight",
            "model.layers.1.eh_proj.weight",
        },
    ),
    # No FP8 checkpoints: the safe default (embeddings, output layer, routers, encoders).
    "GptOssForCausalLM": (
        [*TEXT_ENDS, *ATTENTION, "model.layers.0.mlp.router.weight"],
        {*TEXT_ENDS, "model.layers.0.mlp.router.weight"},
    ),
    "Qwen2_5_VLForConditionalGeneration": (
        [*TEXT_ENDS, *ATTENTION, *DENSE_MLP, "visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight"],
        {*TEXT_ENDS, "visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight"},
    ),
    "Mistral3ForConditionalGeneration": (
        [
            "language_model.lm_head.weight",
            "language_model.model.embed_tokens.weight",
            "language_model.model.layers.0.mlp.up_proj.weight",
            "vision_tower.transformer.layers.0.attention.q_proj.weight",
            "multi_modal_projector.linear_1.weight",
        ],
        {
            "language_model.lm_head.weight",
            "language_model.model.embed_tokens.weight",
            "vision_tower.transformer.layers.0.attention.q_proj.weight",
            "multi_modal_projector.linear_1.weight",
        },
    ),
    "NemotronHForCausalLM": (
        [
            "backbone.embeddings.weight",
            "lm_head.weight",
            "backbone.layers.0.mixer.in_proj.weight",
            "backbone.layers.0.mixer.out_proj.weight",
            "backbone.layers.0.mixer.gate.weight",
            "backbone.layers.0.mixer.experts.0.up_proj.weight",
            "backbone.layers.0.mixer.q_proj.weight",
        ],
        {"backbone.embeddings.weight", "lm_head.weight", "backbone.layers.0.mixer.gate.weight"},
    ),
    "Step3p5ForCausalLM": (
        [
            *TEXT_ENDS,
            *ATTENTION,
            "model.layers.0.self_attn.g_proj.weight",
            "model.layers.0.moe.gate.weight",
            "model.layers.0.moe.up_proj.weight",
            "model.layers.0.share_expert.up_proj.weight",
        ],
        {*TEXT_ENDS, "model.layers.0.moe.gate.weight"},
    ),
    "HYV3ForCausalLM": (
        [
            *TEXT_ENDS,
            *ATTENTION,
            "model.layers.1.mlp.router.gate.weight",
            "model.layers.1.mlp.shared_mlp.up_proj.weight",
            "model.layers.1.mlp.experts.0.up_proj.weight",
        ],
        {*TEXT_ENDS, "model.layers.1.mlp.router.gate.weight"},
    ),
    "DeepseekV4ForCausalLM": (
        [
            "embed.weight",
            "head.weight",
            "layers.0.attn.wq_a.weight",
            "layers.0.ffn.gate.weight",
            "layers.0.ffn.experts.0.w1.weight",
        ],
        {"embed.weight", "head.weight", "layers.0.ffn.gate.weight"},
    ),
}


# Rows whose family's names and published choice are another row's (the Qwen3.5 text-only and dense variants).
SAME_AS = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM": "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5ForCausalLM": "Qwen3_5MoeForConditionalGeneration",
}


def _kept(config: BlockwiseFP8Config, names: list[str]) -> set[str]:
    return {n for n in names if not config.quantizes(n, (256, 256), "bfloat16")}


@pytest.mark.parametrize("architecture", [*FAMILIES, *SAME_AS])
def test_family_keeps_what_its_published_checkpoint_keeps(architecture):
    names, kept = FAMILIES[SAME_AS.get(architecture, architecture)]
    assert _kept(BlockwiseFP8Config().for_architecture(architecture), names) == kept


def test_every_table_row_has_an_oracle():
    assert set(KEEP_BY_ARCHITECTURE) <= set(FAMILIES) | set(SAME_AS)


@pytest.mark.parametrize("architecture", ["MiniMaxM2ForCausalLM", "Qwen3_5MoeForConditionalGeneration"])
def test_quantization_config_lists_exactly_the_kept_linear_modules(architecture):
    names, kept = FAMILIES[architecture]
    plan = _plan_with(
        [(n, (256, 256)) for n in names] + [("model.norm.weight", (256,)), ("model.layers.0.mlp.gate.bias", (256,))]
    )
    config = BlockwiseFP8Config().for_architecture(architecture)
    written = config.quantization_config(fp8_plan(plan, config))["modules_to_not_convert"]
    assert written == sorted(n.removesuffix(".weight") for n in kept)


def test_explicit_keep_patterns_win_over_the_family_row():
    explicit = BlockwiseFP8Config(keep_patterns=("lm_head.weight",), engine_tp_size=2)
    assert explicit.for_architecture("MiniMaxM2ForCausalLM") is explicit
    names, _ = FAMILIES["MiniMaxM2ForCausalLM"]
    assert _kept(explicit.for_architecture("MiniMaxM2ForCausalLM"), names) == {"lm_head.weight"}
    family = BlockwiseFP8Config(engine_tp_size=2).for_architecture("MiniMaxM2ForCausalLM")
    assert family.engine_tp_size == 2 and "model.layers.0.block_sparse_moe.gate.weight" in _kept(family, names)


def test_an_unknown_architecture_gets_the_safe_default():
    names = [*TEXT_ENDS, *ATTENTION, "model.layers.0.mlp.gate.weight", "vision_tower.blocks.0.fc1.weight"]
    kept = _kept(BlockwiseFP8Config().for_architecture("SomeNewForCausalLM"), names)
    assert kept == {*TEXT_ENDS, "model.layers.0.mlp.gate.weight", "vision_tower.blocks.0.fc1.weight"}


def test_a_config_without_patterns_refuses_to_decide():
    with pytest.raises(FP8FormatError, match="for_architecture"):
        BlockwiseFP8Config().quantizes("lm_head.weight", (256, 256), "bfloat16")


def test_the_bridge_picks_the_row_of_its_architecture_and_keeps_explicit_patterns():
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.testing.tiny_models import tiny_config

    bridge = RefitBridge.from_hf_config(tiny_config("Qwen3_5MoeForConditionalGeneration"))
    names, kept = FAMILIES["Qwen3_5MoeForConditionalGeneration"]
    assert _kept(bridge.fp8_config("blockwise"), names) == kept
    assert _kept(bridge.fp8_config(BlockwiseFP8Config(engine_tp_size=2)), names) == kept
    explicit = BlockwiseFP8Config(keep_patterns=("lm_head.weight",))
    assert bridge.fp8_config(explicit) is explicit and bridge.fp8_config(None) is None


@pytest.mark.parametrize(
    ("keep", "expected"), [(None, None), (["*gate.weight", "lm_head.weight"], ("*gate.weight", "lm_head.weight"))]
)
def test_convert_flags_leave_the_choice_to_the_family_unless_fp8_keep_is_given(keep, expected):
    from mbridge_refit.convert.flags import fp8_from_flags

    config = fp8_from_flags(argparse.Namespace(fp8_blockwise=True, fp8_keep=keep, fp8_engine_tp=None))
    assert config == BlockwiseFP8Config(keep_patterns=expected)
