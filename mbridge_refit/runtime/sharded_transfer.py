"""Running a transfer plan: each engine rank receives only its shards, straight from the trainer's
parameters, with batched point-to-point sends and local copies.

``ShardedTransfer`` is built on every rank of the job that takes part (trainer ranks that send,
engine ranks that receive, most often the same ranks) from the same ``TransferPlan``
(``plan.transfer``). Per ``run(shards)``, on every member of ``group``, in this order:

1. handshake: one ``all_gather`` of int64 ``[plan fingerprint, status]``, the wire version
   (``WIRE_VERSION``) folded into both words and the rank's ``checksum`` setting into the status
   (``_versioned``: version 1, before versions were sent, folds nothing, so the frame is the same for
   every install); a rank that runs another wire version (another install of this package: named as
   ``errors.wire_version_mismatch`` words it), holds another plan, passes another ``checksum`` (its
   peers would wait for sums it never sends, or it for theirs), or whose shards or parameters do not
   fit the plan (checked locally first), makes every member raise ``TransferMismatchError`` naming the
   ranks (an install of version 1 sees another plan and a bad status), before any data moves. On the
   first run, every region that several trainer ranks send whole (norms and routers the engine
   replicates) is compared by checksum across them (``runtime.replica_agreement``, under the same
   version): copies that differ raise ``ReplicaMismatchError`` on every rank, as engine ranks would
   hold different ones;
2. for each peer, the parts it must receive are packed back to back (16-byte aligned) into one
   cached send buffer; all sends and receives are posted together (``batch_isend_irecv``, one
   NCCL group), the local parts are copied meanwhile, then received parts are unpacked into the
   shards. With ``checksum=True`` each buffer's int64 word sum travels after it;
3. status: one ``all_gather`` of int64 ``[status]``, so a checksum failure on one rank raises
   ``TransferChecksumError`` on every rank (nobody is left waiting).

The handshake is each run's first collective over ``group``, so an NCCL communicator exists
before the point-to-point group is issued (``batch_isend_irecv`` needs every rank of a new
communicator in its first call). Buffers are allocated on the first run and reused: a
steady-state run allocates nothing (the caller owns the engine shards; ``allocate_shards`` makes
a set once). Parameter and shard tensors are read and written only inside ``run``; the trainer
must not update its parameters while a run is in flight on any rank. Built by
``RefitBridge.sharded_transfer``, each run first looks the parameters up again through the bridge
(``current_params``), so a parameter object the model replaced is read, not the old one (a
``param.data`` swap is followed by the copies' key).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.errors import TransportError, wire_version_mismatch
from mbridge_refit.plan.engine_layout import Box
from mbridge_refit.plan.transfer import Move, TransferPlan
from mbridge_refit.runtime.collectives import group_ranks
from mbridge_refit.runtime.live_params import params_device
from mbridge_refit.runtime.param_sync import finish_pending_param_gathers
from mbridge_refit.runtime.replica_agreement import check_replicas, replicated_regions

__all__ = [
    "ALIGN_BYTES",
    "WIRE_VERSION",
    "ShardedTransfer",
    "TransferChecksumError",
    "TransferMismatchError",
    "TransferStats",
]

ALIGN_BYTES = 16
# What the ranks exchange beyond the plan: the handshake's words, the packing, the checksum and the
# replica check's. 3: the handshake carries each rank's checksum setting; 2: sums of 8-byte words; 1: the
# install before versions were sent. Ranks of different versions refuse in the handshake instead of
# reading as a checksum failure; the handshake's frame is the same for every version.
WIRE_VERSION = 3
_WIRE_FORMAT = "sharded transfer"
_OK, _BAD_INPUT, _BAD_CHECKSUM = 0, 1, 2


class TransferMismatchError(TransportError):
    """The ranks do not agree on the transfer plan, or a rank's tensors do not fit it."""


