"""Stacked expert tensors (``plan.stacking``) against the bridge's own grouped-export conversion.

The oracle is upstream: each expert mapping's ``megatron_to_hf`` on one expert's random tensor
(single process: every parallel size is 1), stacked over experts as stock's grouped export does
(GPT-OSS: ``torch.stack``; the packed-expert mappings: stock's own accumulation,
``MegatronModelBridge._accumulate_grouped_export``, with its adaptive transpose decided from the
checkpoint's stored shape). Ours is the stack the rule table picks for the mapping, written slot
by slot with ``ExpertStack.copy_into`` into one output buffer, and read back with ``read_from``
(the loader's inverse). Shapes keep hidden != ffn so that a missing or extra transpose cannot
pass (one case is square on purpose: stock never transposes it), and a deliberately wrong stack
is shown to differ.
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
    locals_ = [
        torch.randn(local_shape, generator=generator, dtype=torch.float32).to(torch.bfloat16) for _ in range(EXPERTS)
    ]
    module = _module(kind)
    upstream = []
    for e, local in enumerate(locals_):
        mapping = mapping_class(megatron_param=f"{LAYER.format(e=e)}.{suffix}", hf_param=HF + hf_suffix)
        ((name, tensor),) = mapping.megatron_to_hf(local, module).items()
        assert name == HF + hf_suffix
        upstream.append(tensor)
    expected = torch.stack(upstream, dim=0)

    mapping = mapping_class(megatron_param=f"{LAYER.format(e=0)}.{suffix}", hf_param=HF + hf_suffix)
    placement, stack = stacked_placement(mapping, local_shape, num_experts=EXPERTS)
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


GROUPED = "decoder.layers.0.mlp.experts.linear_fc{fc}.weight{e}"  # TE grouped experts: weight0..N-1
PACKED_CASES = {  # id: (mapping class name, fc, HF name, module kind, local shape)
    "gate_up_proj": ("FusedGatedExpertMapping", 1, "gate_up_proj", "column", (2 * FFN, HIDDEN)),
    "down_proj": ("FusedExpertMapping", 2, "down_proj", "row", (HIDDEN, FFN)),
    "square gate_up_proj": ("FusedGatedExpertMapping", 1, "gate_up_proj", "column", (2 * FFN, 2 * FFN)),
}
# What the checkpoint holds: nothing (a bridge from a config), the stacked shape (transformers 5's
# in-memory layout), the transposed one (Qwen3-VL-MoE's published checkpoints).
STORED = {
    "absent": lambda shape: None,
    "stacked": lambda shape: (EXPERTS, *shape),
    "transposed": lambda shape: (EXPERTS, shape[1], shape[0]),
}


class _AccumulatingBridge:
    """The object ``MegatronModelBridge._accumulate_grouped_export`` runs on (it reads nothing of it)."""


def _stock_packed_export(mapping_class, fc, hf_name, kind, locals_, transpose_on_export, stored_shape, monkeypatch):
    """Stock's grouped export of one packed-expert tensor: each expert's ``megatron_to_hf``, fed to
    stock's own accumulation (expert-parallel size 1), with the checkpoint holding ``stored_shape``."""
    from megatron.bridge.models.conversion import model_bridge
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 1)
    config = type("Config", (), {"num_moe_experts": len(locals_)})()
    hf_state = {} if stored_shape is None else {HF + hf_name: torch.empty(stored_shape)}
    buffers, merged = {}, None
    for e, local in enumerate(locals_):
        mapping = mapping_class(GROUPED.format(fc=fc, e=e), HF + hf_name, transpose_on_export=transpose_on_export)
        task = type("Task", (), {"param_name": mapping.megatron_param, "mapping": mapping})()
        converted = mapping.megatron_to_hf(local, _module(kind))
        merged = model_bridge.MegatronModelBridge._accumulate_grouped_export(
            _AccumulatingBridge(), task, converted, config, buffers, hf_state
        )
    ((name, tensor),) = merged.items()
    assert name == HF + hf_name
    return tensor


