"""Whether the trainer ranks that hold copies of one tensor hold the same bytes.

A sharded transfer (``runtime.sharded_transfer``) takes a tensor that several trainer ranks hold
(a norm or a router replicated over tensor-parallel ranks, dense weights over expert-parallel
ones) from the rank nearest each engine rank, so engine ranks receive different copies. Megatron
keeps the copies equal only when they start equal (one initialisation seed on every rank, or
weights loaded from one checkpoint) and are updated alike; when they do not, every engine rank
would hold its own version of the tensor and no export is "the trainer's weights". Before any data
moves on a transfer's first run, ``check_replicas`` compares a checksum of each such region
(three int64 words, compared exactly) across the ranks that send it, in one ``all_gather``, and
raises ``ReplicaMismatchError`` on every rank alike, naming the tensors and the ranks.

What is compared: a region of HF coordinates that more than one trainer rank sends whole, the
tensors the engine replicates (norms, q/k norms, routers) and those its ranks cut as the holders
do. A tensor each engine rank takes a different part of, each from its own holder (trainer TP1
with data-parallel replicas, engine TP2: each half of ``down_proj`` from another replica), is not
compared: the plan records one holder per part.

Checked once per transfer (``ShardedTransfer(check_replicas=False)`` skips it): copies that agree at
the first refit stay equal under Megatron's updates; a training bug that lets them drift later is
not caught here.
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

_CHUNK_BYTES = 1 << 22  # bytes of a region read at once: the checksum's temporaries are a few times this
_WORDS = 3  # int64 words of a region's checksum


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
    it calls, with the same ``regions``). Raises on every rank alike: ``ReplicaMismatchError`` for
    copies that differ, ``TransportError`` when a rank could not checksum its copies (its error is
    shared through the same gather, so no rank waits for it)."""
    if not regions:
        return
    rank, ranks = dist.get_rank(), group_ranks(group)
    mine = torch.zeros(len(regions) + 1, _WORDS, dtype=torch.int64, device=device)  # last row: [failed, 0, 0]
    problem = None
    try:
        for i, region in enumerate(regions):
            for source_rank, param, box in region.sources:
                if source_rank == rank:
                    mine[i] = _checksum(params[param], box)
    except Exception as err:  # noqa: BLE001 - shared with every rank below, then raised here
        problem, mine[-1, 0] = f"{type(err).__name__}: {err}", 1
    everyone = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    failed = [ranks[i] for i in range(len(ranks)) if int(table[i, -1, 0]) != 0]
    if failed:
        here = f"; here: {problem}" if problem else ""
        raise TransportError(
            f"sharded transfer refused before any data moved: rank(s) {failed} could not checksum their copies of "
            f"replicated tensors{here}"
        )
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
    """[sum of b, of b*i, of b*i*i] over the region's bytes b at positions i (int64, wrapping),
    compared exactly: equal copies agree; a change to the bytes almost surely shows. Read in
    slices of rows, so no temporary exceeds a few times ``_CHUNK_BYTES``."""
    region = param.detach()[tuple(slice(start, stop) for start, stop in box)]
    rows = region.reshape(1, *region.shape) if region.dim() == 0 else region
    row_bytes = max(1, rows[0].numel() * rows.element_size()) if len(rows) else 1
    step = max(1, _CHUNK_BYTES // row_bytes)
    total = torch.zeros(_WORDS, dtype=torch.int64, device=param.device)
    offset = 0
    for start in range(0, len(rows), step):
        flat = rows[start : start + step].contiguous().view(-1).view(torch.uint8).to(torch.int64)
        position = torch.arange(offset + 1, offset + 1 + flat.numel(), dtype=torch.int64, device=param.device)
        weighted = flat * position
        total[0] += flat.sum()
        total[1] += weighted.sum()
        total[2] += (weighted * position).sum()
        offset += flat.numel()
    return total


def _box_text(box: Box) -> str:
    return "[" + ", ".join(f"{start}:{stop}" for start, stop in box) + "]"