class TransferChecksumError(TransportError):
    """Bytes received in a sharded transfer differ from the bytes sent."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Packed:
    move: Move
    offset: int


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferStats:
    """What one run moved on this rank."""

    sent_bytes: int
    received_bytes: int
    local_bytes: int
    peers: int


class ShardedTransfer:
    """Runs ``plan`` on this rank (module docstring for the protocol).

    ``params``: this rank's local Megatron parameters by global name (empty on a rank that only
    receives). ``chunks``: the model, whose deferred DDP parameter gathers each run completes
    first (``RefitBridge.sharded_transfer`` passes it). ``group``: every rank that sends or receives (default: the whole job); it must
    hold every rank the plan names. ``device``: where the buffers live (the parameters' device).
    ``check_replicas``: compare the copies of tensors several ranks send on the first run (module
    docstring); every rank of ``group`` must pass the same value.
    """

    def __init__(
        self,
        plan: TransferPlan,
        *,
        params: Mapping[str, torch.Tensor],
        group: Any = None,
        device: torch.device | None = None,
        checksum: bool = False,
        chunks: list[torch.nn.Module] | None = None,
        check_replicas: bool = True,
        current_params: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        self.plan = plan
        self.params = params
        self._current_params = current_params
        self.group = group
        self.rank = dist.get_rank()
        self.device = device or params_device(params)
        self.checksum = checksum
        self.chunks = chunks or []
        self.sends = _packed(plan.moves, self.rank, outgoing=True)
        self.receives = _packed(plan.moves, self.rank, outgoing=False)
        self.local = [m for m in plan.moves if m.is_local and m.source_rank == self.rank]
        self.fingerprint = plan.fingerprint  # hashing the plan costs milliseconds: once
        self.wire_version = WIRE_VERSION
        self._shards_here = [(s.hf_name, s.shape, getattr(torch, s.dtype)) for s in plan.shards_on(self.rank)]
        self._param_problem = self._params_problem()
        self._stats = TransferStats(
            sent_bytes=sum(p.move.nbytes for parts in self.sends.values() for p in parts),
            received_bytes=sum(p.move.nbytes for parts in self.receives.values() for p in parts),
            local_bytes=sum(m.nbytes for m in self.local),
            peers=len(set(self.sends) | set(self.receives)),
        )
        self._copies: tuple[tuple, _Copies] | None = None
        self._send_buffers: dict[int, torch.Tensor] = {}
        self._receive_buffers: dict[int, torch.Tensor] = {}
        self._sums = torch.zeros(len(self.sends) + len(self.receives), dtype=torch.int64, device=self.device)
        self._local_sum = torch.zeros((), dtype=torch.int64, device=self.device)
        self._control = _Control(dist.get_world_size(group), self.device)
        self._replicas = replicated_regions(plan) if check_replicas else []
        self._replicas_agree = not self._replicas  # checked on the first run that gets past the handshake

    # --- the engine side's tensors ---------------------------------------------------------------

    def allocate_shards(self, device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Empty engine shards for this rank (hf_name -> tensor of the shard's shape), to be
        allocated once and passed to every ``run``."""
        return {
            s.hf_name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device or self.device)
            for s in self.plan.shards_on(self.rank)
        }

    def buffer_pointers(self) -> list[int]:
        """Addresses of the cached send and receive buffers (a steady state keeps them)."""
        return [b.data_ptr() for b in [*self._send_buffers.values(), *self._receive_buffers.values()]]

    # --- one refit -----------------------------------------------------------------------------

    def run(self, shards: Mapping[str, torch.Tensor]) -> TransferStats:
        """Deliver this rank's shards (collective over ``group``; see the module docstring)."""
        self._handshake(self._follow_params() or self._param_problem or self._shards_problem(shards))
        finish_pending_param_gathers(self.chunks)  # the weights of the last optimizer step
        if not self._replicas_agree:
            check_replicas(self._replicas, self.params, group=self.group, device=self.device)
            self._replicas_agree = True
        self._ensure_buffers()
        copies = self._views(shards)
        _copy_all(copies.pack)
        works = self._post()
        _copy_all(copies.local)
        for work in works:
            work.wait()
        bad = self._bad_checksums()
        if not bad:
            _copy_all(copies.unpack)
        self._share_status(bad)
        return self._stats

    def _follow_params(self) -> str | None:
        """Look the parameters up again (``current_params``: the bridge's, which swaps in parameter objects the
        model replaced since the last look, one integer comparison when it replaced none); what stops this
        rank, for the handshake (a parameter replaced by one of another shape, a bridge that forgot the
        model), or None. With ``current_params`` a ``params`` assigned to the transfer is replaced by the
        bridge's at the next run (build the transfer with ``current_params=None`` to keep one)."""
        if self._current_params is None:
            return None
        try:
            params = self._current_params()
        except Exception as err:  # e.g. runtime.live_params.ModelChangedError: every rank hears it, none waits
            return f"{type(err).__name__}: {err}"
        if params is not self.params:
            self.params = params
            self._param_problem = self._params_problem()
        return None

    def _shards_problem(self, shards: Mapping[str, torch.Tensor]) -> str | None:
        for name, shape, dtype in self._shards_here:
            tensor = shards.get(name)
            if tensor is None or tensor.shape != shape or tensor.dtype != dtype:
                found = "missing" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"
                return f"engine shard {name}: the plan needs {shape} {dtype}, got {found}"
        return None

    def _params_problem(self) -> str | None:
        for move in [*self.local, *(p.move for parts in self.sends.values() for p in parts)]:
            param = self.params.get(move.megatron_param)
            if param is None:
                return f"{move.hf_name}: this rank has no parameter {move.megatron_param} (the plan was built for another trainer layout)"
            if (
                any(stop > size for (_, stop), size in zip(move.source_box, param.shape))
                or len(move.source_box) != param.dim()
            ):
                return f"{move.hf_name}: parameter {move.megatron_param} {tuple(param.shape)} does not hold {move.source_box}"
        return None

    def _views(self, shards: Mapping[str, torch.Tensor]) -> "_Copies":
        """Every copy of a run as (destination view, source view): packing into the send buffers,
        local parts, unpacking from the receive buffers. Runs of equally spaced parts (q, k and v
        come in one part per query group) are one strided copy. Built on the first run and kept
        while the shards and parameters keep their storage."""
        key = (id(shards), *(t.data_ptr() for t in shards.values()), *(p.data_ptr() for p in self.params.values()))
        if self._copies is None or self._copies[0] != key:
            params = self.params
            self._copies = (
                key,
                _Copies(
                    pack=[
                        (
                            _slots(self._send_buffers[peer], run),
                            _strided_view(params[run[0].move.megatron_param], [p.move.source_box for p in run]),
                        )
                        for peer, parts in self.sends.items()
                        for run in _even_runs(parts)
                    ],
                    local=[
                        (
                            _strided_view(shards[run[0].hf_name], [m.shard_box for m in run]),
                            _strided_view(params[run[0].megatron_param], [m.source_box for m in run]),
                        )
                        for run in _even_runs(self.local)
                    ],
                    unpack=[
                        (
                            _strided_view(shards[run[0].move.hf_name], [p.move.shard_box for p in run]),
                            _slots(self._receive_buffers[peer], run),
                        )
                        for peer, parts in self.receives.items()
                        for run in _even_runs(parts)
                    ],
                ),
            )
        return self._copies[1]

    def _handshake(self, problem: str | None) -> None:
        status = _BAD_INPUT if problem else _OK
        rows = self._control.exchange(
            _versioned(self.wire_version, self.fingerprint, status, checksum=self.checksum), self.group
        )
        refusal = _refusal([(int(row[0]), int(row[1])) for row in rows], group_ranks(self.group), self.wire_version)
        if refusal is None:
            return
        detail = f"; here: {problem}" if problem else ""
        raise TransferMismatchError("sharded transfer refused before any data moved: " + refusal + detail)

    def _ensure_buffers(self) -> None:
        if self._send_buffers or self._receive_buffers or not (self.sends or self.receives):
            return
        for table, out in ((self.sends, self._send_buffers), (self.receives, self._receive_buffers)):
            for peer, parts in table.items():
                last = parts[-1]
                out[peer] = torch.empty(_align(last.offset + last.move.nbytes), dtype=torch.uint8, device=self.device)

    def _post(self) -> list[Any]:
        ops, sums = [], 0
        for peer, buffer in self._send_buffers.items():
            ops.append(dist.P2POp(dist.isend, buffer, peer, self.group, tag=0))
            if self.checksum:
                _word_sum(buffer, out=self._sums[sums])  # a 0-dim view: written in place
                ops.append(dist.P2POp(dist.isend, self._sums[sums : sums + 1], peer, self.group, tag=1))
                sums += 1
        for peer, buffer in self._receive_buffers.items():
            ops.append(dist.P2POp(dist.irecv, buffer, peer, self.group, tag=0))
            if self.checksum:
                ops.append(dist.P2POp(dist.irecv, self._received_sum(peer), peer, self.group, tag=1))
        return dist.batch_isend_irecv(ops) if ops else []

    def _received_sum(self, peer: int) -> torch.Tensor:
        index = len(self.sends) + list(self._receive_buffers).index(peer)
        return self._sums[index : index + 1]

    def _bad_checksums(self) -> list[int]:
        if not self.checksum:
            return []
        bad = []
        for peer, buffer in self._receive_buffers.items():
            _word_sum(buffer, out=self._local_sum)
            if int(self._local_sum) != int(self._received_sum(peer)):
                bad.append(peer)
        return bad

    def _share_status(self, bad_peers: list[int]) -> None:
        everyone = self._control.exchange([_BAD_CHECKSUM if bad_peers else _OK, 0], self.group)
        failed = [rank for rank, row in zip(group_ranks(self.group), everyone) if int(row[0]) != _OK]
        if failed:
            here = f"; here, from rank(s) {bad_peers}" if bad_peers else ""
            raise TransferChecksumError(
                f"sharded transfer: rank(s) {failed} received bytes whose checksum differs from the sender's{here}; "
                "their shards were left unwritten from those peers. Retry the refit; a repeated failure points at the link or memory"
            )


