"""The export schedule: the plan cut into gather ops and buckets, and how each HF tensor is built.

Pure logic, decided once per exporter from the plan and this rank's place in the groups: no
tensor data is read. An ``Op`` is one gather unit (a Megatron parameter, or one local expert
index over the expert-parallel ranks) with the plan entries it yields and, per entry, an
``Assembly``: how this rank builds the HF tensor (``AssemblyKind``):

* ``VIEW``: rows [start, start+length) of the local (or gathered) shard, no copy;
* ``INDEX``: one ``index_select`` of row runs (q, k, v of grouped-query attention without
  tensor parallelism; yielded lazily as a ``RowSelection``);
* ``GATHER_ROWS``: tensor-parallel rank r owns HF rows [r*n, (r+1)*n) (column-parallel weights,
  gate and up, q, k, v): pack this rank's rows and all-gather them straight into the output;
* ``PIECES``: gather whole shards, then one copy per slice piece (row-parallel weights);
* ``STACK``: a stacked expert tensor (``plan.stacking``): each of this rank's local experts is
  copied, re-laid out, into its slot of this rank's share of the stack, which is all-gathered
  over the expert-parallel group straight into the output (at ep 1 the share is the output).

An entry with an ``elementwise_op`` (``conversions.ELEMENTWISE_OPS``) is never a ``VIEW`` or an
``INDEX``: it is always built in its own output buffer (``PIECES`` where it would be a view),
to which the exporter applies the op in place on every export. An entry with a ``relayout``
(``conversions.RELAYOUTS``: a transpose, a leading dimension of 1) is assembled as its
``build`` (the entry before the relayout: ``base_entry``), likewise never a view, and the
exporter copies the relaid tensor into the entry's own output buffer.

``build_buckets`` packs consecutive whole layers of one pipeline stage and gather group into
buckets whose gathers are issued together (one coalesced NCCL group). Every rank computes the
same buckets: they read only the plan.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch

from mbridge_refit.plan.entries import ExportPlan, PlanEntry, with_expert_number
from mbridge_refit.runtime.collectives import ParallelGroups

__all__ = [
    "Assembly",
    "AssemblyKind",
    "Bucket",
    "Op",
    "base_entry",
    "build_buckets",
    "build_ops",
    "gather_count",
    "layer_of",
    "plan_assembly",
]


class AssemblyKind(enum.Enum):
    VIEW = "view"
    INDEX = "index"
    GATHER_ROWS = "gather_rows"
    PIECES = "pieces"
    STACK = "stack"


@dataclass(frozen=True, kw_only=True, slots=True)
class Assembly:
    """How to build one HF tensor from gathered shards [ranks, *local_shape] (module docstring).

    ``start``/``length``: the row range of ``VIEW`` and of a contiguous ``GATHER_ROWS``;
    ``rows``: the row indices of ``INDEX`` and of a non-contiguous ``GATHER_ROWS``, with
    ``spans`` the ``(hf_row, source_row, rows)`` runs they list; ``pieces``: ``(rank, SliceCopy)``
    pairs of ``PIECES``.
    """

    kind: AssemblyKind
    start: int = 0
    length: int = 0
    rows: torch.Tensor | None = None
    spans: tuple = ()
    pieces: tuple = ()


@dataclass(kw_only=True, slots=True)
class Op:
    """One gather unit: a Megatron parameter (or one local expert index) and the entries it yields."""

    entries: list[PlanEntry]
    assemblies: list[Assembly]  # how each entry's ``build`` is assembled
    builds: list[PlanEntry]  # per entry, what its slices make: the entry, or before its relayout (``base_entry``)
    # The global names of the local parameters the op reads: one, or for ``STACK`` this rank's
    # expert parameters in slot order; empty where this rank holds no shard.
    sources: tuple[str, ...]
    sharded_over_tp: bool
    expert: bool

    @property
    def source(self) -> str | None:
        """The (first) local parameter the op reads; None where this rank holds no shard."""
        return self.sources[0] if self.sources else None

    @property
    def stacked(self) -> bool:
        """Whether the op stacks several local expert parameters into one tensor (``STACK``)."""
        return self.entries[0].sharding.stack is not None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.alias_of is None)

    @property
    def gathers_whole_shards(self) -> bool:
        """Whether the op gathers whole tensor-parallel shards (for ``PIECES`` assemblies)."""
        return self.sharded_over_tp and any(a.kind is AssemblyKind.PIECES for a in self.assemblies)


@dataclass(kw_only=True, slots=True)
class Bucket:
    """Consecutive ops of one pipeline stage and one gather group whose gathers are issued together.

    Buckets hold whole layers (a layer's ops never straddle two buckets), so the sequence of
    buffer requests is the same for every bucket of the same shape and cached buffers are
    shared between them. Buffers are keyed by the op's position in its bucket (its slot).
    """

    ops: list[Op]
    expert: bool
    pp_rank: int
    gathers: int  # gathers this rank issues for the bucket (decides whether to coalesce)


def build_ops(plan: ExportPlan, params: Mapping[str, torch.Tensor], groups: ParallelGroups) -> list[Op]:
    """Group consecutive plan entries by the parameter (or expert index) they come from."""
    experts_per_rank = _experts_per_rank(plan)
    ops: list[Op] = []
    for entry in plan.entries:
        key = _op_key(entry)
        if ops and _op_key(ops[-1].entries[0]) == key and entry.alias_of is None:
            ops[-1].entries.append(entry)
            ops[-1].assemblies.append(plan_assembly(entry, groups))
            ops[-1].builds.append(base_entry(entry))
            continue
        sources: tuple[str, ...] = ()
        if entry.alias_of is None and entry.pp_rank == groups.pp_rank:
            if entry.sharding.stack is not None:
                sources = _my_stacked_params(entry, plan.ep, groups)
            else:
                sources = (
                    entry.megatron_param if not entry.is_expert else _my_expert_param(entry, experts_per_rank, groups),
                )
            for source in sources:
                if source not in params:
                    raise KeyError(f"the plan places {source} on this rank, which does not hold it")
        ops.append(
            Op(
                entries=[entry],
                assemblies=[plan_assembly(entry, groups)],
                builds=[base_entry(entry)],
                sources=sources,
                sharded_over_tp=not entry.is_expert and len(entry.sharding.pieces) > 1,
                expert=entry.is_expert,
            )
        )
    return ops


def build_buckets(
    ops: list[Op], bucket_bytes: int, groups: ParallelGroups, sizes: Mapping[str, int] | None = None
) -> list[Bucket]:
    """Pack consecutive whole layers of one stage and gather group into buckets of at most
    ``bucket_bytes`` output bytes (a layer larger than that is a bucket of its own), counting each
    HF tensor as ``sizes`` says (default: its plan entry's bytes); with ``bucket_bytes <= 0``, one
    bucket per op. The same on every rank: it reads only the plan (and ``sizes``).

    The first bucket of each stage and gather group that holds a layer closes after that layer
    (as DDP's first gradient bucket is small): the device's first gathers or kernels wait only
    for one layer's host work.
    """
    if bucket_bytes <= 0:
        groupings = [[op] for op in ops]
    else:
        groupings, pending_bytes, closed, started = [], 0, False, set()
        for unit in _layer_units(ops):
            unit_bytes = sum(_op_bytes(op, sizes) for op in unit)
            kind = _unit_kind(unit)
            if (
                groupings
                and not closed
                and kind == _unit_kind(groupings[-1])
                and pending_bytes + unit_bytes <= bucket_bytes
            ):
                groupings[-1].extend(unit)
                pending_bytes += unit_bytes
            else:
                groupings.append(list(unit))
                pending_bytes = unit_bytes
            closed = isinstance(layer_of(unit[0].entries[0].megatron_param), int) and kind not in started
            if closed:
                started.add(kind)
    return [
        Bucket(
            ops=bucket,
            expert=bucket[0].expert,
            pp_rank=bucket[0].entries[0].pp_rank,
            gathers=sum(gather_count(op, groups) for op in bucket),
        )
        for bucket in groupings
    ]


def gather_count(op: Op, groups: ParallelGroups) -> int:
    """How many gathers ``op`` issues on this rank (to decide whether coalescing is worth it)."""
    if op.source is None:
        return 0
    if op.expert:
        return int(groups.ep_size > 1) + int(groups.etp_size > 1)
    rows = sum(a.kind is AssemblyKind.GATHER_ROWS for a in op.assemblies)
    return rows + int(op.gathers_whole_shards)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(megatron_param: str) -> int | str:
    """The decoder layer a parameter belongs to, or its own name for non-layer parameters."""
    match = _LAYER.search(megatron_param)
    return int(match.group(1)) if match else megatron_param


def base_entry(entry: PlanEntry) -> PlanEntry:
    """What ``entry``'s slices make: the entry itself, or, for one with a relayout, the tensor
    before it (its ``base_shape``, no relayout)."""
    if entry.relayout is None:
        return entry
    return dataclasses.replace(entry, shape=entry.base_shape, relayout=None)


def plan_assembly(entry: PlanEntry, groups: ParallelGroups) -> Assembly:
    """Choose how to build ``entry`` (its ``base_entry``) on this rank from its slice pieces (decided once)."""
    if entry.sharding.stack is not None:
        if entry.elementwise_op is not None or entry.relayout is not None:
            raise ValueError(
                f"{entry.hf_name}: a stacked expert tensor with an elementwise op or a relayout has no assembly"
            )
        return Assembly(kind=AssemblyKind.STACK)
    assembly = _slices_assembly(base_entry(entry), groups)
    converted = entry.elementwise_op is not None or entry.relayout is not None
    if converted and assembly.kind in (AssemblyKind.VIEW, AssemblyKind.INDEX):
        return _pieces_assembly(entry.sharding.pieces)  # into a buffer of its own: the op must not touch the parameter
    return assembly


def _pieces_assembly(pieces) -> Assembly:
    return Assembly(kind=AssemblyKind.PIECES, pieces=tuple((r, c) for r, rank in enumerate(pieces) for c in rank))


def _slices_assembly(entry: PlanEntry, groups: ParallelGroups) -> Assembly:
    pieces = entry.sharding.pieces
    if len(pieces) > 1 and not entry.is_expert:
        return _tp_assembly(entry, groups.tp_rank)
    local_rows = entry.sharding.local_shape[0]
    dim = pieces[0][0].dim
    if dim == 0:
        spans = sorted(
            (c.hf_start, r * local_rows + c.local_start, c.length) for r, rank in enumerate(pieces) for c in rank
        )
        first = spans[0][1]
        if all(source == first + hf_start for hf_start, source, _ in spans):
            return Assembly(kind=AssemblyKind.VIEW, start=first, length=entry.shape[0])
        return Assembly(kind=AssemblyKind.INDEX, rows=_rows(spans), spans=tuple(spans))
    if len(pieces) == 1 and len(pieces[0]) == 1 and pieces[0][0].length == entry.shape[dim]:
        return Assembly(kind=AssemblyKind.VIEW, start=0, length=entry.shape[0])
    return _pieces_assembly(pieces)


def _tp_assembly(entry: PlanEntry, tp_rank: int) -> Assembly:
    """Tensor-parallel entry: all-gather straight into the output when rank r owns HF rows
    [r*n, (r+1)*n) (column, gate/up, q/k/v); otherwise gather shards and copy pieces."""
    pieces = entry.sharding.pieces
    per_rank = entry.shape[0] // len(pieces)
    row_split = all(c.dim == 0 for rank in pieces for c in rank) and all(
        sorted((c.hf_start, c.hf_stop) for c in rank)[0][0] == r * per_rank
        and sum(c.length for c in rank) == per_rank
        and _contiguous_hf(rank)
        for r, rank in enumerate(pieces)
    )
    if not row_split:
        return _pieces_assembly(pieces)
    mine = sorted(pieces[tp_rank], key=lambda c: c.hf_start)
    spans = [(c.hf_start, c.local_start, c.length) for c in mine]
    if all(local == mine[0].local_start + hf - mine[0].hf_start for hf, local, _ in spans):
        return Assembly(kind=AssemblyKind.GATHER_ROWS, start=mine[0].local_start, length=per_rank)
    return Assembly(kind=AssemblyKind.GATHER_ROWS, rows=_rows(spans))


def _contiguous_hf(rank_pieces) -> bool:
    ordered = sorted(rank_pieces, key=lambda c: c.hf_start)
    return all(a.hf_stop == b.hf_start for a, b in zip(ordered, ordered[1:]))


def _rows(spans) -> torch.Tensor:
    return torch.cat([torch.arange(source, source + length) for _, source, length in spans])


def _op_key(entry: PlanEntry) -> tuple:
    if entry.alias_of is not None:
        return ("alias", entry.hf_name)
    if entry.is_expert:
        return ("expert", entry.sharding.local_expert_index, with_expert_number(entry.megatron_param, 0))
    return ("param", entry.megatron_param)


def _my_expert_param(entry: PlanEntry, experts_per_rank: int, groups: ParallelGroups) -> str:
    """The global name of the parameter this EP rank holds for the entry's local expert index."""
    return with_expert_number(
        entry.megatron_param, entry.sharding.local_expert_index + groups.ep_rank * experts_per_rank
    )


def _my_stacked_params(entry: PlanEntry, ep: int, groups: ParallelGroups) -> tuple[str, ...]:
    """The global names of this EP rank's experts of a stacked entry, in slot order."""
    per_rank = entry.sharding.stack.num_experts // ep
    first = groups.ep_rank * per_rank
    return tuple(with_expert_number(entry.megatron_param, first + k) for k in range(per_rank))


def _experts_per_rank(plan: ExportPlan) -> int:
    indices = {e.sharding.local_expert_index for e in plan.entries if e.is_expert and e.sharding.stack is None}
    return max(indices) + 1 if indices else 1


def _op_bytes(op: Op, sizes: Mapping[str, int] | None) -> int:
    if sizes is None:
        return op.nbytes
    return sum(sizes.get(e.hf_name, e.nbytes) for e in op.entries if e.alias_of is None)


def _layer_units(ops: list[Op]) -> Iterator[list[Op]]:
    """Runs of consecutive ops of the same layer, stage and gather group (non-layer ops alone)."""
    unit: list[Op] = []
    for op in ops:
        if unit and _unit_key(op) != _unit_key(unit[-1]):
            yield unit
            unit = []
        unit.append(op)
    if unit:
        yield unit


def _unit_key(op: Op) -> tuple:
    entry = op.entries[0]
    return (layer_of(entry.megatron_param), op.expert, entry.pp_rank, entry.alias_of)


def _unit_kind(ops: list[Op]) -> tuple:
    return (ops[0].expert, ops[0].entries[0].pp_rank)
