"""Fast streaming export: run an ``ExportPlan`` with views, bucketed gathers, cached buffers.

Consecutive whole layers are grouped into buckets (``PlanExporter.bucket_bytes``). For each
bucket, on the pipeline stage that owns it, every gather of the bucket is issued in one
coalesced NCCL group, then the HF tensors are built:

1. tensor-parallel HF tensors split by rows (column-parallel weights, gate and up, q, k and v):
   pack this rank's rows of the HF tensor (a view, or for grouped-query QKV one small
   ``index_select``) and ``all_gather_into_tensor`` straight into the HF-shaped output: no copy
   after the gather. HF tensors split by columns (row-parallel weights): gather the shards once
   per parameter, then one copy per rank into the output;
2. without tensor parallelism (or for replicated tensors): a view of the local shard when the
   HF tensor is a contiguous slice of it, else one ``index_select`` (QKV with grouped heads);
3. experts: one ``all_gather_into_tensor`` of the local expert over the expert-parallel group,
   then views (expert tensor parallelism is 1);
4. broadcast each HF tensor from the owning stage to the other pipeline stages.

Every rank yields every tensor, in plan order (the stock export's order). FP8 tensors travel
as bytes.

Buffers: gather, output and receive buffers come from ``ExportBuffers``. With a persistent
pool (``reuse_buffer_from_cache=True``) they are allocated on the first export and reused by
every later one, keyed by (role, position in the bucket, shape, dtype, device): buckets of the
same layout share them.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from mbridge_refit.plan import ExportPlan, PlanEntry

logger = logging.getLogger(__name__)


class ExportBuffers:
    """Output buffers owned by the bridge.

    ``persistent=True``: one buffer per (role, index, shape, dtype, device), allocated on first
    use and reused by every later export; ``release()`` frees them. ``persistent=False``: a
    fresh tensor for every request (the caller may keep what it is given).

    ``memo``: records derived from the buffers (e.g. how a bucket is quantized into them), kept
    exactly as long as the buffers are.
    """

    def __init__(self, *, persistent: bool) -> None:
        self.persistent = persistent
        self._pool: dict[tuple, torch.Tensor] = {}
        self.memo: dict[Any, Any] = {}
        self.allocations = 0

    def get(self, role: str, index: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (role, index, tuple(shape), dtype, str(device))
        buffer = self._pool.get(key) if self.persistent else None
        if buffer is None:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self.allocations += 1
            if self.persistent:
                self._pool[key] = buffer
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._pool.values())

    def release(self) -> None:
        self._pool.clear()
        self.memo.clear()


@dataclass(frozen=True, kw_only=True, slots=True)
class _Assembly:
    """How to build one HF tensor from gathered shards [ranks, *local_shape], decided once.

    ``view``: rows [start, start+length) of the flattened shards (no copy); ``index``: one
    ``index_select`` with ``rows``; ``gather_rows``: pack this rank's rows (a view of
    [start, start+length), or ``rows``) and all-gather them into the output; ``pieces``: gather
    whole shards, then one copy per piece.
    """

    how: str
    start: int = 0
    length: int = 0
    rows: torch.Tensor | None = None
    spans: tuple = ()  # for "index": (hf_row, source_row, rows) runs that ``rows`` lists
    pieces: tuple = ()


class RowSelection:
    """An HF tensor made of runs of rows of ``source`` (a grouped-query q, k or v split from the
    fused QKV without tensor parallelism), not copied out yet: what
    ``PlanExporter.export_buckets(select_rows_lazily=True)`` yields in its place, so that a
    transform that reads rows anyway (the FP8 quantizer) reads them from ``source``.

    ``runs``: ``(hf_row, source_row, rows)`` triples, ascending in ``hf_row`` and covering the
    HF tensor. ``materialize()`` copies the rows into the export's buffer for this tensor (once;
    later calls return the same tensor). Valid as long as the bucket that yielded it.
    """

    __slots__ = ("source", "runs", "shape", "_build", "_tensor")

    def __init__(self, source: torch.Tensor, runs: tuple[tuple[int, int, int], ...], shape: tuple[int, ...],
                 build: Callable[[], torch.Tensor]) -> None:
        self.source, self.runs, self.shape, self._build = source, runs, tuple(shape), build
        self._tensor: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    def materialize(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._build()
        return self._tensor


@dataclass(kw_only=True, slots=True)
class _Op:
    """One gather unit: a Megatron parameter (or one local expert index) and the entries it yields."""

    entries: list[PlanEntry]
    assemblies: list[_Assembly]
    source: str | None  # the local parameter's global name; None where this rank holds no shard
    sharded_over_tp: bool
    expert: bool

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.alias_of is None)


@dataclass(kw_only=True, slots=True)
class _Bucket:
    """Consecutive ops of one pipeline stage and one gather group whose gathers are issued together.

    Buckets hold whole layers (a layer's ops never straddle two buckets), so the sequence of
    buffer requests is the same for every bucket of the same shape and cached buffers are
    shared between them. Buffers are keyed by the op's position in its bucket (``slot``).
    """

    ops: list[_Op]
    expert: bool
    pp_rank: int
    gathers: int  # gathers this rank issues for the bucket (decides whether to coalesce)


@dataclass(kw_only=True, slots=True)
class _Groups:
    tp: Any
    ep: Any
    pp: Any
    tp_size: int
    ep_size: int
    pp_size: int
    pp_rank: int
    ep_rank: int
    tp_rank: int


DEFAULT_BUCKET_BYTES = 512 << 20

ShardSource = Callable[[str, PlanEntry, Any, "ExportBuffers"], torch.Tensor]
"""``source(name, entry, slot, buffers)``: this rank's local shard of parameter ``name`` as the
export of plan entry ``entry`` (the first entry the parameter yields) reads it. Called once per
export for each parameter this rank holds, inside its bucket; a source that has to build the
shard (dequantize, copy) writes it into ``buffers`` under ``slot`` so that shards of one bucket
never share memory."""


def plain_shards(params: dict[str, torch.Tensor]) -> ShardSource:
    """The parameters themselves (views and gathers read them in place)."""
    return lambda name, entry, slot, buffers: params[name]


@dataclass(kw_only=True)
class PlanExporter:
    """Executes a plan for one model on this rank. Built once per (bridge, model); reused.

    ``bucket_bytes``: the gathers of consecutive whole layers, up to this many output bytes, are
    issued as one coalesced NCCL group (one launch instead of one per parameter); 0 coalesces
    only one parameter's gathers (q, k, v or gate, up). Larger buckets keep more gathered
    layers alive at once (cached buffers grow with the bucket). gloo runs the same gathers one
    by one.
    """

    plan: ExportPlan
    params: dict[str, torch.Tensor]  # global Megatron name -> local parameter (owned ones only)
    device: torch.device
    shards: ShardSource | None = None  # how to read a local shard; default: the parameter itself
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    _ops: list[_Op] = field(default_factory=list)
    _indices: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._aliased = {e.alias_of for e in self.plan.entries if e.alias_of is not None}
        self._groups = _current_groups()
        self._ops = _build_ops(self.plan, self.params, self._groups)
        if self.shards is None:
            self.shards = plain_shards(self.params)
        self._buckets_for: dict[tuple[int, int | None], tuple[list[_Bucket], Any]] = {}

    def _buckets(self, sizes: Mapping[str, int] | None = None) -> list[_Bucket]:
        key = (self.bucket_bytes, None if sizes is None else id(sizes))
        cached = self._buckets_for.get(key)
        if cached is None:
            # the sizes are kept with the buckets built from them, so their id stays theirs
            cached = self._buckets_for[key] = (_build_buckets(self._ops, self.bucket_bytes, self._groups, sizes), sizes)
        return cached[0]

    def export(self, buffers: ExportBuffers, *, cpu: bool = False, show_progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every plan entry (collective: every rank, to the end)."""
        for bucket in self.export_buckets(buffers, show_progress=show_progress):
            for name, tensor in bucket:
                yield name, (tensor.cpu() if cpu else tensor)

    def export_buckets(
        self, buffers: ExportBuffers, *, show_progress: bool = False, select_rows_lazily: bool = False,
        bucket_sizes: Mapping[str, int] | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor | RowSelection]]]:
        """Yield the ``(hf_name, tensor)`` pairs of one bucket at a time, in plan order.

        Collective like ``export``. The tensors of a bucket are all valid together, until the
        next bucket is requested (a transform can then work on a whole bucket at once: the FP8
        quantizer runs one kernel per bucket). With ``select_rows_lazily``, a tensor that would
        be copied row run by row run out of one local tensor (``index`` assemblies: q, k, v of
        grouped-query attention without tensor parallelism) is yielded as a ``RowSelection``
        (not where it is broadcast to other pipeline stages or aliased); the caller
        materializes what it does not read by rows. ``bucket_sizes``: bytes each HF tensor counts
        for towards ``bucket_bytes`` (default: its plan entry's); a transform that yields another
        dtype (the FP8 export) sizes buckets by what it yields. The same mapping object must be
        passed on every rank and every export (buckets are built once per mapping).
        """
        progress = _progress(len(self.plan.entries), show_progress)
        yielded: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for bucket in self._buckets(bucket_sizes):
                assembled = self._assemble_bucket(bucket, buffers)
                items: list[tuple[str, torch.Tensor]] = []
                for slot, op in enumerate(bucket.ops):
                    for index, entry in enumerate(op.entries):
                        if entry.alias_of is not None:
                            tensor = yielded.pop(entry.alias_of)
                        else:
                            tensor = assembled[slot][index] if assembled[slot] else None
                            if isinstance(tensor, RowSelection) and (
                                not select_rows_lazily or self._groups.pp_size > 1 or entry.hf_name in self._aliased
                            ):
                                tensor = tensor.materialize()
                            if self._groups.pp_size > 1:
                                tensor = self._broadcast_from_stage(entry, tensor, (slot, index), buffers)
                            if entry.hf_name in self._aliased:
                                yielded[entry.hf_name] = tensor
                        items.append((entry.hf_name, tensor))
                yield items
                progress.update(len(items))
        progress.close()

    def _assemble_bucket(self, bucket: _Bucket, buffers: ExportBuffers) -> list[list[torch.Tensor] | None]:
        """Gather every op of ``bucket`` this stage owns (one coalesced group), then build the
        HF tensors from the gathered shards; ``None`` for ops of other stages."""
        owned = bucket.pp_rank == self._groups.pp_rank
        if not owned:
            return [None] * len(bucket.ops)
        group = self._groups.ep if bucket.expert else self._groups.tp
        gathered: list[dict] = []
        with self._coalesced(group, bucket.gathers):
            for slot, op in enumerate(bucket.ops):
                gathered.append(self._launch_gathers(op, slot, buffers) if op.source is not None else {})
        return [
            self._assemble(op, slot, gathered[slot], buffers) if op.source is not None else None
            for slot, op in enumerate(bucket.ops)
        ]

    def _coalesced(self, group: Any, count: int):
        """One NCCL group for the gathers issued in the block (a no-op on gloo or for one gather)."""
        if count < 2 or dist.get_backend(group) != "nccl":
            return contextlib.nullcontext()
        return dist._coalescing_manager(group=group, device=self.device)

    def _launch_gathers(self, op: _Op, slot: int, buffers: ExportBuffers) -> dict:
        """Issue ``op``'s gathers: row gathers straight into outputs, or whole shards."""
        groups = self._groups
        local = self.shards(op.source, op.entries[0], slot, buffers).detach()
        if op.expert:
            return {"whole": _gather(local, groups.ep, groups.ep_size, buffers, "ep_gather", slot)}
        launched: dict = {"local": local}
        for i, assembly in enumerate(op.assemblies):
            if assembly.how == "gather_rows":
                launched[i] = self._gather_rows(op.entries[i], assembly, local, buffers, (slot, i))
        if op.sharded_over_tp and any(a.how == "pieces" for a in op.assemblies):
            launched["whole"] = _gather(local, groups.tp, groups.tp_size, buffers, "tp_gather", slot)
        return launched

    def _assemble(self, op: _Op, slot: int, launched: dict, buffers: ExportBuffers) -> list[torch.Tensor]:
        if op.expert:
            whole = launched["whole"]
            return [
                self._from_pieces(entry, assembly, whole[entry.layout.owner_ep_rank].unsqueeze(0), buffers, (slot, i))
                for i, (entry, assembly) in enumerate(zip(op.entries, op.assemblies))
            ]
        outputs: list[torch.Tensor] = []
        for i, (entry, assembly) in enumerate(zip(op.entries, op.assemblies)):
            if i in launched:
                outputs.append(launched[i])
            elif assembly.how == "pieces" and op.sharded_over_tp:
                outputs.append(self._from_pieces(entry, assembly, launched["whole"], buffers, (slot, i)))
            else:
                outputs.append(self._from_pieces(entry, assembly, launched["local"].unsqueeze(0), buffers, (slot, i)))
        return outputs

    def _gather_rows(
        self, entry: PlanEntry, assembly: _Assembly, local: torch.Tensor, buffers: ExportBuffers, index: tuple
    ) -> torch.Tensor:
        if assembly.rows is None:
            packed = local.narrow(0, assembly.start, assembly.length)
        else:
            rows = self._device_rows(entry, assembly)
            packed = buffers.get("pack", index, (rows.numel(), *local.shape[1:]), local.dtype, local.device)
            torch.index_select(local, 0, rows, out=packed)
        out = buffers.get("out", index, entry.shape, local.dtype, local.device)
        _gather_into(out, packed, self._groups.tp, self._groups.tp_size)
        return out

    def _from_pieces(
        self, entry: PlanEntry, assembly: _Assembly, gathered: torch.Tensor, buffers: ExportBuffers, index: tuple
    ) -> torch.Tensor:
        """Build the HF tensor from ``gathered`` [ranks, *local_shape] as ``assembly`` says."""
        if assembly.how == "view":
            flat = gathered.reshape(-1, *gathered.shape[2:])
            return flat.narrow(0, assembly.start, assembly.length)
        if assembly.how == "index":
            flat = gathered.reshape(-1, *gathered.shape[2:])
            return RowSelection(flat, assembly.spans, entry.shape, lambda: torch.index_select(
                flat, 0, self._device_rows(entry, assembly),
                out=buffers.get("out", index, entry.shape, gathered.dtype, gathered.device),
            ))
        out = buffers.get("out", index, entry.shape, gathered.dtype, gathered.device)
        for rank, copy in assembly.pieces:
            out.narrow(copy.dim, copy.hf_start, copy.length).copy_(
                gathered[rank].narrow(copy.dim, copy.local_start, copy.length)
            )
        return out

    def _device_rows(self, entry: PlanEntry, assembly: _Assembly) -> torch.Tensor:
        key = (entry.hf_name, str(self.device))
        rows = self._indices.get(key)
        if rows is None:
            rows = self._indices[key] = assembly.rows.to(self.device)
        return rows

    def _broadcast_from_stage(
        self, entry: PlanEntry, tensor: torch.Tensor | None, index: tuple, buffers: ExportBuffers
    ) -> torch.Tensor:
        groups = self._groups
        if tensor is None:
            tensor = buffers.get("recv", index, entry.shape, entry.torch_dtype, self.device)
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        source = dist.get_global_rank(groups.pp, entry.pp_rank)
        dist.broadcast(_wire_view(tensor), src=source, group=groups.pp)
        return tensor


