"""The transfer plan of a sharded refit: which bytes each engine rank needs and who sends them.

Computed once from the export plan (where each HF tensor's slices live on the trainer's ranks),
the trainer's rank grid (each rank's pipeline, tensor- and expert-parallel coordinates) and the
engine's layout and placement (``engine_ranks[i]``: the global rank engine rank i runs on; by
default ``i``, the colocated case). For every engine rank and HF tensor it needs, the engine's
rule (``plan.engine_layout``) gives a box; the box is cut along the trainer's tensor-parallel
pieces, and each part becomes one ``Move``: from a trainer rank that holds it (the engine rank's
own rank whenever it holds it, so agreeing layouts move nothing over the network; otherwise the
holder that has sent the fewest bytes so far) to the engine rank, with the part's place in the
source's local Megatron parameter and in the engine's shard. Nothing else is needed at run time.

JSON-serialisable (``to_json`` / ``from_json``) like the export plan, with a fingerprint both
sides compare before any data moves. The JSON carries ``TRANSFER_PLAN_VERSION`` (its layout: the
plan's, its shards' and its moves' fields); ``from_json`` refuses another version, or none (a plan
written by an mbridge_refit from before it was versioned), by name before it reads anything else. Validated when built: every byte of every engine shard is
delivered exactly once, and a tensor the engine rules cannot slice, a byte no trainer rank holds
or a weight the trainer keeps in another format is refused with the tensor named.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from mbridge_refit.errors import InputError, wire_version_mismatch
from mbridge_refit.plan.engine_layout import (
    Box,
    EngineLayout,
    EngineTensor,
    box_shape,
    engine_box,
    engine_rule,
    with_extent,
)
from mbridge_refit.plan.entries import ExportPlan, PlanEntry, numel
from mbridge_refit.plan.layout import ModelShape
from mbridge_refit.plan.slices import SliceCopy
from mbridge_refit.plan.storage import PLAIN

__all__ = [
    "EngineShard",
    "Move",
    "TRANSFER_PLAN_VERSION",
    "TrainerRank",
    "TransferPlan",
    "TransferPlanError",
    "build_transfer_plan",
    "megatron_rank_grid",
]


TRANSFER_PLAN_VERSION = 1  # TransferPlan.to_json's layout: bump it with any change of what the JSON holds
_WIRE_FORMAT = "transfer plan"


class TransferPlanError(InputError):
    """A sharded refit that cannot be planned (the tensor and the reason named)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerRank:
    """Where one trainer rank sits: its global rank, pipeline stage, tensor-, expert- and
    expert-tensor-parallel ranks, and data-parallel replica."""

    rank: int
    pp: int
    tp: int
    ep: int
    replica: int
    etp: int = 0  # its rank in the expert tensor-parallel group (which expert slices it holds)


def megatron_rank_grid(
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    dp: int = 1,
    etp: int = 1,
) -> tuple[TrainerRank, ...]:
    """The trainer ranks of a Megatron-Core job in its default order (``tp-cp-ep-dp-pp``; experts on
    the ``tp-ep-dp-pp`` grid whose ``tp`` is the expert-TP size), for planning a job that is not
    running (bytes moved for a full-size model). A running job gathers its real coordinates
    instead (``RefitBridge.transfer_plan``)."""
    stage = tp * cp * dp
    if stage % (ep * etp):
        raise TransferPlanError(f"ep*etp = {ep}*{etp} must divide tp*cp*dp = {stage}")
    return tuple(
        TrainerRank(
            rank=rank,
            pp=rank // stage,
            tp=rank % stage % tp,
            ep=rank % stage // etp % ep,
            replica=rank % stage // (tp * cp),
            etp=rank % stage % etp,
        )
        for rank in range(stage * pp)
    )


