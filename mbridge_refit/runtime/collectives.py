"""Process groups the export uses, and the gathers and broadcasts it issues over them (and
``all_true``, the one agreement an export may need: whether every rank can run the plan).

``ParallelGroups`` is read once from Megatron's parallel state when an exporter is built. Gathers
write straight into caller-given buffers (``all_gather_into_tensor`` on NCCL; gloo, which lacks
it, gathers into views of the same buffer). FP8 tensors travel as bytes: gloo has no float8
types, and the bits are what matter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mbridge_refit.plan.layout import megatron_parallel_state

if TYPE_CHECKING:
    from mbridge_refit.plan.transfer import TrainerRank

__all__ = [
    "ParallelGroups",
    "RankGroups",
    "all_true",
    "broadcast_from",
    "coalesced",
    "current_groups",
    "current_rank_groups",
    "current_trainer_rank",
    "gather_into",
    "group_ranks",
    "is_rank_zero",
    "replica_participants",
    "wire_view",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelGroups:
    """This rank's model-parallel groups, sizes and ranks (as Megatron's parallel state has them)."""

    tp: Any
    ep: Any
    pp: Any
    tp_size: int
    ep_size: int
    pp_size: int
    pp_rank: int
    ep_rank: int
    tp_rank: int
    etp: Any = None  # expert tensor-parallel group (experts split within it; size 1: whole experts)
    etp_size: int = 1
    etp_rank: int = 0


def current_groups() -> ParallelGroups:
    """This rank's tensor-, expert-, expert-tensor- and pipeline-parallel groups (Megatron's parallel
    state), with each group's size and this rank's place in it."""
    from megatron.core import parallel_state as ps

    tp, ep, pp = (
        ps.get_tensor_model_parallel_group(),
        ps.get_expert_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
    )
    etp = ps.get_expert_tensor_parallel_group()
    size, rank = dist.get_world_size, dist.get_rank
    return ParallelGroups(
        tp=tp,
        ep=ep,
        pp=pp,
        tp_size=size(tp),
        ep_size=size(ep),
        pp_size=size(pp),
        tp_rank=rank(tp),
        ep_rank=rank(ep),
        pp_rank=rank(pp),
        etp=etp,
        etp_size=size(etp),
        etp_rank=rank(etp),
    )


def all_true(flag: bool, group: Any, device: torch.device) -> bool:
    """Whether ``flag`` is True on every rank of ``group`` (collective: one all-reduce of one
    integer on ``device``, a device ``group``'s backend takes)."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return bool(value.item())


def is_rank_zero() -> bool:
    """True on global rank 0, or when no process group exists."""
    return not dist.is_initialized() or dist.get_rank() == 0


def coalesced(group: Any, count: int, device: torch.device):
    """One NCCL group for the ``count`` collectives issued in the block (a no-op on gloo or for one)."""
    if count < 2 or dist.get_backend(group) != "nccl":
        return contextlib.nullcontext()
    return dist._coalescing_manager(group=group, device=device)


def gather_into(out: torch.Tensor, local: torch.Tensor, group: Any, size: int) -> None:
    """All-gather ``local`` into ``out``, whose dim 0 is ``size`` rank-major copies of it."""
    local, out = wire_view(local.contiguous()), wire_view(out)
    if dist.get_backend(group) == "gloo":  # gloo has no all_gather_into_tensor
        dist.all_gather([part.view(local.shape) for part in out.chunk(size, dim=0)], local, group=group)
    else:
        dist.all_gather_into_tensor(out, local, group=group)


def broadcast_from(tensor: torch.Tensor, group: Any, group_rank: int) -> None:
    """Broadcast ``tensor`` (in place) from ``group_rank`` of ``group``."""
    dist.broadcast(wire_view(tensor), src=dist.get_global_rank(group, group_rank), group=group)


def wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """FP8 tensors travel as bytes (gloo has no float8 types; the bits are what matter)."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class RankGroups:
    """One rank's data-parallel replica index and the ranks of the groups its export uses."""

    rank: int
    replica: int  # data-parallel rank (context-parallel ranks of a replica share its index)
    groups: tuple[tuple[int, ...], ...]  # tensor-, pipeline-, expert- and expert-tensor-parallel group ranks


def current_rank_groups() -> RankGroups:
    from megatron.core import parallel_state as ps

    groups = (
        ps.get_tensor_model_parallel_group(),
        ps.get_pipeline_model_parallel_group(),
        ps.get_expert_model_parallel_group(),
        ps.get_expert_tensor_parallel_group(),
    )
    return RankGroups(
        rank=dist.get_rank(),
        replica=ps.get_data_parallel_rank(),
        groups=tuple(tuple(dist.get_process_group_ranks(g)) for g in groups if g is not None),
    )


def current_trainer_rank() -> TrainerRank:
    """This rank's coordinates in the trainer's grid (Megatron's parallel state), for transfer plans."""
    from mbridge_refit.plan.transfer import TrainerRank

    ranks = megatron_parallel_state("rank", ("pp", "tp", "ep", "dp", "etp"))
    return TrainerRank(rank=dist.get_rank(), replica=ranks.pop("dp"), **ranks)


def replica_participants(everyone: list[RankGroups], replica: int) -> frozenset[int]:
    """The ranks an export by data-parallel replica ``replica`` needs: the replica's ranks and
    every rank that shares a tensor-, pipeline-, expert- or expert-tensor-parallel group with a needed rank
    (transitively: expert-parallel groups can span replicas, and a rank that joins an expert
    gather also runs its own tensor and pipeline collectives). Pure; the same on every rank."""
    needed = {r.rank for r in everyone if r.replica == replica}
    if not needed:
        raise ValueError(
            f"no rank belongs to data-parallel replica {replica} (replicas: {sorted({r.replica for r in everyone})})"
        )
    by_rank = {r.rank: r for r in everyone}
    frontier = list(needed)
    while frontier:
        for group in by_rank[frontier.pop()].groups:
            for peer in group:
                if peer not in needed:
                    needed.add(peer)
                    frontier.append(peer)
    return frozenset(needed)


def group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` in its rank order (None: the default group, every rank)."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
