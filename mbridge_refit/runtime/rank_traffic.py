"""What one rank's export moves: tensors it yields, bytes it copies on its device, bytes it receives.

Pure: ``rank_traffic`` reads the plan and this rank's place in its groups (``ParallelGroups``; only
the sizes and ranks, no process group is touched) and walks the same ``Op``/``Assembly`` schedule
``PlanExporter`` runs, counting what each step of ``PlanExporter.export`` (BF16, every entry, the
parameters read as stored) does on this rank:

* every rank yields every plan entry: a tensor of another pipeline stage is broadcast from its
  stage to this one (``PlanExporter._bucket_items``), and every tensor- and expert-parallel rank
  of a stage gathers what its stage yields;
* ``local_copy_bytes``: bytes written by copies on this rank's device (packing rows for a gather,
  one copy per piece, ``index_select`` of row runs, stacking experts, a relayout's copy); a view
  of a local parameter or of a gather's output copies nothing; an elementwise op runs in place on
  an output already counted;
* ``gathered_bytes``: bytes this rank receives in tensor-, expert- and expert-tensor-parallel
  all-gathers (a gather's output less this rank's own share);
* ``broadcast_received_bytes`` / ``broadcast_sent_bytes``: the pipeline broadcasts of other stages'
  tensors into this rank / of this stage's tensors from it (one broadcast per HF tensor).

Tensors are taken as contiguous where the exporter would call ``.contiguous()`` (parameters are,
and so is every view the schedule makes of a parameter or a gather's output: rows of dim 0).
``tests/test_rank_traffic.py`` checks these counts against a real export's copies and collectives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mbridge_refit.plan.entries import ExportPlan, PlanEntry, numel
from mbridge_refit.runtime.collectives import ParallelGroups
from mbridge_refit.runtime.schedule import AssemblyKind, Op, build_ops, gather_count

__all__ = ["RankTraffic", "rank_traffic", "simulated_groups"]


@dataclass(kw_only=True)
class RankTraffic:
    """One rank's share of one export (module docstring)."""

    tensors_yielded: int = 0
    tensors_built: int = 0  # this stage's tensors, built here (aliases not counted)
    views: int = 0  # of those, views of a local parameter: no torch work in the steady state
    local_copy_bytes: int = 0
    gathered_bytes: int = 0
    broadcast_received_bytes: int = 0
    broadcast_sent_bytes: int = 0
    gathers: int = 0
    broadcasts: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def simulated_groups(*, tp: int, pp: int, ep: int, etp: int, tp_rank: int, pp_rank: int, ep_rank: int, etp_rank: int):
    """``ParallelGroups`` with sizes and ranks only (no process groups), for counting."""
    return ParallelGroups(
        tp=None,
        ep=None,
        pp=None,
        tp_size=tp,
        ep_size=ep,
        pp_size=pp,
        tp_rank=tp_rank,
        ep_rank=ep_rank,
        pp_rank=pp_rank,
        etp_size=etp,
        etp_rank=etp_rank,
    )


def rank_traffic(plan: ExportPlan, groups: ParallelGroups, params: Mapping[str, Any]) -> RankTraffic:
    """Count one export of ``plan`` on the rank ``groups`` describes; ``params``: the global names of
    the parameters the rank holds (values unused)."""
    traffic = RankTraffic()
    for op in build_ops(plan, params, groups):
        traffic.tensors_yielded += len(op.entries)
        if op.entries[0].alias_of is not None:
            continue  # the tensor it repeats, yielded again
        _count_broadcasts(op, groups, traffic)
        if op.source is None:
            continue
        traffic.tensors_built += len(op.entries)
        if _only_views(op, groups):
            traffic.views += len(op.entries)
        elif op.expert:
            _count_expert_op(op, groups, traffic)
        else:
            _count_dense_op(op, groups, traffic)
    return traffic


def _count_broadcasts(op: Op, groups: ParallelGroups, traffic: RankTraffic) -> None:
    if groups.pp_size == 1:
        return
    nbytes = sum(e.nbytes for e in op.entries)
    traffic.broadcasts += len(op.entries)
    if op.entries[0].pp_rank == groups.pp_rank:
        traffic.broadcast_sent_bytes += nbytes
    else:
        traffic.broadcast_received_bytes += nbytes


def _only_views(op: Op, groups: ParallelGroups) -> bool:
    """``PlanExporter._only_views`` for parameters read as stored."""
    if op.stacked or gather_count(op, groups):
        return False
    return all(
        a.kind is AssemblyKind.VIEW and e.elementwise_op is None and e.relayout is None
        for e, a in zip(op.entries, op.assemblies)
    )


def _local_bytes(entry: PlanEntry) -> int:
    """Bytes of the local parameter (shard) an entry is read from."""
    return numel(entry.sharding.local_shape) * entry.torch_dtype.itemsize


def _count_dense_op(op: Op, groups: ParallelGroups, traffic: RankTraffic) -> None:
    """``PlanExporter._launch_gathers`` and ``_assemble_slices`` for a tensor-parallel parameter."""
    tp = groups.tp_size
    if op.gathers_whole_shards:
        traffic.gathers += 1
        traffic.gathered_bytes += (tp - 1) * _local_bytes(op.entries[0])
    for build, assembly in zip(op.builds, op.assemblies):
        if assembly.kind is AssemblyKind.GATHER_ROWS:
            traffic.gathers += 1
            traffic.gathered_bytes += build.nbytes - build.nbytes // tp
            if assembly.rows is not None:
                traffic.local_copy_bytes += build.nbytes // tp  # the rows packed for the gather
        else:
            traffic.local_copy_bytes += _assembly_copy_bytes(build, assembly.kind)
    _count_relayouts(op, traffic)


def _count_expert_op(op: Op, groups: ParallelGroups, traffic: RankTraffic) -> None:
    """``PlanExporter._gather_expert_shards``, ``_launch_gathers`` and ``_gather_stack`` for experts."""
    ep, etp = groups.ep_size, groups.etp_size
    entry = op.entries[0]
    local = _local_bytes(entry)
    if etp > 1:  # each local expert's shard over the expert-TP group first
        traffic.gathers += len(op.sources)
        traffic.gathered_bytes += len(op.sources) * (etp - 1) * local
    whole = etp * local  # one expert of this rank, whole
    if op.stacked:
        if etp > 1:
            traffic.local_copy_bytes += len(op.sources) * whole  # each expert joined from its shards
        share = len(op.sources) * whole
        traffic.local_copy_bytes += share  # the experts copied into their slots of the stack
        if ep > 1:
            traffic.gathers += 1
            traffic.gathered_bytes += entry.nbytes - share
        return
    if ep > 1:
        traffic.gathers += 1
        traffic.gathered_bytes += (ep - 1) * whole
    for build, assembly in zip(op.builds, op.assemblies):
        traffic.local_copy_bytes += _assembly_copy_bytes(build, assembly.kind)
    _count_relayouts(op, traffic)


def _assembly_copy_bytes(build: PlanEntry, kind: AssemblyKind) -> int:
    """Bytes ``PlanExporter._from_pieces`` writes: none for a view, the tensor for the others
    (``INDEX`` is materialized: ``export`` selects rows eagerly)."""
    return 0 if kind is AssemblyKind.VIEW else build.nbytes


def _count_relayouts(op: Op, traffic: RankTraffic) -> None:
    traffic.local_copy_bytes += sum(e.nbytes for e in op.entries if e.relayout is not None)