def _gather_count(op: _Op, groups: _Groups) -> int:
    """How many gathers ``op`` issues on this rank (to decide whether coalescing is worth it)."""
    if op.source is None:
        return 0
    if op.expert:
        return int(groups.ep_size > 1)
    rows = sum(a.how == "gather_rows" for a in op.assemblies)
    return rows + int(op.sharded_over_tp and any(a.how == "pieces" for a in op.assemblies))


def _build_buckets(ops: list[_Op], bucket_bytes: int, groups: _Groups, sizes: Mapping[str, int] | None = None) -> list[_Bucket]:
    """Pack consecutive whole layers of one stage and gather group into buckets of at most
    ``bucket_bytes`` output bytes (a layer larger than that is a bucket of its own), counting each
    HF tensor as ``sizes`` says (default: its plan entry's bytes); with ``bucket_bytes <= 0``, one
    bucket per op. The same on every rank: it reads only the plan (and ``sizes``).

    The first bucket of each stage and gather group that holds a layer closes after that layer
    (as DDP's first gradient bucket is small): the device's first gathers or kernels wait only
    for one layer's host work (for the FP8 export of the Qwen3-8B shape at TP=1, the first
    kernel launch comes one layer's assembly earlier)."""
    if bucket_bytes <= 0:
        groupings = [[op] for op in ops]
    else:
        groupings, pending_bytes, closed, started = [], 0, False, set()
        for unit in _layer_units(ops):
            unit_bytes = sum(_op_bytes(op, sizes) for op in unit)
            kind = _unit_kind(unit)
            if groupings and not closed and kind == _unit_kind(groupings[-1]) and pending_bytes + unit_bytes <= bucket_bytes:
                groupings[-1].extend(unit)
                pending_bytes += unit_bytes
            else:
                groupings.append(list(unit))
                pending_bytes = unit_bytes
            closed = isinstance(_layer_of(unit[0].entries[0].megatron_param), int) and kind not in started
            if closed:
                started.add(kind)
    return [
        _Bucket(ops=bucket, expert=bucket[0].expert, pp_rank=bucket[0].entries[0].pp_rank,
                gathers=sum(_gather_count(op, groups) for op in bucket))
        for bucket in groupings
    ]


