"""The group a packed broadcast runs over: a torch.distributed group, or a group of its own joined by address.

The packed broadcast (``sinks.packed_broadcast``) needs five things of its group: whether this
process is the source, ``broadcast`` (also asynchronous), ``all_reduce`` (MAX/MIN), and
``broadcast_object`` (the failure path only: the plan's signature and an error message, JSON data).
``BroadcastGroup`` names them; two kinds provide them:

* ``TorchGroup``: a group of this process's ``torch.distributed`` world (``new_group``); ``src`` is a
  global rank, as ``torch.distributed`` has it.
* ``StoreGroup``: a process group of its own, made from a ``TCPStore`` at ``host:port`` that its
  members join by address (``src`` is a rank of this group). Its members need not share a
  ``torch.distributed`` world: a trainer rank and the workers of an inference engine on other
  GPUs (each with a world of its own) form one, which is what a refit into a separately launched
  engine needs. NCCL on CUDA (one GPU per member), gloo otherwise. vLLM's weight transfer builds
  the same thing from its ``StatelessProcessGroup``; this one is plain torch, so the trainer side
  needs no engine package.

Rank 0 of a ``StoreGroup`` hosts the store; every member passes the same ``host``, ``port`` and
``world_size``, and construction returns once all of them have joined (or raises after
``timeout``). Every collective is bounded by the same ``timeout``; ``close`` releases the
communicators (checked with NCCL on an H100 with one member: two on one GPU are refused by NCCL).
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


@runtime_checkable
class BroadcastGroup(Protocol):
    """What a packed broadcast runs over (module docstring). ``src`` means what the group says."""

    def is_member(self) -> bool: ...

    def is_source(self, src: int) -> bool: ...

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any: ...

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None: ...

    def broadcast_object(self, obj: Any, src: int, device: torch.device) -> Any: ...


class TorchGroup:
    """A ``torch.distributed`` group (``None``: the default group); ``src`` is a global rank."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def is_member(self) -> bool:
        return dist.get_rank(self.group) >= 0

    def is_source(self, src: int) -> bool:
        return dist.get_rank() == src

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        return dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        dist.all_reduce(tensor, op=op, group=self.group)

    def broadcast_object(self, obj: Any, src: int, device: torch.device) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, group=self.group, device=device if device.type == "cuda" else None)
        return holder[0]


class StoreGroup:
    """A process group of its own, joined by address (module docstring); ``src`` is a rank of it.

    Args:
        host, port: the store's address; rank 0 listens there, the others connect.
        rank, world_size: this member's rank and the number of members.
        device: the device its tensors live on; NCCL when it is CUDA (set it as the current device
            first), gloo otherwise (``backend`` overrides: gloo also carries CUDA tensors, through host
            memory, e.g. for two members on one GPU, which NCCL refuses).
        timeout: bounds the join and every collective.
    """

    def __init__(
        self, *, host: str, port: int, rank: int, world_size: int, device: torch.device | str,
        backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a member of a group of {world_size}: ranks are 0..{world_size - 1}")
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.process_group = _process_group(self.backend, self.store, rank, world_size, timeout)

    def is_member(self) -> bool:
        return True

    def is_source(self, src: int) -> bool:
        return self.rank == src

    def close(self) -> None:
        """Release the group's communicators (NCCL's hold GPU memory until then); call once, on
        every member, after its last collective."""
        shutdown = getattr(self.process_group, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = src, 0
        work = self.process_group.broadcast([tensor], options)
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.process_group.allreduce([tensor], options).wait()

    def broadcast_object(self, obj: Any, src: int, device: torch.device) -> Any:
        """``obj`` of ``src`` (JSON data: a member joined by address may be another program, so
        what arrives is parsed, never unpickled; tuples arrive as lists)."""
        payload = json.dumps(obj).encode() if self.rank == src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self.broadcast(size, src)
        data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        if self.rank == src:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.broadcast(data, src)
        return obj if self.rank == src else json.loads(data.cpu().numpy().tobytes())


def _process_group(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"backend {backend!r} is not supported: use 'nccl' (CUDA) or 'gloo'")


def as_broadcast_group(group: Any) -> BroadcastGroup:
    """``group`` as a ``BroadcastGroup``: itself if it is one, else a ``TorchGroup`` around it."""
    return group if isinstance(group, BroadcastGroup) else TorchGroup(group)
