"""The export plan as a user sees it: the `plan` CLI, its JSON, and errors for unmappable parameters."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import torchrun
from oracle import read_checkpoint


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("ranks", "flags"),
    [(2, ["--ep", "2"]), (4, ["--tp", "2", "--ep", "2"])],  # the second: DP2 x TP2 x EP2
    ids=["ep2", "dp2_tp2_ep2"],
)
def test_plan_cli_json_matches_the_checkpoint(ranks, flags, source_checkpoints, tmp_path):
    source = source_checkpoints("qwen3-moe-tiny")
    out = tmp_path / "plan.json"
    run = torchrun(ranks, ["mbridge_refit.convert", "plan", "--hf", str(source), *flags, "--json", str(out)])
    assert run.returncode == 0, run.output[-4000:]
    entries = json.loads(out.read_text())["entries"]
    expected = read_checkpoint(source)
    assert sorted(e["hf_name"] for e in entries) == sorted(expected)
    for entry in entries:
        tensor = expected[entry["hf_name"]]
        assert tuple(entry["shape"]) == tuple(tensor.shape), entry["hf_name"]
        assert entry["dtype"] == str(tensor.dtype).removeprefix("torch.")
    experts = [e for e in entries if e["is_expert"]]
    assert experts and {e["sharding"]["owner_ep_rank"] for e in experts} == {0, 1}
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in run.output  # the printed table


def test_plan_roundtrips_through_json():
    from mbridge_refit.plan.placement import SliceCopy
    from mbridge_refit.plan.entries import ExportPlan, PlanEntry, TensorSharding

    sharding = TensorSharding(
        mesh_dims=("tp", "dp"), mesh_shape=(2, 1), placements=("Shard(0)", "Replicate()"),
        pieces=((SliceCopy(hf_name="w", dim=0, hf_start=0, hf_stop=2, local_start=0),),
                (SliceCopy(hf_name="w", dim=0, hf_start=2, hf_stop=4, local_start=0),)),
        local_shape=(2, 3),
    )
    entry = PlanEntry(hf_name="w", shape=(4, 3), dtype="bfloat16", megatron_param="p", pp_rank=0,
                      vpp_stage=0, is_expert=False, kind="column", sharding=sharding)
    plan = ExportPlan(entries=(entry,), layer_map={0: (0, 0)}, tp=2, pp=1, ep=1, vpp=1)
    assert ExportPlan.from_json(plan.to_json()) == plan
    assert plan.total_bytes == 4 * 3 * 2


def test_unmappable_parameter_is_named():
    from megatron.bridge.models.conversion.param_mapping import KVMapping

    from mbridge_refit.plan.placement import PlacementError, placement_kind

    mapping = KVMapping("decoder.layers.0.self_attention.linear_kv.weight", k="a.k", v="a.v")
    with pytest.raises(PlacementError, match=r"decoder\.layers\.0\.self_attention\.linear_kv\.weight.*KVMapping"):
        placement_kind(mapping, torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp=4), "num_key_value_heads=2"),
        (dict(pp=3), "pp=3 does not divide num_layers=4"),
        (dict(pp=2, vpp=4), "exceed num_layers"),
        (dict(pp=2, first_stage_layers=3, last_stage_layers=2), "leave -1 layers"),
    ],
)
def test_layout_errors_name_the_problem(kwargs, message):
    from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout

    shape = ModelShape(num_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, intermediate_size=128)
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs).validate_model(shape)


@pytest.mark.parametrize(
    ("architecture", "expected"),
    [
        # vision-language: the language model's dimensions live in text_config
        ("Qwen2_5_VLForConditionalGeneration", dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=2048, num_experts=0)),
        # DeepSeek names its routed expert count n_routed_experts
        ("DeepseekV3ForCausalLM", dict(num_attention_heads=4, num_experts=8)),
        ("Qwen3MoeForCausalLM", dict(num_attention_heads=4, num_experts=8)),
    ],
)
def test_model_shape_reads_the_language_model_of_any_config(architecture, expected):
    """The layout checks read a VLM's text_config and every family's expert count (tiny_configs
    sets these sizes: heads 4, kv heads 2, vocab 2048, 8 experts)."""
    from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout
    from mbridge_refit.tools.tiny_configs import tiny_config

    shape = ModelShape.from_hf_config(tiny_config(architecture))
    assert {k: getattr(shape, k) for k in expected} == expected
    if shape.num_experts:
        ParallelLayout(ep=2).validate_model(shape)
        with pytest.raises(LayoutError, match="ep=3 does not divide num_experts=8"):
            ParallelLayout(ep=3).validate_model(shape)


def test_mapping_with_its_own_export_conversion_is_refused_by_name():
    """A mapping subclass that overrides megatron_to_hf (e.g. Ernie 4.5's expert bias, unsqueezed
    to [1, N] on export) may change data or shape: the plan refuses it (the model then falls back
    to the stock export) instead of exporting the base class's slices."""
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    from mbridge_refit.plan.placement import PlacementError, placement_kind

    class Unsqueezing(ReplicatedMapping):
        def megatron_to_hf(self, megatron_weights, megatron_module):
            return {k: v.unsqueeze(0) for k, v in super().megatron_to_hf(megatron_weights, megatron_module).items()}

    name = "decoder.layers.0.mlp.router.expert_bias"
    assert placement_kind(ReplicatedMapping(name, "h.bias"), torch.nn.Linear(2, 2)).kind == "replicated"  # control
    with pytest.raises(PlacementError, match=r"expert_bias.*Unsqueezing.*overrides ReplicatedMapping\.megatron_to_hf"):
        placement_kind(Unsqueezing(name, "h.bias"), torch.nn.Linear(2, 2))