def _packed(moves: tuple[Move, ...], rank: int, *, outgoing: bool) -> dict[int, list[_Packed]]:
    """Peer -> the parts exchanged with it, in plan order, at their offsets in the peer's buffer."""
    table: dict[int, list[_Packed]] = {}
    offsets: dict[int, int] = defaultdict(int)
    for move in moves:
        if move.is_local:
            continue
        mine, peer = (move.source_rank, move.target_rank) if outgoing else (move.target_rank, move.source_rank)
        if mine != rank:
            continue
        table.setdefault(peer, []).append(_Packed(move=move, offset=offsets[peer]))
        offsets[peer] = _align(offsets[peer] + move.nbytes)
    return dict(sorted(table.items()))


@dataclass(frozen=True, slots=True)
class _Copies:
    pack: list[tuple[torch.Tensor, torch.Tensor]]
    local: list[tuple[torch.Tensor, torch.Tensor]]
    unpack: list[tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for target, source in pairs:
        target.copy_(source)


def _slots(buffer: torch.Tensor, run: list[_Packed]) -> torch.Tensor:
    """The buffer bytes of a run of equally shaped parts at consecutive slots, as one typed view."""
    move = run[0].move
    first = buffer[run[0].offset : run[0].offset + move.nbytes].view(getattr(torch, move.dtype)).view(move.shape)
    if len(run) == 1:
        return first
    step = (run[1].offset - run[0].offset) // first.element_size()
    return first.as_strided((len(run), *first.shape), (step, *first.stride()), first.storage_offset())


def _view(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(start, stop) for start, stop in box)]