def _op_bytes(op: _Op, sizes: Mapping[str, int] | None) -> int:
    if sizes is None:
        return op.nbytes
    return sum(sizes.get(e.hf_name, e.nbytes) for e in op.entries if e.alias_of is None)


def _layer_units(ops: list[_Op]) -> Iterator[list[_Op]]:
    """Runs of consecutive ops of the same layer, stage and gather group (non-layer ops alone)."""
    unit: list[_Op] = []
    for op in ops:
        if unit and _unit_key(op) != _unit_key(unit[-1]):
            yield unit
            unit = []
        unit.append(op)
    if unit:
        yield unit


def _unit_key(op: _Op) -> tuple:
    entry = op.entries[0]
    return (_layer_of(entry.megatron_param), op.expert, entry.pp_rank, entry.alias_of)


def _unit_kind(ops: list[_Op]) -> tuple:
    return (ops[0].expert, ops[0].entries[0].pp_rank)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(megatron_param: str) -> int | str:
    """The decoder layer a parameter belongs to, or its own name for non-layer parameters."""
    match = _LAYER.search(megatron_param)
    return int(match.group(1)) if match else megatron_param


def _gather(local: torch.Tensor, group: Any, size: int, buffers: ExportBuffers, role: str, index: Any) -> torch.Tensor:
    """All-gather ``local`` over ``group`` into a [size, *local.shape] buffer."""
    if size == 1:
        return local.unsqueeze(0)
    out = buffers.get(role, index, (size, *local.shape), local.dtype, local.device)
    _gather_into(out, local, group, size)
    return out