@pytest.mark.parametrize("stored", STORED)
@pytest.mark.parametrize("transpose_on_export", [False, True], ids=["as-stacked", "transpose_on_export"])
@pytest.mark.parametrize("case", PACKED_CASES)
def test_packed_expert_stack_matches_stocks_grouped_export(case, transpose_on_export, stored, monkeypatch):
    from megatron.bridge.models.conversion import param_mapping

    from mbridge_refit.plan.stacking import STACKED_KIND, stacked_placement

    class_name, fc, hf_name, kind, local_shape = PACKED_CASES[case]
    mapping_class = getattr(param_mapping, class_name)
    generator = torch.Generator().manual_seed(1)
    locals_ = [torch.randn(local_shape, generator=generator).to(torch.bfloat16) for _ in range(EXPERTS)]
    stored_shape = STORED[stored](local_shape)
    expected = _stock_packed_export(
        mapping_class, fc, hf_name, kind, locals_, transpose_on_export, stored_shape, monkeypatch
    )

    mapping = mapping_class(GROUPED.format(fc=fc, e=0), HF + hf_name, transpose_on_export=transpose_on_export)
    placement, stack = stacked_placement(mapping, local_shape, num_experts=EXPERTS, stored_shape=stored_shape)
    assert placement.kind == STACKED_KIND and placement.hf_names == (HF + hf_name,)
    out = torch.full((EXPERTS, *stack.expert_shape(local_shape)), float("nan"), dtype=torch.bfloat16)
    for e, local in enumerate(locals_):
        stack.copy_into(out[e], local)
    assert out.shape == expected.shape
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))  # bitwise
    assert all(torch.equal(stack.read_from(out[e]), local) for e, local in enumerate(locals_))


def test_a_transpose_stock_makes_is_not_missed():
    """Qwen3-VL-MoE's published layout: the stock stack is transposed; without the transpose the
    slots differ in shape, so an exporter ignoring ``transpose_on_export`` cannot pass."""
    from megatron.bridge.models.conversion.param_mapping import FusedExpertMapping

    from mbridge_refit.plan.stacking import stacked_placement

    mapping = FusedExpertMapping(GROUPED.format(fc=2, e=0), HF + "down_proj", transpose_on_export=True)
    _, stack = stacked_placement(mapping, (HIDDEN, FFN), num_experts=EXPERTS, stored_shape=(EXPERTS, FFN, HIDDEN))
    assert stack.transpose and stack.expert_shape((HIDDEN, FFN)) == (FFN, HIDDEN)
    _, square = stacked_placement(mapping, (FFN, FFN), num_experts=EXPERTS, stored_shape=(EXPERTS, FFN, FFN))
    assert not square.transpose  # stock keeps a square slot as stacked


def test_grouped_mapping_without_a_rule_is_refused_by_name():
    from megatron.bridge.models.conversion.param_mapping import FusedExpertMapping

    from mbridge_refit.plan.slices import PlacementError
    from mbridge_refit.plan.stacking import stacked_placement

    class _OwnExport(FusedExpertMapping):  # a subclass may convert differently: no rule by inheritance
        pass

    mapping = _OwnExport(GROUPED.format(fc=2, e=0), HF + "down_proj")
    with pytest.raises(
        PlacementError, match=r"_OwnExport.*no stacking rule.*GPTOSSMLPGateUpProjMapping.*FusedExpertMapping"
    ):
        stacked_placement(mapping, (HIDDEN, FFN), num_experts=EXPERTS)
    permuted = FusedExpertMapping(GROUPED.format(fc=2, e=0), HF + "down_proj", permute_dims=(1, 0))
    with pytest.raises(PlacementError, match="permutes its export's dimensions"):
        stacked_placement(permuted, (HIDDEN, FFN), num_experts=EXPERTS)


def test_odd_rows_cannot_be_interleaved():
    from mbridge_refit.plan.slices import PlacementError
    from mbridge_refit.plan.stacking import ExpertStack

    with pytest.raises(PlacementError, match="5 rows cannot be interleaved in 2 blocks"):
        ExpertStack(interleave=2).check((5, HIDDEN))