def _even_runs(items: list) -> list[list]:
    """Consecutive moves (or packed parts) of one tensor from one parameter, of one shape, whose
    boxes differ only in their start along dim 0, each by the same step on both sides: one
    strided copy each. Packed parts of one shape sit at equally spaced offsets already."""
    runs: list[list] = []
    for item in items:
        if runs and _continues([_move(i) for i in runs[-1][-2:]], runs[-1][0], item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _move(item) -> Move:
    return item.move if isinstance(item, _Packed) else item


def _continues(tail: list[Move], first_item, item) -> bool:
    first, move, last = _move(first_item), _move(item), tail[-1]
    if (move.hf_name, move.megatron_param, move.shape) != (first.hf_name, first.megatron_param, first.shape):
        return False
    if move.source_box[1:] != first.source_box[1:] or move.shard_box[1:] != first.shard_box[1:]:
        return False
    steps = (move.source_box[0][0] - last.source_box[0][0], move.shard_box[0][0] - last.shard_box[0][0])
    if len(tail) == 1:
        return steps[0] > 0 and steps[1] > 0
    return steps == (last.source_box[0][0] - tail[0].source_box[0][0], last.shard_box[0][0] - tail[0].shard_box[0][0])


def _strided_view(tensor: torch.Tensor, boxes: list[Box]) -> torch.Tensor:
    """``tensor[boxes[0]]`` alone, or the boxes of one even run as one view with a leading dimension."""
    first = _view(tensor, boxes[0])
    if len(boxes) == 1:
        return first
    step = (boxes[1][0][0] - boxes[0][0][0]) * tensor.stride(0)
    return first.as_strided((len(boxes), *first.shape), (step, *first.stride()), first.storage_offset())


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


_VERSION_SHIFT = 48  # the fingerprint's word: the version above it (a 64-bit hash XOR a tag)
_STATUS_BITS = 8  # the status word: the version above the status byte
_CHECKSUM_ON = 0x80  # the status byte's top bit, from version 3: the rank runs with checksum=True
_FIRST_WITH_CHECKSUM_SETTING = 3


def _versioned(version: int, fingerprint: int, status: int, *, checksum: bool = False) -> list[int]:
    """The handshake row of ``version``: version 1 (the frame before versions were sent) is the
    plain ``[fingerprint, status]``; later versions fold ``version - 1`` into both words, and from
    version 3 the checksum setting into the status byte."""
    tag = version - 1
    if checksum and version >= _FIRST_WITH_CHECKSUM_SETTING:
        status |= _CHECKSUM_ON
    return [_signed(fingerprint ^ (tag << _VERSION_SHIFT)), status | (tag << _STATUS_BITS)]


def _unversioned(word: int, status_word: int) -> tuple[int, int, int, bool | None]:
    """``(version, fingerprint, status, checksum)`` of a handshake row (``_versioned``'s inverse;
    ``checksum`` None for a version that does not send it)."""
    tag = status_word >> _STATUS_BITS
    version, status = tag + 1, status_word & ((1 << _STATUS_BITS) - 1)
    checksum = None
    if version >= _FIRST_WITH_CHECKSUM_SETTING:
        checksum, status = bool(status & _CHECKSUM_ON), status & ~_CHECKSUM_ON
    return version, _signed((word ^ (tag << _VERSION_SHIFT)) & 0xFFFF_FFFF_FFFF_FFFF), status, checksum


def _refusal(rows: list[tuple[int, int]], ranks: list[int], mine: int) -> str | None:
    """Why the handshake's ``rows`` (every rank's, in the order of ``ranks``) stop the run, or None.
    The wire version is looked at first: the rest of a row of another version means something else."""
    if len(set(rows)) == 1 and _unversioned(*rows[0])[2] == _OK:  # the usual run: every rank sent the same row
        return None
    everyone = [_unversioned(word, status_word) for word, status_word in rows]
    by_version = _ranks_by(ranks, [version for version, _, _, _ in everyone])
    if len(by_version) > 1:
        return (
            "; ".join(
                wire_version_mismatch(_WIRE_FORMAT, mine, None if version == 1 else version, f"rank(s) {peers}")
                for version, peers in by_version.items()
                if version != mine
            )
            + f" (ranks by version: {by_version})"
        )
    parts = []
    by_plan = _ranks_by(ranks, [f"{fp & 0xFFFF_FFFF_FFFF_FFFF:#018x}" for _, fp, _, _ in everyone])
    if len(by_plan) > 1:
        parts.append(f"the ranks hold different transfer plans ({by_plan})")
    by_checksum = _ranks_by(ranks, [checksum for _, _, _, checksum in everyone])
    if len(by_checksum) > 1:
        parts.append(
            f"the ranks pass different checksum= settings ({by_checksum}): a rank that sends checksums would wait "
            "for peers that never receive them; pass the same checksum= on every rank"
        )
    failed = [rank for rank, (_, _, code, _) in zip(ranks, everyone) if code != _OK]
    if failed:
        parts.append(f"rank(s) {failed} found tensors that do not fit the plan")
    if not parts:
        return None
    return "; ".join(parts) + (
        ". Build every rank's ShardedTransfer from the same TransferPlan (TransferPlan.to_json on the trainer)"
    )


def _ranks_by(ranks: list[int], values: list) -> dict:
    """``{value: the ranks that sent it}``, in the order first seen."""
    table: dict = {}
    for rank, value in zip(ranks, values):
        table.setdefault(value, []).append(rank)
    return table


def _signed(word: int) -> int:
    """A 64-bit pattern as the int64 a tensor holds."""
    word &= 0xFFFF_FFFF_FFFF_FFFF
    return word - (1 << 64) if word >= 1 << 63 else word


def _word_sum(buffer: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """The sum of the buffer's 8-byte words modulo 2**64 into ``out`` (buffers start and end on 16-byte
    boundaries). Summed in their own dtype: ``sum(dtype=int64)`` of int32 words would first copy them into
    an int64 tensor twice the buffer's size. Integer addition wraps and is associative, so sender and
    receiver agree whatever their reduction order; a single changed byte always changes the sum."""
    return torch.sum(buffer.view(torch.int64), dim=0, out=out)


class _Control:
    """The int64 rows of the handshake and the status (two words each), allocated once and
    all-gathered in place."""

    def __init__(self, world: int, device: torch.device) -> None:
        self.mine = torch.zeros(2, dtype=torch.int64, device=device)
        self.flat = torch.zeros(world * 2, dtype=torch.int64, device=device)
        self.everyone = list(self.flat.view(world, 2))

    def exchange(self, values: list[int], group: Any) -> list[torch.Tensor]:
        for i, value in enumerate(values):
            self.mine[i] = value
        if dist.get_backend(group) == "gloo":  # gloo has no all_gather_into_tensor
            dist.all_gather(self.everyone, self.mine, group=group)
        else:  # into the flat buffer: the list form would allocate a staging copy every call
            dist.all_gather_into_tensor(self.flat, self.mine, group=group)
        return self.everyone
