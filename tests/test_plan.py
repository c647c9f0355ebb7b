"""The export plan as a user sees it: the `plan` CLI, its JSON, and errors for unmappable parameters."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import torchrun
from json_versions import assert_other_version_refused
from oracle import read_checkpoint

from mbridge_refit.plan.entries import EXPORT_PLAN_VERSION


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


def _a_plan():
    from mbridge_refit.plan.entries import ExportPlan, PlanEntry, TensorSharding
    from mbridge_refit.plan.slices import SliceCopy

    sharding = TensorSharding(
        mesh_dims=("tp", "dp"),
        mesh_shape=(2, 1),
        placements=("Shard(0)", "Replicate()"),
        pieces=(
            (SliceCopy(hf_name="w", dim=0, hf_start=0, hf_stop=2, local_start=0),),
            (SliceCopy(hf_name="w", dim=0, hf_start=2, hf_stop=4, local_start=0),),
        ),
        local_shape=(2, 3),
    )
    entry = PlanEntry(
        hf_name="w",
        shape=(4, 3),
        dtype="bfloat16",
        megatron_param="p",
        pp_rank=0,
        vpp_stage=0,
        is_expert=False,
        kind="column",
        sharding=sharding,
    )
    return ExportPlan(entries=(entry,), layer_map={0: (0, 0)}, tp=2, pp=1, ep=1, vpp=1)


def test_plan_roundtrips_through_json():
    from mbridge_refit.plan.entries import ExportPlan

    plan = _a_plan()
    assert ExportPlan.from_json(plan.to_json()) == plan
    assert plan.total_bytes == 4 * 3 * 2


@pytest.mark.parametrize("version", [None, EXPORT_PLAN_VERSION - 1, EXPORT_PLAN_VERSION + 1, True])
def test_a_plan_json_of_another_version_is_refused_by_name(version):
    """The JSON of a plan another mbridge_refit wrote (None: one from before the JSON carried a version,
    which read back as a plan; a receiver or an engine handed it builds on it): ``PlanError`` naming the
    format, both versions and the fix."""
    from mbridge_refit.plan.entries import ExportPlan, PlanError

    assert_other_version_refused(
        _a_plan().to_json(),
        ExportPlan.from_json,
        PlanError,
        label="export plan",
        writer="its writer (to_json)",
        current=EXPORT_PLAN_VERSION,
        version=version,
    )


def test_unmappable_parameter_is_named():
    from megatron.bridge.models.conversion.param_mapping import KVMapping

    from mbridge_refit.plan.placement import placement_kind
    from mbridge_refit.plan.slices import PlacementError

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

    shape = ModelShape(
        num_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=512, intermediate_size=128
    )
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(**kwargs).validate_model(shape)


@pytest.mark.parametrize(
    ("architecture", "expected"),
    [
        # vision-language: the language model's dimensions live in text_config
        (
            "Qwen2_5_VLForConditionalGeneration",
            dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=2048, num_experts=0),
        ),
        # DeepSeek names its routed expert count n_routed_experts
        ("DeepseekV3ForCausalLM", dict(num_attention_heads=4, num_experts=8)),
        ("Qwen3MoeForCausalLM", dict(num_attention_heads=4, num_experts=8)),
    ],
)
def test_model_shape_reads_the_language_model_of_any_config(architecture, expected):
    """The layout checks read a VLM's text_config and every family's expert count (tiny_models
    sets these sizes: heads 4, kv heads 2, vocab 2048, 8 experts)."""
    from mbridge_refit.plan.layout import LayoutError, ModelShape, ParallelLayout
    from mbridge_refit.testing.tiny_models import tiny_config

    shape = ModelShape.from_hf_config(tiny_config(architecture))
    assert {k: getattr(shape, k) for k in expected} == expected
    if shape.num_experts:
        ParallelLayout(ep=2).validate_model(shape)
        with pytest.raises(LayoutError, match="ep=3 does not divide num_experts=8"):
            ParallelLayout(ep=3).validate_model(shape)


def test_mapping_with_its_own_export_conversion_is_refused_by_name():
    """A mapping subclass that overrides megatron_to_hf with no rule for it (here one that
    unsqueezes, as Ernie 4.5's expert bias does, but is not that class) may change data or shape:
    the plan refuses it (the model then falls back to the stock export) instead of exporting the
    base class's slices."""
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    from mbridge_refit.plan.placement import placement_kind
    from mbridge_refit.plan.slices import PlacementError

    class Unsqueezing(ReplicatedMapping):
        def megatron_to_hf(self, megatron_weights, megatron_module):
            return {k: v.unsqueeze(0) for k, v in super().megatron_to_hf(megatron_weights, megatron_module).items()}

    name = "decoder.layers.0.mlp.router.expert_bias"
    assert placement_kind(ReplicatedMapping(name, "h.bias"), torch.nn.Linear(2, 2)).kind == "replicated"  # control
    with pytest.raises(PlacementError, match=r"expert_bias.*Unsqueezing.*overrides ReplicatedMapping\.megatron_to_hf"):
        placement_kind(Unsqueezing(name, "h.bias"), torch.nn.Linear(2, 2))


def _qkv_spec(layer: int):
    from mbridge_refit.plan.build import ParamSpec
    from mbridge_refit.plan.slices import PlacementKind

    names = tuple(f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in "qkv")
    return ParamSpec(
        global_name=f"decoder.layers.{layer}.self_attention.linear_qkv.weight",
        local_shape=(8, 4),
        placement=PlacementKind(kind="qkv", hf_names=names),
        dtype="bfloat16",
        pp_rank=0,
        vpp_stage=0,
        is_expert=False,
    )


def _task(spec):
    import types

    return types.SimpleNamespace(global_param_name=spec.global_name, weight_dtype=None)


def test_names_a_bridge_drops_on_export_are_left_out_of_the_plan():
    """Gemma 4's export hook drops the KV projections that exist only in Megatron (``attention_k_eq_v``:
    a full-attention layer's ``v_proj``; KV-shared layers: ``k_proj`` and ``v_proj``). The plan asks the
    bridge's own hook (the oracle) which names it keeps."""
    from megatron.bridge.models.gemma.gemma4_bridge import Gemma4Bridge

    from mbridge_refit.plan.build import _names_the_bridge_drops
    from mbridge_refit.testing.tiny_models import tiny_config

    config = tiny_config("Gemma4ForCausalLM")
    config.attention_k_eq_v, config.num_kv_shared_layers = True, 1
    assert config.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    bridge = Gemma4Bridge()
    bridge.hf_config = config
    dropped = {
        layer: _names_the_bridge_drops(bridge, _task(_qkv_spec(layer)), _qkv_spec(layer), {}) for layer in range(4)
    }
    assert dropped[0] == dropped[1] == dropped[2] == frozenset()
    assert dropped[3] == {
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    }  # KV-shared
    config.num_kv_shared_layers = 0
    assert _names_the_bridge_drops(bridge, _task(_qkv_spec(3)), _qkv_spec(3), {}) == {
        "model.layers.3.self_attn.v_proj.weight"
    }


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (
            lambda task, weights, state: {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)},
            "adds or replaces",
        ),
        (lambda task, weights, state: {name: t.clone() for name, t in weights.items()}, "adds or replaces"),
        (lambda task, weights, state: {name: t.cpu() for name, t in weights.items()}, "fails on metadata"),
    ],
    ids=["adds", "replaces", "reads-values"],
)
def test_an_export_hook_that_converts_is_refused_by_name(hook, message):
    """A bridge whose export hook adds tensors or converts values (requantization, MTP aliases, swapped
    halves) makes the plan refuse the model (the stock export then runs), naming the hook."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    from mbridge_refit.plan.build import _names_the_bridge_drops
    from mbridge_refit.plan.entries import PlanError

    class Converting(MegatronModelBridge):
        def maybe_modify_converted_hf_weight(self, task, converted_weights_dict, hf_state_dict):
            return hook(task, converted_weights_dict, hf_state_dict)

        def provider_bridge(self, hf_pretrained):
            raise NotImplementedError

        def mapping_registry(self):
            raise NotImplementedError

    spec = _qkv_spec(0)
    with pytest.raises(PlanError, match=rf"linear_qkv\.weight: Converting\.maybe_modify_converted_hf_weight {message}"):
        _names_the_bridge_drops(Converting(), _task(spec), spec, {})