class _Sized:
    """``shape``, that of the item's ``box``, and ``nbytes``, that many ``dtype`` elements."""

    __slots__ = ()

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineShard(_Sized):
    """The part ``box`` (HF coordinates) of ``hf_name`` that engine rank ``engine_rank`` keeps."""

    hf_name: str
    engine_rank: int
    target_rank: int
    box: Box
    dtype: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Move(_Sized):
    """Bytes of ``hf_name`` from ``source_rank``'s local ``megatron_param`` (``source_box``) to
    engine rank ``engine_rank`` on ``target_rank``, into its shard at ``shard_box``."""

    hf_name: str
    source_rank: int
    target_rank: int
    engine_rank: int
    megatron_param: str
    source_box: Box
    shard_box: Box
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of ``shard_box``, what the move writes."""
        return box_shape(self.shard_box)

    @property
    def is_local(self) -> bool:
        return self.source_rank == self.target_rank


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferPlan:
    """Every engine shard and every move of one sharded refit (the same on every rank)."""

    engine: EngineLayout
    engine_ranks: tuple[int, ...]
    shards: tuple[EngineShard, ...]
    moves: tuple[Move, ...]
    full_gather_bytes: (
        int  # what a gathering export moves so that every engine rank's trainer rank holds every tensor whole
    )

    @property
    def bytes_moved(self) -> int:
        """Bytes sent between ranks per refit."""
        return sum(m.nbytes for m in self.moves if not m.is_local)

    @property
    def bytes_local(self) -> int:
        """Bytes copied within a rank (trainer parameter to the colocated engine shard)."""
        return sum(m.nbytes for m in self.moves if m.is_local)

    def shards_on(self, rank: int) -> list[EngineShard]:
        return [s for s in self.shards if s.target_rank == rank]

    def summary(self) -> dict[str, Any]:
        return {
            "engine": self.engine.name,
            "engine_ranks": list(self.engine_ranks),
            "shards": len(self.shards),
            "moves": len(self.moves),
            "shard_bytes": sum(s.nbytes for s in self.shards),
            "bytes_moved": self.bytes_moved,
            "bytes_local": self.bytes_local,
            "full_gather_bytes": self.full_gather_bytes,
        }

    @property
    def fingerprint(self) -> int:
        """A signed 64-bit hash of the whole plan (fits an int64 tensor)."""
        digest = hashlib.sha256(self.to_json().encode()).digest()
        return int.from_bytes(digest[:8], "little", signed=True)

    def to_json(self) -> str:
        """The plan as JSON, with ``TRANSFER_PLAN_VERSION`` (what ``from_json`` reads back)."""
        return json.dumps({"version": TRANSFER_PLAN_VERSION, **dataclasses.asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "TransferPlan":
        """``to_json``'s plan back; JSON of another ``TRANSFER_PLAN_VERSION`` (or none) raises
        ``TransferPlanError`` naming both versions."""
        raw = json.loads(text)
        version = raw.get("version") if isinstance(raw, dict) else None
        if type(version) is not int or version != TRANSFER_PLAN_VERSION:
            raise TransferPlanError(
                wire_version_mismatch(_WIRE_FORMAT, TRANSFER_PLAN_VERSION, version, "the plan's writer (to_json)")
            )
        return cls(
            engine=EngineLayout(**raw["engine"]),
            engine_ranks=tuple(raw["engine_ranks"]),
            shards=tuple(EngineShard(**{**s, "box": _box(s["box"])}) for s in raw["shards"]),
            moves=tuple(
                Move(**{**m, "source_box": _box(m["source_box"]), "shard_box": _box(m["shard_box"])})
                for m in raw["moves"]
            ),
            full_gather_bytes=raw["full_gather_bytes"],
        )


def build_transfer_plan(
    plan: ExportPlan,
    grid: Iterable[TrainerRank],
    engine: EngineLayout,
    shape: ModelShape,
    *,
    engine_ranks: Iterable[int] | None = None,
    only: Iterable[str] | None = None,
) -> TransferPlan:
    """The transfer plan of ``plan`` (a BF16 export plan) from the trainer ranks ``grid`` into
    ``engine`` placed on ``engine_ranks`` (default: engine rank i on global rank i). ``shape``:
    the model's head and expert counts (``ModelShape.from_hf_config``). ``only``: plan a subset of
    the HF names (e.g. without a tied output layer the engine does not load). Pure."""
    grid = tuple(grid)
    engine_ranks = tuple(range(engine.ranks)) if engine_ranks is None else tuple(engine_ranks)
    if len(engine_ranks) != engine.ranks or len(set(engine_ranks)) != len(engine_ranks):
        raise TransferPlanError(f"engine {engine.name} needs {engine.ranks} distinct ranks, got {list(engine_ranks)}")
    wanted = None if only is None else frozenset(only)
    entries = [(e, role) for e, role in _with_roles(plan) if wanted is None or e.hf_name in wanted]
    if wanted is not None and len(entries) != len(wanted):
        unknown = sorted(wanted - {e.hf_name for e, _ in entries})
        raise TransferPlanError(f"only= names tensors the export plan does not have, e.g. {unknown[:5]}")
    chooser = _SourceChooser(grid)
    shards, moves = [], []
    for entry, role in entries:
        _check_plannable(entry)
        tensor = EngineTensor(
            hf_name=entry.hf_name,
            shape=entry.shape,
            rule=engine_rule(entry, role, engine),
            expert=_global_expert(entry, plan, shape),
        )
        for engine_rank, target in enumerate(engine_ranks):
            box = engine_box(tensor, engine_rank, engine, shape)
            if box is None:
                continue
            shard = EngineShard(
                hf_name=entry.hf_name, engine_rank=engine_rank, target_rank=target, box=box, dtype=entry.dtype
            )
            shards.append(shard)
            moves.extend(_moves_for(entry, shard, chooser))
    return TransferPlan(
        engine=engine,
        engine_ranks=engine_ranks,
        shards=tuple(shards),
        moves=tuple(moves),
        full_gather_bytes=sum(_missing_bytes(e, grid, target) for e, _ in entries for target in engine_ranks),
    )


def _with_roles(plan: ExportPlan) -> list[tuple[PlanEntry, int]]:
    """Each entry with its position among the HF tensors of its Megatron parameter (q=0, k=1, v=2)."""
    seen: dict[tuple[str, int | None, int | None], int] = defaultdict(int)
    result = []
    for entry in plan.entries:
        if entry.alias_of is not None:
            result.append((entry, 0))
            continue
        key = (entry.megatron_param, entry.sharding.owner_ep_rank, entry.sharding.local_expert_index)
        result.append((entry, seen[key]))
        seen[key] += 1
    return result


def _check_plannable(entry: PlanEntry) -> None:
    if entry.sharding.stack is not None:
        raise TransferPlanError(
            f"{entry.hf_name}: a stacked expert tensor (every expert of the layer, each re-laid out) is not a box of "
            "slices of the trainer's parameters, which is all a sharded refit moves; refit this model with the "
            "packed broadcast (full export) instead"
        )
    if entry.elementwise_op is not None:
        raise TransferPlanError(
            f"{entry.hf_name}: its export applies {entry.elementwise_op!r} to the trainer's values, and a sharded refit "
            "moves the values as they are stored; refit this model with the packed broadcast (full export) instead"
        )
    if entry.relayout is not None:
        raise TransferPlanError(
            f"{entry.hf_name}: its export lays the trainer's tensor out anew ({entry.relayout!r}), and a sharded refit "
            "moves boxes of the tensor as the trainer stores it; refit this model with the packed broadcast (full export) instead"
        )
    if entry.scale_of is not None or entry.source_format != PLAIN:
        raise TransferPlanError(
            f"{entry.hf_name}: a sharded refit moves the trainer's parameters as they are stored, in their own dtype; "
            f"this tensor is {'an FP8 scale' if entry.scale_of else f'stored as {entry.source_format}'}. Plan from the "
            "BF16 export plan (export_plan(model) without fp8) of a model with plain parameters"
        )


def _global_expert(entry: PlanEntry, plan: ExportPlan, shape: ModelShape) -> int | None:
    if not entry.is_expert:
        return None
    if not shape.num_experts or shape.num_experts % plan.ep:
        raise TransferPlanError(
            f"{entry.hf_name}: the model shape has {shape.num_experts} experts, not a multiple of the trainer's ep={plan.ep}"
        )
    return entry.sharding.owner_ep_rank * (shape.num_experts // plan.ep) + entry.sharding.local_expert_index


def _holders(entry: PlanEntry, tp_index: int, grid: tuple[TrainerRank, ...]) -> list[int]:
    """Global ranks holding tensor-parallel piece ``tp_index`` of ``entry`` (for an expert: the
    owner's expert-tensor-parallel rank ``tp_index``; every rank holds a tensor with one piece
    list: replicated or TP 1)."""
    stage = [r for r in grid if r.pp == entry.pp_rank]
    if entry.is_expert:
        owners = [r for r in stage if r.ep == entry.sharding.owner_ep_rank]
        return [r.rank for r in owners if len(entry.sharding.pieces) == 1 or r.etp == tp_index]
    if len(entry.sharding.pieces) == 1:
        return [r.rank for r in stage]
    return [r.rank for r in stage if r.tp == tp_index]


class _SourceChooser:
    """Picks who sends a part: the receiving rank itself when it holds it, otherwise the holder
    that has sent the fewest bytes so far (ties: the lowest rank)."""

    def __init__(self, grid: tuple[TrainerRank, ...]) -> None:
        self.grid = grid
        self.sent: dict[int, int] = defaultdict(int)

    def choose(self, holders: list[int], target: int, nbytes: int) -> int:
        if target in holders:
            return target
        source = min(holders, key=lambda rank: (self.sent[rank], rank))
        self.sent[source] += nbytes
        return source


def _moves_for(entry: PlanEntry, shard: EngineShard, chooser: _SourceChooser) -> list[Move]:
    moves, delivered = [], 0
    for tp_index, pieces in enumerate(entry.sharding.pieces):
        holders = _holders(entry, tp_index, chooser.grid)
        for piece in pieces:
            part = _intersect(shard.box, piece)
            if part is None:
                continue
            if not holders:
                raise TransferPlanError(
                    f"{entry.hf_name}: no trainer rank of stage {entry.pp_rank} holds its piece {piece}"
                )
            source_box = with_extent(
                part,
                piece.dim,
                part[piece.dim][0] - piece.hf_start + piece.local_start,
                part[piece.dim][1] - piece.hf_start + piece.local_start,
            )
            shard_box = tuple((start - base, stop - base) for (start, stop), (base, _) in zip(part, shard.box))
            move = Move(
                hf_name=entry.hf_name,
                source_rank=0,
                target_rank=shard.target_rank,
                engine_rank=shard.engine_rank,
                megatron_param=entry.megatron_param,
                source_box=source_box,
                shard_box=shard_box,
                dtype=entry.dtype,
            )
            moves.append(dataclasses.replace(move, source_rank=chooser.choose(holders, shard.target_rank, move.nbytes)))
            delivered += numel(box_shape(part))
    if delivered != numel(shard.shape):
        raise TransferPlanError(
            f"{entry.hf_name}: the trainer's pieces deliver {delivered} of the {numel(shard.shape)} elements engine rank "
            f"{shard.engine_rank} needs ({shard.box})"
        )
    return moves


def _intersect(box: Box, piece: SliceCopy) -> Box | None:
    start, stop = box[piece.dim]
    low, high = max(start, piece.hf_start), min(stop, piece.hf_stop)
    if low >= high or any(a >= b for a, b in box):
        return None
    return with_extent(box, piece.dim, low, high)


def _missing_bytes(entry: PlanEntry, grid: tuple[TrainerRank, ...], target: int) -> int:
    """Bytes of ``entry`` that ``target`` must receive to hold it whole (the export's contract)."""
    held = 0
    for tp_index, pieces in enumerate(entry.sharding.pieces):
        if target in _holders(entry, tp_index, grid):
            held += sum(numel(_piece_shape(entry.shape, p)) for p in pieces)
    return entry.nbytes - held * _itemsize(entry.dtype)


def _piece_shape(shape: tuple[int, ...], piece: SliceCopy) -> tuple[int, ...]:
    return shape[: piece.dim] + (piece.length,) + shape[piece.dim + 1 :]


@functools.cache
def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _box(raw: list) -> Box:
    return tuple(tuple(pair) for pair in raw)
