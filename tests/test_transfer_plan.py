"""The transfer plan of a sharded refit on hand-made export plans (pure: no ranks): the moves
worked out by hand, the rank grid, and every refusal naming its tensor."""

from __future__ import annotations

import dataclasses

import pytest
from json_versions import assert_other_version_refused

from mbridge_refit.plan.engine_layout import EngineLayout, EngineShardingError
from mbridge_refit.plan.entries import ExportPlan, PlanEntry, TensorSharding
from mbridge_refit.plan.layout import ModelShape
from mbridge_refit.plan.slices import SliceCopy
from mbridge_refit.plan.transfer import (
    TRANSFER_PLAN_VERSION,
    TrainerRank,
    TransferPlan,
    TransferPlanError,
    build_transfer_plan,
    megatron_rank_grid,
)

SHAPE = ModelShape(num_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=8, intermediate_size=8)


def column_entry(
    name="w", rows=4, tp=2, kind="column", megatron_param="decoder.layers.0.mlp.linear_fc2.weight"
) -> PlanEntry:
    per = rows // tp
    pieces = tuple(
        (SliceCopy(hf_name=name, dim=0, hf_start=r * per, hf_stop=(r + 1) * per, local_start=0),) for r in range(tp)
    )
    sharding = TensorSharding(
        mesh_dims=("tp", "dp"),
        mesh_shape=(tp, 1),
        placements=("Shard(0)", "Replicate()"),
        pieces=pieces,
        local_shape=(per, 3),
    )
    return PlanEntry(
        hf_name=name,
        shape=(rows, 3),
        dtype="bfloat16",
        megatron_param=megatron_param,
        pp_rank=0,
        vpp_stage=0,
        is_expert=False,
        kind=kind,
        sharding=sharding,
    )


def plan_of(*entries: PlanEntry, tp=2) -> ExportPlan:
    return ExportPlan(entries=entries, layer_map={0: (0, 0)}, tp=tp, pp=1, ep=1, vpp=1)