def _stacked_entry():
    from mbridge_refit.plan.entries import PlanEntry, TensorSharding
    from mbridge_refit.plan.stacking import STACKED_KIND, ExpertStack

    sharding = TensorSharding(
        mesh_dims=("ep", "edp"),
        mesh_shape=(2, 1),
        placements=("Shard(0)", "Replicate()"),
        pieces=(),
        local_shape=(2 * FFN, HIDDEN),
        stack=ExpertStack(interleave=2, transpose=True, num_experts=4),
    )
    return PlanEntry(
        hf_name=HF + "gate_up_proj",
        shape=(4, HIDDEN, 2 * FFN),
        dtype="bfloat16",
        megatron_param=f"{LAYER.format(e=0)}.linear_fc1.weight",
        pp_rank=0,
        vpp_stage=0,
        is_expert=True,
        kind=STACKED_KIND,
        sharding=sharding,
    )


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
    shape = ModelShape(
        num_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=8, intermediate_size=FFN, num_experts=4
    )
    with pytest.raises(TransferPlanError, match=r"gate_up_proj: a stacked expert tensor.*packed broadcast"):
        build_transfer_plan(plan, megatron_rank_grid(tp=1, ep=2, dp=2), EngineLayout(tp=2, ep=2), shape)


@pytest.mark.multirank
def test_gpt_oss_cached_export_at_tp2_ep2(tmp_path):
    """TP2 x EP2 (2 CPU ranks, experts split over the tensor-parallel ranks): stacked tensors gathered over EP equal stock's, twice, and the
    second export writes them into the first one's buffers without allocating."""
    from conftest import REPO, torchrun

    result = tmp_path / "stacked.json"
    run = torchrun(
        2,
        [str(REPO / "tests" / "ranks" / "stacked_export_check.py"), "--tp", "2", "--ep", "2", "--result", str(result)],
    )
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads(Path(f"{result}.rank{rank}").read_text()) for rank in range(2)]
    assert all(r["stacked"] > 0 for r in reports)
    assert [r["failures"] for r in reports] == [[]] * 2


@pytest.mark.parametrize(
    ("interleave", "transpose", "shape"),
    [
        (1, False, (2 * FFN, HIDDEN)),
        (1, True, (2 * FFN, HIDDEN)),
        (2, True, (2 * FFN, HIDDEN)),
        (2, False, (2 * FFN,)),
    ],
    ids=["plain", "transposed", "interleaved-transposed", "interleaved-bias"],
)
def test_fill_stack_writes_what_copy_into_writes(interleave, transpose, shape):
    """``runtime.stack_fill`` (a ``torch.stack`` for plain stacks, a copy per expert otherwise on CPU;
    the Triton kernels are checked on the GPU: tests/test_gpu.py) against the layout's definition
    (``oracle.stacked_experts``)."""
    from oracle import stacked_experts

    from mbridge_refit.plan.stacking import ExpertStack
    from mbridge_refit.runtime.stack_fill import fill_stack

    stack = ExpertStack(interleave=interleave, transpose=transpose)
    generator = torch.Generator().manual_seed(2)
    experts = [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(EXPERTS)]
    expected = stacked_experts(experts, interleave=interleave, transpose=transpose)
    out = torch.full_like(expected, float("nan"))
    fill_stack(stack, out, experts, {})
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("kind", ["gated", "rows", "columns"])
@pytest.mark.parametrize("split", [2, 4])
def test_expert_shards_join_as_the_bridge_concatenates_them(kind, split):
    """``ExpertStack.join_into`` / ``shard_of`` against the definition written with torch.cat: a gated
    ``linear_fc1`` shard holds its gate rows, then its up rows (the whole: every gate, then every up);
    a column-parallel shard is a block of rows, a row-parallel one a block of columns."""
    from mbridge_refit.plan.stacking import ExpertStack

    torch.manual_seed(split)
    shards = [torch.randn(6, 5) for _ in range(split)]
    if kind == "gated":
        whole = torch.cat([torch.cat([s[:3] for s in shards]), torch.cat([s[3:] for s in shards])])
    else:
        whole = torch.cat(shards, dim=1 if kind == "columns" else 0)
    stack = ExpertStack(split=split, split_kind=kind)
    assert stack.whole_shape((6, 5)) == tuple(whole.shape)
    joined = torch.empty_like(whole)
    stack.join_into(joined, torch.stack(shards))
    assert torch.equal(joined, whole)
    for rank, shard in enumerate(shards):
        assert torch.equal(stack.shard_of(whole, rank), shard)
