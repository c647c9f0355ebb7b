"""``PlanExporter``: runs an ``ExportPlan`` on this rank, bucket by bucket, every step.

For each bucket (``schedule.build_buckets``), on the pipeline stage that owns it, every gather
of the bucket is issued in one coalesced NCCL group, then the HF tensors are built as each
entry's ``Assembly`` says (views where the HF tensor is a slice of a shard, all-gathers straight
into the output, one copy per piece otherwise); experts are gathered over the expert-parallel
group, after their expert tensor-parallel group where that splits them (a stacked expert
tensor: each local expert copied into its slot, then the slots
all-gathered into the output); each HF tensor is then broadcast from the owning stage to the
other pipeline stages. Every rank yields every tensor, in plan order (the stock export's order).
An entry with an ``elementwise_op`` is assembled into its own output buffer (never a view of a
parameter) and the op is applied there in place, on the owning stage, before any broadcast; an
entry with a ``relayout`` is assembled as it is before the relayout and copied, relaid, into an
output buffer of its own there.

Buffers (gather, output, receive) come from ``ExportBuffers``; with a persistent pool they are
allocated on the first export and reused by every later one. HF tensors that are views of a local
parameter (nothing gathered or converted: TP1, experts at EP1 and ETP1, replicated norms) are
made once and reused while they are intact (``_intact``), so the steady export of a many-expert
model does no torch work per tensor for them (``tests/test_host_work.py``); a bucket of nothing
but such views is yielded as the same pairs, stamped (``runtime.stamps``), with no Python work per
tensor. Intact means, checked every export in C-level ``map`` calls: the parameter's data is where
it was (what a stamp promises; read only where ``moves`` says an address may have changed), it is
set to what
the views were made from (``Tensor.is_set_to`` a reference kept with them: the same storage,
offset, sizes and strides; the reference holds that storage, so a new one is told apart even where
it took the old one's address after an offload emptied it), and each yielded view is
still what was made (a consumer's ``t.data = ...`` on a yielded tensor fails ``is_set_to`` against
a private alias made with it, or its dtype). Where a check fails the views are made anew from the
parameter as it is, after checking that its storage holds its data and that the views have the
plan's shapes and dtypes (``ModelChangedError`` otherwise). The parameters' dtypes and storages
are the caller's to check before each export (``LiveParams.check_in_place``: a storage emptied in
place keeps its views set to it). ``release_views`` drops every kept view (and the storages they
pin).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch

from mbridge_refit.plan.conversions import ELEMENTWISE_OPS, RELAYOUTS
from mbridge_refit.plan.entries import ExportPlan, PlanEntry
from mbridge_refit.runtime.buffers import ExportBuffers
from mbridge_refit.runtime.collectives import ParallelGroups, broadcast_from, coalesced, current_groups, gather_into
from mbridge_refit.runtime.live_params import ModelChangedError, check_readable
from mbridge_refit.runtime.progress import progress_bar
from mbridge_refit.runtime.schedule import Assembly, AssemblyKind, Bucket, Op, build_buckets, build_ops, gather_count
from mbridge_refit.runtime.selection import LiveRows, RowSelection
from mbridge_refit.runtime.stack_fill import fill_stack
from mbridge_refit.runtime.stamps import StampedBucket, new_stamp

__all__ = ["DEFAULT_BUCKET_BYTES", "PlanExporter", "ShardSource", "ops_holding", "plain_shards"]

DEFAULT_BUCKET_BYTES = 512 << 20

ShardSource = Callable[[str, PlanEntry, Any, ExportBuffers], torch.Tensor]
"""``source(name, entry, slot, buffers)``: this rank's local shard of parameter ``name`` as the
export of plan entry ``entry`` (the first entry the parameter yields) reads it. Called once per
export for each parameter this rank holds, inside its bucket; a source that has to build the
shard (dequantize, copy) writes it into ``buffers`` under ``slot`` so that shards of one bucket
never share memory."""


def plain_shards(params: Mapping[str, torch.Tensor]) -> ShardSource:
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
    # A count that changes whenever a data address of ``params`` may have changed (``LiveParams.moves``,
    # brought up to date before each export); None: kept views read their parameters' addresses every export.
    moves: Callable[[], int] | None = None
    _ops: list[Op] = field(default_factory=list)
    _indices: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._aliased = {e.alias_of for e in self.plan.entries if e.alias_of is not None}
        self._groups: ParallelGroups = current_groups()
        self._ops = build_ops(self.plan, self.params, self._groups)
        self._reads_parameters = self.shards is None  # shards are the parameters as stored
        if self.shards is None:
            self.shards = plain_shards(self.params)
        self._buckets_for: dict[tuple[int, int | None], tuple[list[Bucket], Any]] = {}
        # Ops whose HF tensors are views of their one local parameter, on this rank (no gather, no
        # conversion): their views are made once and reused while intact (``_views_of``), so a
        # steady export does no per-tensor torch work for them. Not on the meta device (no
        # ``is_set_to`` there): views are made every export.
        keeps = self.device.type != "meta"
        self._view_ops = frozenset(id(op) for op in self._ops if keeps and self._only_views(op))
        self._views: dict[int, _OpViews] = {}  # id(op) -> its kept views
        # id(bucket) -> the joined record of its view ops (``_kept_record``)
        self._bucket_views: dict[int, _KeptViews] = {}
        # needed names -> (the buckets, ops_holding of them, the buckets with nothing to leave out): a
        # consumer passes the same names every step
        self._holding: dict[frozenset[str], tuple[list[Bucket], dict[int, frozenset[int]], frozenset[int]]] = {}

    def buckets(self, sizes: Mapping[str, int] | None = None) -> list[Bucket]:
        """The buckets an export runs (built once per ``bucket_bytes`` and ``sizes`` mapping)."""
        key = (self.bucket_bytes, None if sizes is None else id(sizes))
        cached = self._buckets_for.get(key)
        if cached is None:
            # the sizes are kept with the buckets built from them, so their id stays theirs
            cached = self._buckets_for[key] = (build_buckets(self._ops, self.bucket_bytes, self._groups, sizes), sizes)
        return cached[0]

    def live_rows(self) -> dict[str, LiveRows]:
        """The plan's HF tensors that are, on this rank, rows of one local parameter read as stored:
        no gather, no pipeline broadcast, no conversion of the shard or of the values (``VIEW`` and
        ``INDEX`` assemblies of this stage's parameters, never an entry with an ``elementwise_op``, experts at expert-parallel
        and expert tensor-parallel size 1, and aliases of
        such tensors). Pure: reads no tensor data; the same names on every rank of a layout
        whose shards are the parameters themselves. Empty with pipeline parallelism (every
        stage receives the other stages' tensors) and for shards that are converted (TE FP8)."""
        if not self._reads_parameters or self._groups.pp_size > 1:
            return {}
        live: dict[str, LiveRows] = {}
        for op in self._ops:
            for entry, assembly in zip(op.entries, op.assemblies):
                if entry.alias_of is not None:
                    if entry.alias_of in live:
                        live[entry.hf_name] = live[entry.alias_of]
                    continue
                reads_local = op.source is not None and (
                    not op.expert or self._groups.ep_size == self._groups.etp_size == 1
                )
                reads_local = reads_local and entry.elementwise_op is None
                if reads_local and assembly.kind is AssemblyKind.VIEW:
                    runs = ((0, assembly.start, assembly.length),)
                elif reads_local and assembly.kind is AssemblyKind.INDEX:
                    runs = tuple(assembly.spans)
                else:
                    continue
                live[entry.hf_name] = LiveRows(parameter=self.params[op.source], runs=runs, shape=tuple(entry.shape))
        return live

    def export(
        self,
        buffers: ExportBuffers,
        *,
        cpu: bool = False,
        show_progress: bool = False,
        needed: frozenset[str] | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` for every plan entry, or those ``needed`` (collective: every
        rank, to the end; see ``export_buckets``)."""
        for bucket in self.export_buckets(buffers, show_progress=show_progress, needed=needed):
            if cpu:
                for name, tensor in bucket:
                    yield name, tensor.cpu()
            else:
                yield from bucket  # the bucket's own pairs: no tuple made or unpacked per tensor

    def export_buckets(
        self,
        buffers: ExportBuffers,
        *,
        show_progress: bool = False,
        select_rows_lazily: bool = False,
        bucket_sizes: Mapping[str, int] | None = None,
        needed: frozenset[str] | None = None,
    ) -> Iterator[list[tuple[str, torch.Tensor | RowSelection]]]:
        """Yield the ``(hf_name, tensor)`` pairs of one bucket at a time, in plan order.

        Collective like ``export``. The tensors of a bucket are all valid together, until the
        next bucket is requested (a transform can then work on a whole bucket at once: the FP8
        quantizer runs one kernel per bucket). With ``select_rows_lazily``, a tensor that would
        be copied row run by row run out of one local tensor (``INDEX`` assemblies: q, k, v of
        grouped-query attention without tensor parallelism) is yielded as a ``RowSelection``
        (not where it is broadcast to other pipeline stages or aliased); the caller
        materializes what it does not read by rows. ``bucket_sizes``: bytes each HF tensor counts
        for towards ``bucket_bytes`` (default: its plan entry's); a transform that yields another
        dtype (the FP8 export) sizes buckets by what it yields. The same mapping object must be
        passed on every rank and every export (buckets are built once per mapping). ``needed``:
        yield only these plan names, and run only the buckets that hold them (or what they
        alias); every rank of the model's groups must pass the same names (a data-parallel
        replica exporting its share of a checkpoint). Within a bucket only the ops (parameters)
        that yield a needed tensor gather anything.
        """
        buckets = self.buckets(bucket_sizes)
        run, whole = (None, frozenset()) if needed is None else self._ops_holding(buckets, needed)
        progress = progress_bar(
            len(self.plan.entries) if needed is None else len(needed), desc="export", unit="tensor", show=show_progress
        )
        yielded: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for number, bucket in enumerate(buckets):
                if run is not None and number not in run:
                    continue
                buffers.bucket = number
                slots = None if run is None else run[number]
                items = self._bucket_items(bucket, buffers, yielded, select_rows_lazily, slots)
                if needed is not None and number not in whole:
                    items = [item for item in items if item[0] in needed]
                yield items
                progress.update(len(items))
        progress.close()

    def _ops_holding(
        self, buckets: list[Bucket], needed: frozenset[str]
    ) -> tuple[dict[int, frozenset[int]], frozenset[int]]:
        """``ops_holding``, and the buckets whose running ops yield needed names only (nothing to
        leave out of them), kept per set of names (a few sets; a steady refit passes the same one
        every step)."""
        cached = self._holding.get(needed)
        if cached is None or cached[0] is not buckets:
            if len(self._holding) >= 8:
                self._holding.clear()
            run = ops_holding(buckets, needed, self.plan)
            whole = frozenset(
                number
                for number, slots in run.items()
                if all(e.hf_name in needed for slot in slots for e in buckets[number].ops[slot].entries)
            )
            cached = self._holding[needed] = (buckets, run, whole)
        return cached[1], cached[2]

    def _bucket_items(
        self,
        bucket: Bucket,
        buffers: ExportBuffers,
        yielded: dict[str, torch.Tensor],
        select_rows_lazily: bool,
        slots: frozenset[int] | None = None,
    ) -> list[tuple[str, torch.Tensor | RowSelection]]:
        """The bucket's ``(hf_name, tensor)`` pairs; with ``slots``, only those ops' (the same on every rank).
        A views-only bucket's pairs are kept with its views and yielded stamped (``runtime.stamps``):
        the same pair objects while ``_kept_record`` finds its views intact."""
        if self._groups.pp_size == 1:
            kept = self._bucket_views.get(id(bucket))
            if kept is not None and kept.items is not None and self._kept_record(bucket, slots) is kept:
                return StampedBucket(kept.items, kept.stamp)
        assembled = self._assemble_bucket(bucket, buffers, slots)
        lazy = select_rows_lazily and self._groups.pp_size == 1
        items: list[tuple[str, torch.Tensor | RowSelection]] = []
        for slot, op in enumerate(bucket.ops):
            if slots is not None and slot not in slots:
                continue
            for index, entry in enumerate(op.entries):
                if entry.alias_of is not None:
                    items.append((entry.hf_name, yielded.pop(entry.alias_of)))
                    continue
                tensor = assembled[slot][index] if assembled[slot] else None
                if isinstance(tensor, RowSelection) and (not lazy or entry.hf_name in self._aliased):
                    tensor = tensor.materialize()
                if self._groups.pp_size > 1:
                    tensor = self._broadcast_from_stage(entry, tensor, (slot, index), buffers)
                if entry.hf_name in self._aliased:
                    yielded[entry.hf_name] = tensor
                items.append((entry.hf_name, tensor))
        return self._keep_items(bucket, slots, assembled, items)

    def _keep_items(
        self, bucket: Bucket, slots: frozenset[int] | None, assembled: list, items: list
    ) -> list[tuple[str, torch.Tensor | RowSelection]]:
        """``items``, stamped and kept with the bucket's views where they are those of a views-only bucket
        just checked or made (``_assemble_bucket``) and yielding them needs nothing else: one pipeline
        stage, no alias taken or left for a later bucket, no selection to materialize."""
        kept = self._bucket_views.get(id(bucket))
        if (
            kept is None
            or not kept.whole
            or kept.assembled is not assembled
            or kept.slots != slots
            or self._groups.pp_size != 1
            or not all(isinstance(tensor, torch.Tensor) for _, tensor in items)
            or any(
                entry.alias_of is not None or entry.hf_name in self._aliased
                for slot, op in enumerate(bucket.ops)
                if slots is None or slot in slots
                for entry in op.entries
            )
        ):
            return items
        kept = self._bucket_views[id(bucket)] = kept._replace(items=tuple(items), stamp=new_stamp())
        return StampedBucket(kept.items, kept.stamp)

    def _assemble_bucket(
        self, bucket: Bucket, buffers: ExportBuffers, slots: frozenset[int] | None = None
    ) -> list[list[torch.Tensor] | None]:
        """Gather every op of ``bucket`` this stage owns (one coalesced group), then build the
        HF tensors from the gathered shards; ``None`` for ops of other stages (and ops not in
        ``slots``)."""
        if bucket.pp_rank != self._groups.pp_rank:
            return [None] * len(bucket.ops)
        kept = self._kept_record(bucket, slots)
        if kept is not None and kept.whole:
            return kept.assembled
        kept_views = kept.assembled if kept is not None else None  # the view ops' views, all intact
        runs = [op.source is not None and (slots is None or slot in slots) for slot, op in enumerate(bucket.ops)]
        views = [runs[slot] and id(op) in self._view_ops for slot, op in enumerate(bucket.ops)]
        launch = [run and not view for run, view in zip(runs, views)]
        if bucket.expert and self._groups.etp_size > 1:
            gathered = self._gather_expert_shards(bucket, launch, buffers)
        elif any(launch):
            group = self._groups.ep if bucket.expert else self._groups.tp
            gathers = (
                bucket.gathers
                if slots is None
                else sum(gather_count(op, self._groups) for op, run in zip(bucket.ops, runs) if run)
            )
            gathered = []
            with coalesced(group, gathers, self.device):
                for slot, op in enumerate(bucket.ops):
                    gathered.append(self._launch_gathers(op, slot, buffers) if launch[slot] else {})
        assembled = [
            (kept_views[slot] if kept_views is not None else self._views_of(op, slot, buffers))
            if views[slot]
            else self._assemble(op, slot, gathered[slot], buffers)
            if launch[slot]
            else None
            for slot, op in enumerate(bucket.ops)
        ]
        names = [op.source for op, view in zip(bucket.ops, views) if view]
        if names and kept_views is None:  # the view ops' records, joined: one check per bucket from now on
            records = [self._views[id(op)] for op, view in zip(bucket.ops, views) if view]
            whole = not any(launch)  # nothing gathered or built: every running op's tensors are views
            only_views = assembled if whole else [a if view else None for a, view in zip(assembled, views)]
            moves = None if self.moves is None else self.moves()
            self._bucket_views[id(bucket)] = _KeptViews.of(
                bucket, slots, operator.itemgetter(*names), records, only_views, whole, moves
            )
        return assembled

    def _kept_record(self, bucket: Bucket, slots: frozenset[int] | None) -> "_KeptViews | None":
        """The record of a bucket's view ops, while every view of them is intact (``_intact``, for the
        parameters ``params`` holds now: a replaced one is found by its name): C calls only, none of
        ``_views_of``'s per-op Python; None otherwise. The record holds the bucket, so its id is its own."""
        kept = self._bucket_views.get(id(bucket))
        if kept is None or kept.bucket is not bucket or kept.slots != slots:
            return None
        params = _parameters(self.params, kept.get)
        moves = None if self.moves is None else self.moves()
        if not (
            all(map(_is_set_to, params, kept.refs))
            and (moves == kept.moves or list(map(_data_ptr, params)) == kept.addresses)
            and all(map(_is_set_to, kept.loose, kept.loose_aliases))
            and list(map(_dtype, kept.views)) == kept.dtypes
        ):
            return None
        if moves != kept.moves:  # the addresses were read: the same as when the views were made
            kept = self._bucket_views[id(bucket)] = kept._replace(moves=moves)
        return kept

    def release_views(self) -> None:
        """Drop every kept view and its record (and so the parameter storages they pin: a storage
        swapped out by ``param.data = ...`` is freed); the next export makes them anew."""
        self._views.clear()
        self._bucket_views.clear()

    def _only_views(self, op: Op) -> bool:
        """Whether every HF tensor of ``op`` is, on this rank, a view of its one local parameter read
        as stored: no gather at this rank's group sizes, no stack, no conversion of shard or values."""
        if not self._reads_parameters or op.source is None or op.stacked or gather_count(op, self._groups):
            return False
        return all(
            assembly.kind is AssemblyKind.VIEW and entry.elementwise_op is None and entry.relayout is None
            for entry, assembly in zip(op.entries, op.assemblies)
        )

    def _views_of(self, op: Op, slot: int, buffers: ExportBuffers) -> list[torch.Tensor]:
        """``op``'s HF tensors, views of its parameter: made on the first export, reused while they are
        intact (``_intact``), made again from the parameter as it is now otherwise (a ``.data`` swap,
        an offload that re-creates or refills the storage, a consumer that rebound a yielded view)."""
        param = self.params[op.source]
        kept = self._views.get(id(op))
        if kept is not None and _intact(param, kept):
            return kept.views
        check_readable(op.source, param)
        views = self._assemble(op, slot, self._launch_gathers(op, slot, buffers), buffers)
        for entry, view in zip(op.builds, views):
            if tuple(view.shape) != tuple(entry.shape) or view.dtype != entry.torch_dtype:
                raise ModelChangedError(
                    f"parameter {op.source} ({list(param.shape)} {param.dtype}) no longer gives {entry.hf_name} as the "
                    f"export plan has it ({list(entry.shape)} {entry.dtype}; it gives {list(view.shape)} {view.dtype}): "
                    "build the plan anew for the changed model (bridge.forget_model() on every rank, then export)"
                )
        self._views[id(op)] = _OpViews.of(param, views)
        return views

    def _gather_expert_shards(self, bucket: Bucket, runs: list[bool], buffers: ExportBuffers) -> list[dict]:
        """Experts split over an expert tensor-parallel group: all-gather each local expert's shard
        over that group ([etp, *local], one coalesced group), then over the expert-parallel group
        ([ep, etp, *local], another): two phases, since the second reads what the first wrote. A
        stacked op joins each expert's shards into the whole expert before it stacks them. The
        groups are Megatron's own, as the stock export gathers over them."""
        groups = self._groups
        shards: list[list[torch.Tensor] | None] = []
        with coalesced(groups.etp, sum(len(op.sources) for op, run in zip(bucket.ops, runs) if run), self.device):
            for slot, op in enumerate(bucket.ops):
                if not runs[slot]:
                    shards.append(None)
                    continue
                locals_ = [
                    self.shards(name, op.entries[0], (slot, k), buffers).detach() for k, name in enumerate(op.sources)
                ]
                shards.append(
                    [
                        _gather(x, groups.etp, groups.etp_size, buffers, "etp_gather", (slot, k))
                        for k, x in enumerate(locals_)
                    ]
                )
        gathered: list[dict] = []
        with coalesced(groups.ep, sum(runs) if groups.ep_size > 1 else 0, self.device):
            for slot, (op, parts) in enumerate(zip(bucket.ops, shards)):
                if parts is None:
                    gathered.append({})
                elif op.stacked:
                    gathered.append(
                        {
                            "stacked": self._gather_stack(
                                op, slot, buffers, self._whole_experts(op, slot, parts, buffers)
                            )
                        }
                    )
                else:
                    gathered.append({"whole": _gather(parts[0], groups.ep, groups.ep_size, buffers, "ep_gather", slot)})
        return gathered

    def _whole_experts(
        self, op: Op, slot: int, parts: list[torch.Tensor], buffers: ExportBuffers
    ) -> list[torch.Tensor]:
        """Each local expert of a stacked op, whole, from its shards gathered over the expert-TP group."""
        stack = op.entries[0].sharding.stack
        wholes = []
        for k, shards in enumerate(parts):
            whole = buffers.get(
                "whole_expert", (slot, k), stack.whole_shape(tuple(shards.shape[1:])), shards.dtype, shards.device
            )
            stack.join_into(whole, shards)
            wholes.append(whole)
        return wholes

    def _launch_gathers(self, op: Op, slot: int, buffers: ExportBuffers) -> dict:
        """Issue ``op``'s gathers: row gathers straight into outputs, or whole shards."""
        groups = self._groups
        if op.stacked:
            return {"stacked": self._gather_stack(op, slot, buffers)}
        local = self.shards(op.source, op.entries[0], slot, buffers).detach()
        if op.expert:
            return {"whole": _gather(local, groups.ep, groups.ep_size, buffers, "ep_gather", slot)}
        launched: dict = {"local": local}
        for i, assembly in enumerate(op.assemblies):
            if assembly.kind is AssemblyKind.GATHER_ROWS:
                launched[i] = self._gather_rows(op.builds[i], assembly, local, buffers, (slot, i))
        if op.gathers_whole_shards:
            launched["whole"] = _gather(local, groups.tp, groups.tp_size, buffers, "tp_gather", slot)
        return launched

    def _assemble(self, op: Op, slot: int, launched: dict, buffers: ExportBuffers) -> list[torch.Tensor]:
        outputs = self._assemble_slices(op, slot, launched, buffers)
        for i, (entry, assembly, tensor) in enumerate(zip(op.entries, op.assemblies, outputs)):
            if entry.elementwise_op is None and entry.relayout is None:
                continue
            if assembly.kind in (AssemblyKind.VIEW, AssemblyKind.INDEX, AssemblyKind.STACK):
                raise AssertionError(f"{entry.hf_name}: a conversion on a {assembly.kind} assembly")
            if entry.elementwise_op is not None:
                ELEMENTWISE_OPS[entry.elementwise_op].export(tensor)
            if entry.relayout is not None:
                outputs[i] = buffers.get("relaid", (slot, i), entry.shape, tensor.dtype, tensor.device, entry.hf_name)
                outputs[i].copy_(RELAYOUTS[entry.relayout].export(tensor))
        return outputs

    def _assemble_slices(self, op: Op, slot: int, launched: dict, buffers: ExportBuffers) -> list[torch.Tensor]:
        if "stacked" in launched:
            return [launched["stacked"]]
        if op.expert:  # "whole": [ep, *local], or [ep, etp, *local] with expert tensor parallelism
            whole = launched["whole"]
            split = self._groups.etp_size > 1
            return [
                self._from_pieces(
                    entry,
                    assembly,
                    whole[entry.sharding.owner_ep_rank] if split else whole[entry.sharding.owner_ep_rank].unsqueeze(0),
                    buffers,
                    (slot, i),
                )
                for i, (entry, assembly) in enumerate(zip(op.entries, op.assemblies))
            ]
        outputs: list[torch.Tensor] = []
        for i, (entry, assembly) in enumerate(zip(op.builds, op.assemblies)):
            if i in launched:
                outputs.append(launched[i])
            elif assembly.kind is AssemblyKind.PIECES and op.sharded_over_tp:
                outputs.append(self._from_pieces(entry, assembly, launched["whole"], buffers, (slot, i)))
            else:
                outputs.append(self._from_pieces(entry, assembly, launched["local"].unsqueeze(0), buffers, (slot, i)))
        return outputs

    def _gather_stack(
        self, op: Op, slot: int, buffers: ExportBuffers, experts: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """``STACK``: copy each local expert into its slot of this rank's share of the stack (the
        output itself at ep 1), then all-gather the shares over the expert-parallel group into the
        output (rank k's share is slots [k*E/ep, (k+1)*E/ep): the output's k-th chunk). ``experts``:
        the local experts whole, where they are split over an expert-TP group (else read here)."""
        (entry,) = op.entries
        ep_size = self._groups.ep_size
        if experts is None:
            experts = [
                self.shards(name, entry, (slot, index), buffers).detach() for index, name in enumerate(op.sources)
            ]
        dtype, device = experts[0].dtype, experts[0].device
        out = buffers.get("out", (slot, 0), entry.shape, dtype, device, entry.hf_name)
        share = out if ep_size == 1 else buffers.get("pack", (slot, 0), (len(experts), *entry.shape[1:]), dtype, device)
        fill_stack(entry.sharding.stack, share, experts, buffers.memo)
        if ep_size > 1:
            gather_into(out, share, self._groups.ep, ep_size)
        return out

    def _gather_rows(
        self, entry: PlanEntry, assembly: Assembly, local: torch.Tensor, buffers: ExportBuffers, index: tuple
    ) -> torch.Tensor:
        if assembly.rows is None:
            packed = local.narrow(0, assembly.start, assembly.length)
        else:
            rows = self._device_rows(entry, assembly)
            packed = buffers.get("pack", index, (rows.numel(), *local.shape[1:]), local.dtype, local.device)
            torch.index_select(local, 0, rows, out=packed)
        out = buffers.get("out", index, entry.shape, local.dtype, local.device, entry.hf_name)
        gather_into(out, packed, self._groups.tp, self._groups.tp_size)
        return out

    def _from_pieces(
        self, entry: PlanEntry, assembly: Assembly, gathered: torch.Tensor, buffers: ExportBuffers, index: tuple
    ) -> torch.Tensor | RowSelection:
        """Build the HF tensor from ``gathered`` [ranks, *local_shape] as ``assembly`` says."""
        if assembly.kind is AssemblyKind.VIEW:
            flat = gathered.reshape(-1, *gathered.shape[2:])
            return flat.narrow(0, assembly.start, assembly.length)
        if assembly.kind is AssemblyKind.INDEX:
            flat = gathered.reshape(-1, *gathered.shape[2:])
            return RowSelection(
                flat,
                assembly.spans,
                entry.shape,
                lambda: torch.index_select(
                    flat,
                    0,
                    self._device_rows(entry, assembly),
                    out=buffers.get("out", index, entry.shape, gathered.dtype, gathered.device, entry.hf_name),
                ),
            )
        out = buffers.get("out", index, entry.shape, gathered.dtype, gathered.device, entry.hf_name)
        for rank, copy in assembly.pieces:
            out.narrow(copy.dim, copy.hf_start, copy.length).copy_(
                gathered[rank].narrow(copy.dim, copy.local_start, copy.length)
            )
        return out

    def _device_rows(self, entry: PlanEntry, assembly: Assembly) -> torch.Tensor:
        key = (entry.hf_name, str(self.device))
        rows = self._indices.get(key)
        if rows is None:
            rows = self._indices[key] = assembly.rows.to(self.device)
        return rows

    def _broadcast_from_stage(
        self, entry: PlanEntry, tensor: torch.Tensor | None, index: tuple, buffers: ExportBuffers
    ) -> torch.Tensor:
        if tensor is None:
            tensor = buffers.get("recv", index, entry.shape, entry.torch_dtype, self.device, entry.hf_name)
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        broadcast_from(tensor, self._groups.pp, entry.pp_rank)
        return tensor


def ops_holding(buckets: list[Bucket], needed: frozenset[str], plan: ExportPlan) -> dict[int, frozenset[int]]:
    """Bucket number -> the slots of its ops that yield a ``needed`` name or the tensor a needed
    alias repeats (buckets with none are left out). Pure: the same on every rank. Raises
    ``KeyError`` for a name the plan does not yield."""
    unknown = needed - {e.hf_name for e in plan.entries}
    if unknown:
        raise KeyError(f"not in the export plan: {sorted(unknown)[:5]}")
    sources = {e.alias_of for e in plan.entries if e.hf_name in needed and e.alias_of is not None}
    wanted = needed | sources
    run: dict[int, frozenset[int]] = {}
    for number, bucket in enumerate(buckets):
        slots = frozenset(slot for slot, op in enumerate(bucket.ops) if any(e.hf_name in wanted for e in op.entries))
        if slots:
            run[number] = slots
    return run


_is_set_to = torch.Tensor.is_set_to
_data_ptr = torch.Tensor.data_ptr
_dtype = operator.attrgetter("dtype")


class _OpViews(NamedTuple):
    """One view op's HF tensors, views of its parameter, and what tells they are intact (``_intact``)."""

    views: list[torch.Tensor]  # as ``_assemble`` made them: what is yielded
    ref: torch.Tensor  # what the parameter must be set to: a view among ``views`` with its layout, else an alias
    address: int  # the parameter's data_ptr when the views were made (a stamp promises the same addresses)
    loose: tuple[torch.Tensor, ...]  # the views other than ``ref``
    loose_aliases: tuple[torch.Tensor, ...]  # private aliases of those, made with them
    dtypes: list[torch.dtype]  # every view's dtype

    @classmethod
    def of(cls, param: torch.Tensor, views: list[torch.Tensor]) -> "_OpViews":
        """The record of ``views``, just made from ``param``. A view with the parameter's own layout
        (the whole parameter) is the parameter's reference: one ``is_set_to`` checks both; the
        other references are private aliases (``detach``: the same storage, never yielded)."""
        whole = next((view for view in views if param.is_set_to(view)), None)
        ref = whole if whole is not None else param.detach()
        loose = tuple(view for view in views if view is not whole)
        aliases = tuple(view.detach() for view in loose)
        return cls(views, ref, param.data_ptr(), loose, aliases, list(map(_dtype, views)))


def _intact(param: torch.Tensor, kept: _OpViews) -> bool:
    """Whether ``kept``'s views still show ``param`` as it is, unchanged by anyone (module docstring)."""
    return (
        param.is_set_to(kept.ref)
        and param.data_ptr() == kept.address
        and all(map(_is_set_to, kept.loose, kept.loose_aliases))
        and list(map(_dtype, kept.views)) == kept.dtypes
    )


class _KeptViews(NamedTuple):
    """A bucket's view ops' views and what tells they are intact (``PlanExporter._kept_record``): their
    ``_OpViews`` records, joined so that one ``map`` per check covers the bucket."""

    bucket: Bucket  # held, so the id it is kept under stays its own
    slots: frozenset[int] | None  # the ops that ran
    get: operator.itemgetter  # the running ops' parameters, from the exporter's ``params`` by name
    refs: tuple[torch.Tensor, ...]  # per parameter, its ``_OpViews.ref``
    addresses: list[int]  # per parameter, where its data was
    moves: int | None  # ``PlanExporter.moves()`` when the addresses were last found so
    loose: tuple[torch.Tensor, ...]  # the ops' ``loose`` views, joined
    loose_aliases: tuple[torch.Tensor, ...]  # and their aliases
    views: tuple[torch.Tensor, ...]  # every view of the bucket
    dtypes: list[torch.dtype]  # and its dtype
    assembled: list  # per slot, the op's views (None for an op that is no view op or did not run)
    whole: bool  # every running op is a view op: ``assembled`` is what ``_assemble_bucket`` returns
    items: tuple | None  # a whole bucket's (hf_name, view) pairs, once yielded (``_keep_items``)
    stamp: int | None  # their stamp (``runtime.stamps``)

    @classmethod
    def of(
        cls,
        bucket: Bucket,
        slots: frozenset[int] | None,
        get: operator.itemgetter,
        records: list[_OpViews],
        assembled: list,
        whole: bool,
        moves: int | None,
    ) -> "_KeptViews":
        return cls(
            bucket,
            slots,
            get,
            tuple(r.ref for r in records),
            [r.address for r in records],
            moves,
            tuple(v for r in records for v in r.loose),
            tuple(a for r in records for a in r.loose_aliases),
            tuple(v for r in records for v in r.views),
            [d for r in records for d in r.dtypes],
            assembled,
            whole,
            None,
            None,
        )


def _parameters(params: dict[str, torch.Tensor], get: operator.itemgetter) -> tuple[torch.Tensor, ...]:
    """The parameters ``get`` names, as a tuple (an itemgetter of one name returns the item itself)."""
    found = get(params)
    return found if isinstance(found, tuple) else (found,)


def _gather(local: torch.Tensor, group: Any, size: int, buffers: ExportBuffers, role: str, index: Any) -> torch.Tensor:
    """All-gather ``local`` over ``group`` into a [size, *local.shape] buffer."""
    if size == 1:
        return local.unsqueeze(0)
    out = buffers.get(role, index, (size, *local.shape), local.dtype, local.device)
    gather_into(out, local, group, size)
    return out