def test_megatron_rank_grid_follows_the_default_order():
    grid = megatron_rank_grid(tp=2, pp=2, ep=2, dp=2)
    assert grid[5] == TrainerRank(rank=5, pp=1, tp=1, ep=1, replica=0)
    assert grid[2] == TrainerRank(rank=2, pp=0, tp=0, ep=0, replica=1)
    assert [r.ep for r in megatron_rank_grid(tp=1, ep=2, dp=4)] == [0, 1, 0, 1]
    # expert-TP 2 (Megatron's default at TP2): the expert-TP rank runs fastest, then the expert-parallel rank
    assert [(r.etp, r.ep) for r in megatron_rank_grid(tp=2, ep=2, dp=2, etp=2)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_trainer_tp2_into_engine_tp4_moves_what_the_colocated_rank_lacks():
    plan = build_transfer_plan(plan_of(column_entry()), megatron_rank_grid(tp=2, dp=2), EngineLayout(tp=4), SHAPE)
    # engine rank i on global rank i: ranks 0 and 2 hold HF rows 0-1, ranks 1 and 3 rows 2-3
    assert [(m.engine_rank, m.source_rank, m.source_box, m.shard_box) for m in plan.moves] == [
        (0, 0, ((0, 1), (0, 3)), ((0, 1), (0, 3))),
        (1, 0, ((1, 2), (0, 3)), ((0, 1), (0, 3))),  # row 1 lives on TP rank 0: ranks 0 and 2; 0 sent least
        (2, 1, ((0, 1), (0, 3)), ((0, 1), (0, 3))),  # row 2 is local row 0 of TP rank 1: ranks 1 and 3
        (3, 3, ((1, 2), (0, 3)), ((0, 1), (0, 3))),
    ]
    assert plan.bytes_moved == 2 * 3 * 2 and plan.bytes_local == 2 * 3 * 2
    assert plan.full_gather_bytes == 4 * 2 * 3 * 2  # each of the 4 ranks lacks half of the 4x3 tensor
    assert TransferPlan.from_json(plan.to_json()) == plan
    assert TransferPlan.from_json(plan.to_json()).fingerprint == plan.fingerprint


@pytest.mark.parametrize("version", [None, TRANSFER_PLAN_VERSION - 1, TRANSFER_PLAN_VERSION + 1, True])
def test_a_transfer_plan_of_another_version_is_refused_by_name(version):
    """The JSON of a plan written by another mbridge_refit (None: one from before the JSON carried a version,
    which read back as a plan): ``TransferPlanError`` naming the format, both versions and the fix."""
    plan = build_transfer_plan(plan_of(column_entry()), megatron_rank_grid(tp=2, dp=2), EngineLayout(tp=4), SHAPE)
    assert_other_version_refused(
        plan.to_json(),
        TransferPlan.from_json,
        TransferPlanError,
        label="transfer plan",
        writer="the plan's writer (to_json)",
        current=TRANSFER_PLAN_VERSION,
        version=version,
    )


def test_agreeing_layouts_move_nothing():
    plan = build_transfer_plan(plan_of(column_entry()), megatron_rank_grid(tp=2), EngineLayout(tp=2), SHAPE)
    assert plan.bytes_moved == 0 and all(m.is_local for m in plan.moves)


def test_engine_ranks_elsewhere_receive_everything():
    plan = build_transfer_plan(
        plan_of(column_entry()), megatron_rank_grid(tp=2), EngineLayout(tp=2), SHAPE, engine_ranks=[2, 3]
    )
    assert plan.bytes_moved == 4 * 3 * 2 and {m.target_rank for m in plan.moves} == {2, 3}


def test_kv_heads_are_replicated_when_the_engine_has_more_ranks():
    k = column_entry("k", rows=4, kind="qkv", megatron_param="decoder.layers.0.self_attention.linear_qkv.weight")
    q = dataclasses.replace(k, hf_name="q")
    plan = build_transfer_plan(plan_of(q, k), megatron_rank_grid(tp=2, dp=2), EngineLayout(tp=4), SHAPE)
    k_boxes = [s.box[0] for s in plan.shards if s.hf_name == "k"]
    assert k_boxes == [(0, 2), (0, 2), (2, 4), (2, 4)]  # 2 kv heads of 2 rows over 4 ranks


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: EngineLayout(tp=2, ep=4), "ep must be 1 or 2"),
        (lambda: EngineLayout.parse("pp2"), "write e.g. tp2"),
        (
            lambda: build_transfer_plan(
                plan_of(column_entry(rows=6)), megatron_rank_grid(tp=2), EngineLayout(tp=4), SHAPE
            ),
            "w: engine tp=4 does not divide its dimension 0 (6)",
        ),
        (
            lambda: build_transfer_plan(
                plan_of(column_entry(kind="mystery")), megatron_rank_grid(tp=2), EngineLayout(tp=2), SHAPE
            ),
            "w: the export plan's kind 'mystery'",
        ),
        (
            lambda: build_transfer_plan(
                plan_of(dataclasses.replace(column_entry(), source_format="fp8_blockwise")),
                megatron_rank_grid(tp=2),
                EngineLayout(tp=2),
                SHAPE,
            ),
            "w: a sharded refit moves",
        ),
        (
            lambda: build_transfer_plan(
                plan_of(column_entry()), megatron_rank_grid(tp=2), EngineLayout(tp=2), SHAPE, only=["x"]
            ),
            "only= names tensors the export plan does not have",
        ),
        (
            lambda: build_transfer_plan(
                plan_of(column_entry()), megatron_rank_grid(tp=2), EngineLayout(tp=2), SHAPE, engine_ranks=[0, 0]
            ),
            "needs 2 distinct ranks",
        ),
    ],
    ids=["ep", "parse", "indivisible", "unknown-kind", "fp8-source", "only", "ranks"],
)
def test_refusals_name_the_problem(make, message):
    with pytest.raises((EngineShardingError, TransferPlanError)) as info:
        make()
    assert message in str(info.value)
