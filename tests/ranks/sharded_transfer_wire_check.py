"""Two gloo ranks run a hand-built sharded transfer whose ranks disagree on the wire: one rank of
another ``WIRE_VERSION`` (or the version-1 frame, which names none), then one that passes another
``checksum=``. Every rank must raise ``TransferMismatchError`` by name within the group's timeout
(before the handshake carried the checksum setting, the rank sending sums waited for a receiver that
never posted them). Each rank writes ``rank<N>.json`` into the directory its argument names: the
messages it raised, by case (one file a rank: two ranks' prints can share a line of torchrun's output)."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mbridge_refit.plan.engine_layout import EngineLayout
from mbridge_refit.plan.transfer import EngineShard, Move, TransferPlan
from mbridge_refit.runtime.sharded_transfer import WIRE_VERSION, ShardedTransfer, TransferMismatchError

NAME, PARAM = "model.norm.weight", "decoder.final_layernorm.weight"


def plan() -> TransferPlan:
    """Engine TP2 takes halves of an 8-element tensor that rank 0 holds whole: rank 0 keeps its half
    and sends rank 1 the other (a point-to-point move, so a checksum would travel)."""
    shards = tuple(
        EngineShard(hf_name=NAME, engine_rank=r, target_rank=r, box=((4 * r, 4 * r + 4),), dtype="float32")
        for r in (0, 1)
    )
    moves = tuple(
        Move(
            hf_name=NAME,
            source_rank=0,
            target_rank=r,
            engine_rank=r,
            megatron_param=PARAM,
            source_box=((4 * r, 4 * r + 4),),
            shard_box=((0, 4),),
            dtype="float32",
        )
        for r in (0, 1)
    )
    return TransferPlan(
        engine=EngineLayout.parse("tp2"), engine_ranks=(0, 1), shards=shards, moves=moves, full_gather_bytes=0
    )


def refusal(transfer: ShardedTransfer) -> str:
    try:
        transfer.run(transfer.allocate_shards())
    except TransferMismatchError as err:
        return str(err)
    raise SystemExit(f"rank {dist.get_rank()}: the run was not refused")


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    params = {PARAM: torch.arange(8, dtype=torch.float32)} if rank == 0 else {}
    messages = {}
    for case, version in (("older", WIRE_VERSION - 1), ("none", 1), ("newer", WIRE_VERSION + 1)):
        transfer = ShardedTransfer(plan(), params=params, check_replicas=False)
        if rank == 1:
            transfer.wire_version = version  # another install on rank 1
        messages[case] = refusal(transfer)
    transfer = ShardedTransfer(plan(), params=params, check_replicas=False, checksum=rank == 0)
    messages["checksum"] = refusal(transfer)
    transfer = ShardedTransfer(plan(), params=params, check_replicas=False, checksum=True)
    shards = transfer.allocate_shards()
    transfer.run(shards)  # agreeing ranks still run, checksums and all
    messages["delivered"] = shards[NAME].tolist()
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **messages}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
