"""Stacked expert tensors (``plan.stacking``) against the bridge's own grouped-export conversion.

The oracle is upstream: each GPT-OSS expert mapping's ``megatron_to_hf`` on one expert's random
tensor (single process: every parallel size is 1), stacked over experts as stock's grouped export
does. Ours is the stack the rule table picks for the mapping, written slot by slot with
``ExpertStack.copy_into`` into one output buffer. Shapes keep hidden != ffn so that a missing or
extra transpose cannot pass, and a deliberately wrong stack is shown to differ.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

EXPERTS, HIDDEN, FFN = 3, 6, 4
LAYER = "decoder.layers.0.mlp.experts.local_experts.{e}"
HF = "model.layers.0.mlp.experts."


def _module(kind: str) -> torch.nn.Module:
    # AutoMapping detects column/row parallelism from the module's class name.
    name = {"column": "TEColumnParallelGroupedLinear", "row": "TERowParallelGroupedLinear"}[kind]
    return type(name, (torch.nn.Module,), {})()


def _cases():
    from megatron.bridge.models.gpt_oss.gpt_oss_bridge import GPTOSSMLPDownProjMapping, GPTOSSMLPGateUpProjMapping

    return [  # mapping class, Megatron suffix, HF name, module kind, local shape
        (GPTOSSMLPGateUpProjMapping, "linear_fc1.weight", "gate_up_proj", "column", (2 * FFN, HIDDEN)),
        (GPTOSSMLPGateUpProjMapping, "linear_fc1.bias", "gate_up_proj_bias", "column", (2 * FFN,)),
        (GPTOSSMLPDownProjMapping, "linear_fc2.weight", "down_proj", "row", (HIDDEN, FFN)),
        (GPTOSSMLPDownProjMapping, "linear_fc2.bias", "down_proj_bias", "row", (HIDDEN,)),
    ]


CASE_IDS = ["gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"]


def _upstream_and_ours(case, stack_override=None):
    from mbridge_refit.plan.stacking import STACKED_KIND, stacked_placement

    mapping_class, suffix, hf_suffix, kind, local_shape = case
    generator = torch.Generator().manual_seed(0)
    locals_ = [torch.randn(local_shape, generator=generator, dtype=torch.float32).to(torch.bfloat16) for _ in range(EXPERTS)]
    module = _module(kind)
    upstream = []
    for e, local in enumerate(locals_):
        mapping = mapping_class(megatron_param=f"{LAYER.format(e=e)}.{suffix}", hf_param=HF + hf_suffix)
        (name, tensor), = mapping.megatron_to_hf(local, module).items()
        assert name == HF + hf_suffix
        upstream.append(tensor)
    expected = torch.stack(upstream, dim=0)

    mapping = mapping_class(megatron_param=f"{LAYER.format(e=0)}.{suffix}", hf_param=HF + hf_suffix)
    placement, stack = stacked_placement(mapping, local_shape)
    assert placement.kind == STACKED_KIND and placement.hf_names == (HF + hf_suffix,)
    stack = stack_override(stack) if stack_override else stack
    out = torch.full((EXPERTS, *stack.expert_shape(local_shape)), float("nan"), dtype=torch.bfloat16)
    for e, local in enumerate(locals_):
        stack.copy_into(out[e], local)
    return expected, out, stack, locals_


@pytest.mark.parametrize("case", range(4), ids=CASE_IDS)
def test_stack_matches_the_upstream_grouped_export(case):
    expected, ours, stack, locals_ = _upstream_and_ours(_cases()[case])
    assert ours.shape == expected.shape and ours.dtype == expected.dtype
    assert torch.equal(ours.view(torch.int16), expected.view(torch.int16))  # bitwise
    assert all(torch.equal(stack.read_from(ours[e]), local) for e, local in enumerate(locals_))  # the inverse


@pytest.mark.parametrize(
    ("case", "corrupt"),
    [
        (0, lambda s: dataclasses.replace(s, interleave=1)),  # gate and up blocks instead of alternating rows
        (1, lambda s: dataclasses.replace(s, interleave=4)),  # alternating in 4 blocks
    ],
    ids=["gate_up_proj-no-interleave", "gate_up_proj_bias-wrong-interleave"],
)
def test_a_wrong_stack_is_caught(case, corrupt):
    expected, ours, _, _ = _upstream_and_ours(_cases()[case], corrupt)
    assert ours.shape == expected.shape
    assert not torch.equal(ours.view(torch.int16), expected.view(torch.int16))


def test_a_missing_transpose_changes_the_shape():
    from mbridge_refit.plan.stacking import ExpertStack

    assert ExpertStack(interleave=2, transpose=True).expert_shape((2 * FFN, HIDDEN)) == (HIDDEN, 2 * FFN)
    assert ExpertStack(interleave=2).expert_shape((2 * FFN, HIDDEN)) != (HIDDEN, 2 * FFN)


def test_unknown_grouped_mapping_is_refused_by_name():
    from megatron.bridge.models.conversion.param_mapping import FusedExpertMapping

    from mbridge_refit.plan.placement import PlacementError
    from mbridge_refit.plan.stacking import stacked_placement

    mapping = FusedExpertMapping("decoder.layers.0.mlp.experts.linear_fc2.weight*", "model.layers.0.mlp.experts.down_proj")
    with pytest.raises(PlacementError, match=r"FusedExpertMapping.*no stacking rule.*GPTOSSMLPGateUpProjMapping"):
        stacked_placement(mapping, (HIDDEN, FFN))


def test_odd_rows_cannot_be_interleaved():
    from mbridge_refit.plan.placement import PlacementError
    from mbridge_refit.plan.stacking import ExpertStack

    with pytest.raises(PlacementError, match="5 rows cannot be interleaved in 2 blocks"):
        ExpertStack(interleave=2).check((5, HIDDEN))


def _stacked_entry():
    from mbridge_refit.plan.entries import PlanEntry, TensorSharding
    from mbridge_refit.plan.stacking import STACKED_KIND, ExpertStack

    sharding = TensorSharding(
        mesh_dims=("ep", "edp"), mesh_shape=(2, 1), placements=("Shard(0)", "Replicate()"), pieces=(),
        local_shape=(2 * FFN, HIDDEN), stack=ExpertStack(interleave=2, transpose=True, num_experts=4),
    )
    return PlanEntry(hf_name=HF + "gate_up_proj", shape=(4, HIDDEN, 2 * FFN), dtype="bfloat16",
                     megatron_param=f"{LAYER.format(e=0)}.linear_fc1.weight", pp_rank=0, vpp_stage=0,
                     is_expert=True, kind=STACKED_KIND, sharding=sharding)


def test_stacked_entry_survives_the_plan_json():
    from mbridge_refit.plan.entries import ExportPlan

    plan = ExportPlan(entries=(_stacked_entry(),), layer_map={0: (0, 0)}, tp=1, pp=1, ep=2, vpp=1)
    assert ExportPlan.from_json(plan.to_json()) == plan


def test_sharded_refit_refuses_stacked_tensors_by_name():
    from mbridge_refit.plan.engine_layout import EngineLayout
    from mbridge_refit.plan.entries import ExportPlan
    from mbridge_refit.plan.layout import ModelShape
    from mbridge_refit.plan.transfer import TransferPlanError, build_transfer_plan, megatron_rank_grid

    plan = ExportPlan(entries=(_stacked_entry(),), layer_map={0: (0, 0)}, tp=1, pp=1, ep=2, vpp=1)
    shape = ModelShape(num_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=8,
                       intermediate_size=FFN, num_experts=4)
    with pytest.raises(TransferPlanError, match=r"gate_up_proj: a stacked expert tensor.*packed broadcast"):
        build_transfer_plan(plan, megatron_rank_grid(tp=1, ep=2, dp=2), EngineLayout(tp=2, ep=2), shape)


@pytest.mark.multirank
def test_gpt_oss_cached_export_at_tp2_ep2(tmp_path):
    """TP2 x EP2 (2 CPU ranks, experts split over the tensor-parallel ranks): stacked tensors gathered over EP equal stock's, twice, and the
    second export writes them into the first one's buffers without allocating."""
    from conftest import REPO, torchrun

    result = tmp_path / "stacked.json"
    run = torchrun(2, [str(REPO / "tests" / "ranks" / "stacked_export_check.py"), "--tp", "2", "--ep", "2", "--result", str(result)])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads(Path(f"{result}.rank{rank}").read_text()) for rank in range(2)]
    assert all(r["stacked"] > 0 for r in reports)
    assert [r["failures"] for r in reports] == [[]] * 2