def _gather_into(out: torch.Tensor, local: torch.Tensor, group: Any, size: int) -> None:
    """All-gather ``local`` into ``out``, whose dim 0 is ``size`` rank-major copies of it."""
    local, out = _wire_view(local.contiguous()), _wire_view(out)
    if dist.get_backend(group) == "gloo":  # gloo has no all_gather_into_tensor
        dist.all_gather([part.view(local.shape) for part in out.chunk(size, dim=0)], local, group=group)
    else:
        dist.all_gather_into_tensor(out, local, group=group)


def _wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 tensors travel as bytes (gloo has no float8 types; the bits are what matter)."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def _current_groups() -> _Groups:
    from megatron.core import parallel_state as ps

    return _Groups(
        tp=ps.get_tensor_model_parallel_group(),
        ep=ps.get_expert_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
    )


def _build_ops(plan: ExportPlan, params: dict[str, torch.Tensor], groups: _Groups) -> list[_Op]:
    """Group consecutive plan entries by the parameter (or expert index) they come from."""
    experts_per_rank = _experts_per_rank(plan)
    ops: list[_Op] = []
    for entry in plan.entries:
        key = _op_key(entry)
        if ops and _op_key(ops[-1].entries[0]) == key and entry.alias_of is None:
            ops[-1].entries.append(entry)
            ops[-1].assemblies.append(_plan_assembly(entry, groups))
            continue
        source = None
        sharded = not entry.is_expert and len(entry.layout.pieces) > 1
        if entry.alias_of is None and entry.pp_rank == groups.pp_rank:
            source = entry.megatron_param if not entry.is_expert else _my_expert_param(entry, experts_per_rank, groups)
            if source not in params:
                raise KeyError(f"the plan places {source} on this rank, which does not hold it")
        ops.append(
            _Op(
                entries=[entry],
                assemblies=[_plan_assembly(entry, groups)],
                source=source,
                sharded_over_tp=sharded,
                expert=entry.is_expert,
            )
        )
    return ops


