"""Whether the trainer ranks that hold copies of one tensor hold the same bytes.

A sharded transfer (``runtime.sharded_transfer``) takes a tensor that several trainer ranks hold
(a norm or a router replicated over tensor-parallel ranks, dense weights over expert-parallel
ones) from the rank nearest each engine rank, so engine ranks receive different copies. Megatron
keeps the copies equal only when they start equal (one initialisation seed on every rank, or
weights loaded from one checkpoint) and are updated alike; when they do not, every engine rank
would hold its own version of the tensor and no export is "the trainer's weights". Before any data
moves on a transfer's first run, ``check_replicas`` compares an exact checksum of each such
region across the ranks that send it (one ``all_gather`` of two int64 words per region) and
raises ``ReplicaMismatchError`` on every rank alike, naming the tensors and the ranks.

Checked once per transfer: copies that agree at the first refit stay equal under Megatron's
updates; a training bug that lets them drift later is not caught here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.errors import TransportError
from mbridge_refit.plan.engine_layout import Box
from mbridge_refit.plan.transfer import TransferPlan
from mbridge_refit.runtime.collectives import group_ranks

__all__ = ["ReplicaMismatchError", "ReplicatedRegion", "check_replicas", "replicated_regions"]

_CHUNK_BYTES = 1 << 24  # bounds the checksum's temporaries


class ReplicaMismatchError(TransportError):
    """Trainer ranks that send copies of one tensor hold different bytes."""


@dataclass(frozen=True, slots=True)
class ReplicatedRegion:
    """A box of one HF tensor (HF coordinates) that several trainer ranks send, each from its own
    parameter: ``sources`` holds (rank, Megatron parameter, box in that rank's local parameter)."""

    hf_name: str
    hf_box: Box
    sources: tuple[tuple[int, str, Box], ...]

    @property
    def source_ranks(self) -> tuple[int, ...]:
        return tuple(rank for rank, _, _ in self.sources)


def replicated_regions(plan: TransferPlan) -> list[ReplicatedRegion]:
    """The regions of ``plan``'s moves sent from more than one trainer rank, in a fixed order (the
    same on every rank). A move's region is its engine shard's box shifted by the move's
    ``shard_box``; moves that cut one region differently are not compared."""
    shard_starts = {(s.hf_name, s.engine_rank): tuple(start for start, _ in s.box) for s in plan.shards}
    sources: dict[tuple[str, Box], dict[int, tuple[str, Box]]] = defaultdict(dict)
    for move in plan.moves:
        start = shard_starts[(move.hf_name, move.engine_rank)]
        hf_box = tuple((offset + a, offset + b) for offset, (a, b) in zip(start, move.shard_box))
        sources[(move.hf_name, hf_box)][move.source_rank] = (move.megatron_param, move.source_box)
    return [
        ReplicatedRegion(hf_name=name, hf_box=hf_box, sources=tuple((rank, *ranks[rank]) for rank in sorted(ranks)))
        for (name, hf_box), ranks in sorted(sources.items())
        if len(ranks) > 1
    ]


def check_replicas(
    regions: Sequence[ReplicatedRegion], params: Mapping[str, torch.Tensor], *, group: Any, device: torch.device
) -> None:
    """Compare the regions' copies across their source ranks; collective over ``group`` (every rank of
    it calls, with the same ``regions``). Raises ``ReplicaMismatchError`` on every rank alike."""
    if not regions:
        return
    rank, ranks = dist.get_rank(), group_ranks(group)
    mine = torch.zeros(len(regions), 2, dtype=torch.int64, device=device)
    for i, region in enumerate(regions):
        for source_rank, param, box in region.sources:
            if source_rank == rank:
                mine[i] = _checksum(params[param], box)
    everyone = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    differing = [
        f"{r.hf_name}{_box_text(r.hf_box)} on ranks {list(r.source_ranks)}"
        for i, r in enumerate(regions)
        if len({tuple(table[ranks.index(s), i].tolist()) for s in r.source_ranks}) > 1
    ]
    if differing:
        raise ReplicaMismatchError(
            f"sharded transfer refused before any data moved: {len(differing)} tensor(s) that several trainer ranks "
            f"hold differ between them, so engine ranks would receive different weights: {differing[:4]}. "
            "Copies start equal when every rank seeds its CPU and CUDA generators alike before building the model "
            "(Megatron's initialisation does; Megatron builds routers on the CPU) or loads one checkpoint"
        )


def _checksum(param: torch.Tensor, box: Box) -> torch.Tensor:
    """[sum of the region's bytes, sum of byte x position] in int64 (wrapping): exact copies agree,
    a changed or moved byte changes it."""
    flat = param.detach()[tuple(slice(start, stop) for start, stop in box)].contiguous().view(-1).view(torch.uint8)
    total = torch.zeros(2, dtype=torch.int64, device=param.device)
    for start in range(0, flat.numel(), _CHUNK_BYTES):
        chunk = flat[start : start + _CHUNK_BYTES].to(torch.int64)
        position = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=param.device)
        total[0] += chunk.sum()
        total[1] += (chunk * position).sum()
    return total


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"
