"""runtime.replica_agreement's choice of regions, without launching ranks. The verdict across ranks
(a changed element refused on every rank) is proven by the sharded fault run
(tests/ranks/sharded_refit_check.py, tests/test_sharded_refit.py)."""

from __future__ import annotations

from mbridge_refit.plan.engine_layout import EngineLayout
from mbridge_refit.plan.transfer import EngineShard, Move, TransferPlan
from mbridge_refit.runtime.replica_agreement import replicated_regions


def move(name, source, engine, param, source_box, shard_box):
    return Move(
        hf_name=name,
        source_rank=source,
        target_rank=engine,
        engine_rank=engine,
        megatron_param=param,
        source_box=source_box,
        shard_box=shard_box,
        dtype="bfloat16",
    )


def shard(name, engine, box):
    return EngineShard(hf_name=name, engine_rank=engine, target_rank=engine, box=box, dtype="bfloat16")


def plan_of(shards, moves):
    return TransferPlan(
        engine=EngineLayout.parse("tp2"),
        engine_ranks=(0, 1),
        shards=tuple(shards),
        moves=tuple(moves),
        full_gather_bytes=0,
    )


def test_a_whole_tensor_sent_to_each_engine_rank_from_its_own_rank_is_replicated():
    norm = "model.norm.weight"
    plan = plan_of(
        [shard(norm, 0, ((0, 8),)), shard(norm, 1, ((0, 8),))],
        [
            move(norm, 0, 0, "final_layernorm.weight", ((0, 8),), ((0, 8),)),
            move(norm, 1, 1, "final_layernorm.weight", ((0, 8),), ((0, 8),)),
        ],
    )
    (region,) = replicated_regions(plan)
    assert (region.hf_name, region.hf_box, region.source_ranks) == (norm, ((0, 8),), (0, 1))


def test_the_same_local_box_of_two_tensor_parallel_shards_is_not_one_region():
    """Rank r's local rows 0:4 of a row-split weight are HF rows 4r:4r+4: different regions."""
    w = "model.layers.0.mlp.down_proj.weight"
    plan = plan_of(
        [shard(w, 0, ((0, 4), (0, 8))), shard(w, 1, ((4, 8), (0, 8)))],
        [
            move(w, 0, 0, "decoder.layers.0.mlp.linear_fc2.weight", ((0, 4), (0, 8)), ((0, 4), (0, 8))),
            move(w, 1, 1, "decoder.layers.0.mlp.linear_fc2.weight", ((0, 4), (0, 8)), ((0, 4), (0, 8))),
        ],
    )
    assert replicated_regions(plan) == []