def _plan_assembly(entry: PlanEntry, groups: _Groups) -> _Assembly:
    """Choose how to build ``entry`` on this rank from its slice pieces (decided once)."""
    pieces = entry.layout.pieces
    if len(pieces) > 1 and not entry.is_expert:
        return _plan_tp_assembly(entry, groups.tp_rank)
    local_rows = entry.layout.local_shape[0]
    dim = pieces[0][0].dim
    if dim == 0:
        spans = sorted((c.hf_start, r * local_rows + c.local_start, c.length) for r, rank in enumerate(pieces) for c in rank)
        first = spans[0][1]
        if all(source == first + hf_start for hf_start, source, _ in spans):
            return _Assembly(how="view", start=first, length=entry.shape[0])
        return _Assembly(how="index", rows=_rows(spans), spans=tuple(spans))
    if len(pieces) == 1 and len(pieces[0]) == 1 and pieces[0][0].length == entry.shape[dim]:
        return _Assembly(how="view", start=0, length=entry.shape[0])
    return _Assembly(how="pieces", pieces=tuple((r, c) for r, rank in enumerate(pieces) for c in rank))


def _plan_tp_assembly(entry: PlanEntry, tp_rank: int) -> _Assembly:
    """Tensor-parallel entry: all-gather straight into the output when rank r owns HF rows
    [r*n, (r+1)*n) (column, gate/up, q/k/v); otherwise gather shards and copy pieces."""
    pieces = entry.layout.pieces
    ranks = len(pieces)
    per_rank = entry.shape[0] // ranks
    row_split = all(c.dim == 0 for rank in pieces for c in rank) and all(
        sorted((c.hf_start, c.hf_stop) for c in rank)[0][0] == r * per_rank
        and sum(c.length for c in rank) == per_rank
        and _contiguous_hf(rank)
        for r, rank in enumerate(pieces)
    )
    if not row_split:
        return _Assembly(how="pieces", pieces=tuple((r, c) for r, rank in enumerate(pieces) for c in rank))
    mine = sorted(pieces[tp_rank], key=lambda c: c.hf_start)
    spans = [(c.hf_start, c.local_start, c.length) for c in mine]
    if all(local == mine[0].local_start + hf - mine[0].hf_start for hf, local, _ in spans):
        return _Assembly(how="gather_rows", start=mine[0].local_start, length=per_rank)
    return _Assembly(how="gather_rows", rows=_rows(spans))


def _contiguous_hf(rank_pieces) -> bool:
    ordered = sorted(rank_pieces, key=lambda c: c.hf_start)
    return all(a.hf_stop == b.hf_start for a, b in zip(ordered, ordered[1:]))


def _rows(spans) -> torch.Tensor:
    return torch.cat([torch.arange(source, source + length) for _, source, length in spans])


def _op_key(entry: PlanEntry) -> tuple:
    if entry.alias_of is not None:
        return ("alias", entry.hf_name)
    if entry.is_expert:
        return ("expert", entry.layout.local_expert_index, _expert_template(entry.megatron_param))
    return ("param", entry.megatron_param)


def _expert_template(name: str) -> str:
    from mbridge_refit.plan import _with_expert_number

    return _with_expert_number(name, 0)


def _my_expert_param(entry: PlanEntry, experts_per_rank: int, groups: _Groups) -> str:
    """The global name of the parameter this EP rank holds for the entry's local expert index."""
    from mbridge_refit.plan import _with_expert_number

    return _with_expert_number(entry.megatron_param, entry.layout.local_expert_index + groups.ep_rank * experts_per_rank)


def _experts_per_rank(plan: ExportPlan) -> int:
    indices = {e.layout.local_expert_index for e in plan.entries if e.is_expert}
    return max(indices) + 1 if indices else 1


def _progress(total: int, show: bool):
    if show:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="export", unit="tensor", leave=False)
    return _NoProgress()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass
