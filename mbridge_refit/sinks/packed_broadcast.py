"""Packed broadcast: non-colocated refit from one trainer rank to inference ranks.

Owns the wire protocol between a :class:`PackedBroadcastSender` (a :class:`WeightSink` on the
source trainer rank) and :class:`PackedBroadcastReceiver` (on each inference rank): the byte
packing of the stream (``StreamPacking``) (computed from the :class:`~mbridge_refit.plan.entries.ExportPlan` alone, so no
per-tensor metadata travels), the header/verdict handshake that makes a plan mismatch fail on
every rank instead of hanging, the rotating buffers that overlap packing with broadcasting, and
the optional per-buffer checksums.

Protocol over ``group`` (the source rank plus the receiver ranks; other trainer ranks are not
members): a ``torch.distributed`` group, or a ``runtime.broadcast_group.StoreGroup`` that members
of different worlds join by address (a trainer rank and a separately launched inference engine's
workers); ``src`` is the source's rank as the group counts ranks. In this order on every member:

1. handshake: ``broadcast`` of the source's header (int64[8]: magic, version, plan fingerprint,
   stream bytes, bucket bytes, buffers, checksum flag, entry count) from ``src``; then an
   ``all_reduce(MAX)`` of int64[2] ``[mismatch, receiver fingerprint]`` so the source learns
   the verdict too. On a mismatch the source also broadcasts its ``(name, shape, dtype)`` list
   (object broadcast) and a second ``all_reduce(MIN)`` agrees on the first differing entry;
   then every member raises :class:`PlanMismatchError`. No bulk data has moved.
2. bulk: for each bucket ``b`` of ``ceil(stream_bytes / bucket_bytes)``, ``broadcast`` of the
   bucket's bytes (the last one only as long as it is full) and, with checksums on, a
   ``broadcast`` of the source's int64 checksum of that bucket.
3. status: ``all_reduce(MAX)`` of int64[2] ``[status, bucket]``; a receiver that found a bad
   checksum or whose consumer failed still runs the remaining bulk broadcasts (discarding them)
   and reports here, so the source raises instead of blocking in a broadcast nobody receives.

Every member issues the same collectives in the same order with the same sizes in each of these
outcomes (``tests/test_broadcast_faults.py`` records them). A failure that leaves a member unable
to go on (a collective or a copy raised, the export stream ended early or differs from the plan,
the trainer's export raised) is posted to the group (``BroadcastGroup.post_error``) before the
member raises: over a ``StoreGroup`` every other member then raises ``PeerFailedError`` within
seconds instead of waiting for the group's timeout. ``settled`` on either end says whether its
protocol ended in a state every member knows (done, or a failure the protocol itself reported),
so a caller knows whether an error it meets around the protocol must be posted.

The stream packing: tensors back to back in plan order, each starting at a multiple of
:data:`ALIGN_BYTES` (so a tensor that lies inside one bucket is received as a zero-copy view of
any dtype), cut into buckets at ``bucket_bytes`` boundaries. A tensor larger than a bucket (or
straddling a boundary) simply continues in the next bucket; the receiver reassembles it in one
scratch tensor sized for the largest such tensor.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.errors import TransportError
from mbridge_refit.plan.entries import ExportPlan, PlanEntry
from mbridge_refit.runtime.broadcast_group import BroadcastGroup, as_broadcast_group
from mbridge_refit.sinks.base import WeightSink

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 * 1024**2
ALIGN_BYTES = 16
_MAGIC = 0x5042_5246  # "PBRF"
_VERSION = 1
_HEADER_FIELDS = (
    "magic",
    "version",
    "fingerprint",
    "stream_bytes",
    "bucket_bytes",
    "num_buffers",
    "checksum",
    "entries",
)
_STATUS_OK, _STATUS_CHECKSUM, _STATUS_CONSUMER = 0, 1, 2


class PlanMismatchError(TransportError):
    """Sender and receiver do not agree on the plan or the buffer configuration."""


class ChecksumError(TransportError):
    """A received buffer's checksum differs from the sender's."""


class RefitStatusError(TransportError):
    """A peer of the packed broadcast reported a failure (named in the message)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PackedBroadcastConfig:
    """Buffer sizing and integrity options of a packed broadcast (same on both sides).

    Attributes:
        bucket_bytes: size of each rotating buffer, and of each broadcast. The default,
            :data:`DEFAULT_BUCKET_BYTES` (512 MiB), is a starting point to tune, chosen because
            a broadcast of 512 MiB runs for ~10 ms on NVLink and ~25-50 ms on 100-200 Gb/s IB,
            so the fixed per-collective cost (tens of microseconds) is well under 1%, while
            ``num_buffers`` x 512 MiB (1 GiB with 2 buffers) still fits beside a trainer's model
            shard and optimizer state on an 80 GB GPU. Must be a positive multiple of
            :data:`ALIGN_BYTES`.
        num_buffers: rotating buffers per side (>= 1). With 2, packing bucket ``i+1`` overlaps
            the broadcast of bucket ``i``; more buffers only help when packing is bursty.
        checksum: compute and compare a checksum of every bucket (off by default). The checksum
            is the sum of the bucket's int32 words accumulated in int64 (plus its trailing
            bytes): one read of the bucket per side, no allocation. Memory-bound: about
            0.3-0.5 ms per GB on an H100 (3 TB/s HBM), 0.1-0.3 s per GB on one CPU core, plus
            one 8-byte broadcast per bucket. Detects any single corrupted byte and truncated or
            stale buckets; it is order-insensitive at the 4-byte-word level, so it does not
            detect two words swapped.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    num_buffers: int = 2
    checksum: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0 or self.bucket_bytes % ALIGN_BYTES:
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGN_BYTES}, got {self.bucket_bytes!r} "
                f"(e.g. {DEFAULT_BUCKET_BYTES} for 512 MiB)"
            )
        if not isinstance(self.num_buffers, int) or self.num_buffers < 1:
            raise ValueError(f"num_buffers must be an integer >= 1, got {self.num_buffers!r}")


# --- the stream packing, from the plan alone ---------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _Slot:
    """Where one plan entry lies in the byte stream."""

    index: int
    entry: PlanEntry
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamPacking:
    """Byte offsets of every plan entry and the bucket cut; identical on every rank."""

    slots: tuple[_Slot, ...]
    stream_bytes: int
    bucket_bytes: int
    fingerprint: int

    @classmethod
    def build(cls, plan: ExportPlan | str, bucket_bytes: int) -> StreamPacking:
        plan = ExportPlan.from_json(plan) if isinstance(plan, str) else plan
        slots, offset = [], 0
        for index, entry in enumerate(plan.entries):
            offset = _align(offset)
            slots.append(_Slot(index=index, entry=entry, offset=offset, nbytes=entry.nbytes))
            offset += entry.nbytes
        return cls(
            slots=tuple(slots), stream_bytes=offset, bucket_bytes=bucket_bytes, fingerprint=plan_fingerprint(plan)
        )

    @property
    def num_buckets(self) -> int:
        return -(-self.stream_bytes // self.bucket_bytes)

    def bucket_length(self, bucket: int) -> int:
        return min(self.bucket_bytes, self.stream_bytes - bucket * self.bucket_bytes)

    def names_in(self, bucket: int) -> list[str]:
        start, stop = bucket * self.bucket_bytes, (bucket + 1) * self.bucket_bytes
        return [s.entry.hf_name for s in self.slots if s.offset < stop and s.end > start]

    def max_split_bytes(self) -> int:
        """Bytes of the largest tensor that straddles a bucket boundary (the scratch size)."""
        split = [
            s.nbytes
            for s in self.slots
            if s.nbytes and s.offset // self.bucket_bytes != (s.end - 1) // self.bucket_bytes
        ]
        return max(split, default=0)


def plan_signature(plan: ExportPlan) -> list[tuple[str, tuple[int, ...], str]]:
    """What both sides must agree on: ``(hf_name, shape, dtype)`` of every entry, in order."""
    return [(e.hf_name, tuple(e.shape), e.dtype) for e in plan.entries]


def plan_fingerprint(plan: ExportPlan) -> int:
    """A signed 64-bit hash of :func:`plan_signature` (fits an int64 tensor)."""
    text = json.dumps(plan_signature(plan), separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _align(offset: int) -> int:
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


def _header(packing: StreamPacking, config: PackedBroadcastConfig) -> list[int]:
    return [
        _MAGIC,
        _VERSION,
        packing.fingerprint,
        packing.stream_bytes,
        config.bucket_bytes,
        config.num_buffers,
        int(config.checksum),
        len(packing.slots),
    ]


def checksum(data: torch.Tensor) -> torch.Tensor:
    """int64 sum of ``data``'s int32 words (trailing bytes added as bytes); ``data`` is uint8."""
    words = data.numel() // 4 * 4
    total = data[:words].view(torch.int32).sum(dtype=torch.int64)
    if words < data.numel():
        total = total + data[words:].sum(dtype=torch.int64)
    return total.reshape(1)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor`` (a copy only if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


# --- the handshake --------------------------------------------------------------------------


def _check_member(group: BroadcastGroup) -> None:
    if not group.is_member():
        raise ValueError(
            "this process is not a member of `group`; the packed-broadcast group must hold the source "
            "rank and every receiver rank (torch.distributed.new_group on all ranks, or a StoreGroup)"
        )


def _handshake(
    *,
    plan: ExportPlan,
    packing: StreamPacking,
    config: PackedBroadcastConfig,
    group: BroadcastGroup,
    src: int,
    device: torch.device,
    is_source: bool,
) -> None:
    """Step 1 of the protocol (collective over ``group``); raises PlanMismatchError on every member."""
    mine = _header(packing, config)
    header = torch.tensor(mine, dtype=torch.int64, device=device)
    group.broadcast(header, src)
    theirs = [int(v) for v in header.tolist()]
    mismatch = 0 if is_source or theirs == mine else 1
    verdict = torch.tensor(
        [mismatch, packing.fingerprint if mismatch else torch.iinfo(torch.int64).min], dtype=torch.int64, device=device
    )
    group.all_reduce(verdict, dist.ReduceOp.MAX)
    if int(verdict[0]) == 0:
        return
    receiver_fingerprint = int(verdict[1])
    # Failure path only: locate the first differing entry, on every member, then raise.
    source_signature = group.broadcast_object(plan_signature(plan) if is_source else None, src, device)
    first = _first_difference(source_signature, plan_signature(plan)) if not is_source else None
    limit = torch.iinfo(torch.int64).max
    index = torch.tensor([first if first is not None else limit], dtype=torch.int64, device=device)
    group.all_reduce(index, dist.ReduceOp.MIN)
    first = int(index) if int(index) != limit else None
    raise PlanMismatchError(
        _mismatch_message(
            source=theirs if not is_source else mine,
            receiver=mine if not is_source else None,
            receiver_fingerprint=receiver_fingerprint,
            first=first,
            source_signature=source_signature,
            local_signature=None if is_source else plan_signature(plan),
            is_source=is_source,
        )
    )


def _first_difference(a: Sequence, b: Sequence) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if (x[0], tuple(x[1]), x[2]) != (y[0], tuple(y[1]), y[2]):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _describe(signature: Sequence | None, index: int) -> str:
    if signature is None or index >= len(signature):
        return "<none: the plan ends here>"
    name, shape, dtype = signature[index]
    return f"{name} {list(shape)} {dtype}"


def _mismatch_message(
    *,
    source: list[int],
    receiver: list[int] | None,
    receiver_fingerprint: int,
    first: int | None,
    source_signature: Sequence,
    local_signature: Sequence | None,
    is_source: bool,
) -> str:
    fields = ""
    if receiver is not None:
        differing = [
            f"{f}: sender {_hex(s) if f == 'fingerprint' else s}, receiver {_hex(r) if f == 'fingerprint' else r}"
            for f, s, r in zip(_HEADER_FIELDS, source, receiver)
            if s != r
        ]
        fields = "; differing header fields: " + ", ".join(differing)
    where = ""
    if first is not None:
        where = f"; first differing entry #{first}: sender has {_describe(source_signature, first)}"
        if local_signature is not None:
            where += f", receiver has {_describe(local_signature, first)}"
    if is_source:
        who = "a receiver rejected the sender's header"
        if receiver_fingerprint == source[2]:
            who += ": the plans agree, the PackedBroadcastConfig differs (the receiver's error names the field)"
    else:
        who = "this receiver's plan/config differs from the sender's"
    return (
        f"packed broadcast plan mismatch ({who}): sender fingerprint {_hex(source[2])}, receiver fingerprint "
        f"{_hex(receiver_fingerprint)}{fields}{where}. Build the receiver from the sender's plan "
        "(ExportPlan.to_json on the trainer) and the same PackedBroadcastConfig; no weight data was sent."
    )


def _hex(value: int) -> str:
    return f"{value & 0xFFFF_FFFF_FFFF_FFFF:#018x}"


def post_failure(group: BroadcastGroup, who: str, error: BaseException) -> None:
    """Post ``error`` to ``group`` for its other members (``BroadcastGroup.post_error``); never
    raises: the caller is raising ``error`` itself."""
    try:
        group.post_error(f"{who}: {type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 - must not hide the error being raised
        logger.exception("could not post a failure to the packed-broadcast group")


def share_verdict(trainer_group: BroadcastGroup, src: int, error: BaseException | None, device: torch.device) -> None:
    """Broadcast the source's outcome (``error`` there; ignored elsewhere) to the trainer ranks so all
    of them raise the same error (on ``device``: an NCCL group takes CUDA tensors only). Collective
    over ``trainer_group``; ``src`` is the source's rank as that group counts ranks."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=device)
    trainer_group.broadcast(flag, src)
    if int(flag) == 0:
        return
    message = trainer_group.broadcast_object(
        f"{type(error).__name__}: {error}" if error is not None else None, src, device
    )
    if error is not None:
        raise error
    raise RefitStatusError(f"the packed-broadcast source rank {src} failed: {message}")


# --- sender ---------------------------------------------------------------------------------


class PackedBroadcastSender(WeightSink):
    """A :class:`WeightSink` that broadcasts the export stream from ``src`` in packed buckets.

    Construct on every trainer rank that iterates the export, at the same time as the receivers
    construct theirs. Only the source rank (``src`` in ``group``) is a member of ``group`` and
    sends (the other trainer ranks may pass ``group=None``); on the other trainer ranks the sender only checks the stream against the plan and
    discards it (``drain(bridge.export_hf_weights(...), sender)`` on every trainer rank is the
    whole recipe; ``for _ in stream: pass`` would do as well, without the check).

    The constructor runs the handshake on the source rank (collective over ``group``) and raises
    :class:`PlanMismatchError` if any receiver disagrees. With ``trainer_group`` (the ranks
    iterating the export, a ``torch.distributed`` group; the source is its rank ``trainer_src``,
    default ``src``) the source's handshake and ``finish`` outcomes are shared with the other trainer ranks, so every trainer raises the same error instead of
    entering a collective export alone. ``finish`` raises :class:`RefitStatusError` if a receiver
    reported a bad checksum or a failed consumer.

    Buffers: ``num_buffers`` uint8 tensors of ``bucket_bytes`` on ``device`` (default: CUDA's
    current device if available, else CPU), allocated at the first tensor and kept for the
    sender's lifetime. A consumed tensor is copied into the current buffer before ``consume``
    returns, so the exporter may reuse its own buffer right after.

    Overlap: each full buffer goes out with an asynchronous broadcast; the Work is
    waited for only before that buffer is packed again. On CUDA, packing runs on a dedicated
    stream that first waits (event) for the exporter's stream, and the exporter's stream waits
    for the packing copy before it may overwrite the source tensor; the Work's ``wait`` is issued
    on the packing stream, so the exporter's kernels never wait for a broadcast except through a
    full set of buffers in flight.

    A stream that disagrees with the sender's own plan, ends early, or raises (``drain`` then
    calls ``abort``) after the handshake is posted to the group (module docstring), so receivers
    over a ``StoreGroup`` raise too instead of waiting in a broadcast; over a ``TorchGroup`` they
    wait for the group's timeout.
    """

    def __init__(
        self,
        plan: ExportPlan | str,
        config: PackedBroadcastConfig,
        *,
        group: Any,
        src: int,
        trainer_group: Any = None,
        trainer_src: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.plan, self.config, self.packing, self.device = _endpoint(plan, config, device)
        self.group, self.src = as_broadcast_group(group) if group is not None else None, src
        self.trainer_group = as_broadcast_group(trainer_group) if trainer_group is not None else None
        self.trainer_src = src if trainer_src is None else trainer_src
        self.is_source = self.group is not None and self.group.is_source(src)
        self._next = 0
        self._closed = False
        self._buffers: list[torch.Tensor] = []
        self._sums: list[torch.Tensor] = []
        self._works: list[list[Any]] = [[] for _ in range(config.num_buffers)]
        self._bucket = -1  # the bucket being packed
        self._stream = None
        self.bytes_sent = 0
        self.settled = not self.is_source  # the source's protocol is settled once its status (or verdict) is known
        self._abandoned = False
        error = None
        if self.is_source:
            _check_member(self.group)
            try:
                _handshake(
                    plan=self.plan,
                    packing=self.packing,
                    config=config,
                    group=self.group,
                    src=src,
                    device=self.device,
                    is_source=True,
                )
            except PlanMismatchError as err:
                error, self.settled = err, True
            except BaseException as err:
                self._abandon(err)
                raise
        if self.trainer_group is not None:
            share_verdict(self.trainer_group, self.trainer_src, error, self.device)
        elif error is not None:
            raise error

    # -- WeightSink ------------------------------------------------------------------------

    def consume(self, hf_name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("PackedBroadcastSender.consume() after finish() or abort(); create a new sender")
        try:
            slot = self._check(hf_name, tensor)
            self._next += 1
            if not self.is_source or slot.nbytes == 0:
                return
            data = _flat_bytes(tensor)
            if self.device.type == "cuda":
                self._pack_cuda(slot, data)
            else:
                self._pack(slot, data)
        except BaseException as err:
            self._abandon(err)
            raise

    def finish(self) -> None:
        if self._closed:
            raise RuntimeError("PackedBroadcastSender.finish() called twice or after abort()")
        self._closed = True
        error: BaseException | None = None
        if self._next != len(self.packing.slots):
            missing = [s.entry.hf_name for s in self.packing.slots[self._next :]]
            error = ValueError(
                f"the export stream ended after {self._next} of {len(self.packing.slots)} planned tensors; "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
            if not self.is_source:
                raise error
        if self.is_source:
            if error is not None:
                self._abandon(error)
                raise error
            try:
                error = self._finish_source()
            except BaseException as err:
                self._abandon(err)
                raise
            self.settled = True
        if self.trainer_group is not None:
            share_verdict(self.trainer_group, self.trainer_src, error, self.device)
        elif error is not None:
            raise error

    def abort(self) -> None:
        """Drop the buffers; on the source, in the middle of the protocol, post the error being
        handled (``drain`` calls this from its ``except``) so the receivers raise too."""
        self._closed = True
        self._buffers, self._sums = [], []
        error = sys.exc_info()[1]
        self._abandon(error if error is not None else RuntimeError("the sender was aborted"))

    def _abandon(self, error: BaseException) -> None:
        """Post ``error`` once, if this is the source and its protocol is not settled."""
        if self.is_source and not self.settled and not self._abandoned:
            self._abandoned = True
            post_failure(self.group, "the packed-broadcast source", error)

    # -- internals -------------------------------------------------------------------------

    def _check(self, hf_name: str, tensor: torch.Tensor) -> _Slot:
        if self._next >= len(self.packing.slots):
            raise ValueError(
                f"the export stream has more tensors than the plan ({len(self.packing.slots)}); "
                f"unexpected {hf_name!r}: build the sender from this export's plan (bridge.export_plan(model))"
            )
        slot = self.packing.slots[self._next]
        entry = slot.entry
        got = (hf_name, tuple(tensor.shape), tensor.dtype)
        want = (entry.hf_name, tuple(entry.shape), entry.torch_dtype)
        if got != want:
            raise ValueError(
                f"export stream differs from the plan at entry #{self._next}: got {hf_name} {list(got[1])} "
                f"{got[2]}, plan has {entry.hf_name} {list(entry.shape)} {want[2]}; build the sender from "
                "this export's plan (bridge.export_plan(model))"
            )
        return slot

    def _pack(self, slot: _Slot, data: torch.Tensor) -> None:
        """Copy ``data`` into the buckets that hold ``slot``, sending each bucket as it fills."""
        bucket_bytes = self.config.bucket_bytes
        position = slot.offset
        while position < slot.end:
            bucket, within = divmod(position, bucket_bytes)
            buffer = self._enter(bucket)
            length = min(slot.end - position, bucket_bytes - within)
            start = position - slot.offset
            buffer[within : within + length].copy_(data[start : start + length])
            position += length

    def _pack_cuda(self, slot: _Slot, data: torch.Tensor) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        producer = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(producer)  # the exported tensor is ready
        with torch.cuda.stream(self._stream):
            self._pack(slot, data)
        producer.wait_stream(self._stream)  # the exporter may overwrite its buffer after the copy

    def _enter(self, bucket: int) -> torch.Tensor:
        """The buffer of ``bucket``, sending every earlier bucket first."""
        while self._bucket < bucket:
            if self._bucket >= 0:
                self._send(self._bucket)
            self._bucket += 1
            self._acquire(self._bucket)
        return self._buffers[self._bucket % self.config.num_buffers]

    def _acquire(self, bucket: int) -> None:
        index = bucket % self.config.num_buffers
        if not self._buffers:
            n = self.config.num_buffers
            self._buffers = [
                torch.zeros(self.config.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(n)
            ]
            self._sums = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(n)]
        for work in self._works[index]:
            work.wait()  # on CUDA: the packing stream waits for the broadcast of this buffer
        self._works[index] = []

    def _send(self, bucket: int) -> None:
        index = bucket % self.config.num_buffers
        data = self._buffers[index][: self.packing.bucket_length(bucket)]
        works = [self.group.broadcast(data, self.src, async_op=True)]
        if self.config.checksum:
            self._sums[index].copy_(checksum(data))
            works.append(self.group.broadcast(self._sums[index], self.src, async_op=True))
        self._works[index] = works
        self.bytes_sent += data.numel()

    def _finish_source(self) -> BaseException | None:
        last = self.packing.num_buckets - 1
        if last >= 0:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._enter(last)
                    self._send(last)
            else:
                self._enter(last)
                self._send(last)
        for works in self._works:
            for work in works:
                work.wait()
        self._works = [[] for _ in self._works]
        status = torch.zeros(2, dtype=torch.int64, device=self.device)
        self.group.all_reduce(status, dist.ReduceOp.MAX)
        code, bucket = (int(v) for v in status.tolist())
        self._buffers, self._sums = [], []
        if code == _STATUS_OK:
            return None
        if code == _STATUS_CHECKSUM:
            return RefitStatusError(
                f"a receiver found a checksum mismatch in buffer {bucket} (tensors {self.packing.names_in(bucket)}); "
                "the receivers' weights are not trustworthy: run the refit again"
            )
        return RefitStatusError("a receiver's consumer failed while applying the weights (see the receiver's log)")


def _endpoint(
    plan: ExportPlan | str, config: PackedBroadcastConfig, device: torch.device | str | None
) -> tuple[ExportPlan, PackedBroadcastConfig, "StreamPacking", torch.device]:
    """What both ends derive from their arguments: the plan, the config, the stream packing, the device."""
    plan = ExportPlan.from_json(plan) if isinstance(plan, str) else plan
    return (
        plan,
        config,
        StreamPacking.build(plan, config.bucket_bytes),
        torch.device(device) if device is not None else _default_device(),
    )


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# --- receiver -------------------------------------------------------------------------------


class PackedBroadcastReceiver:
    """Receives a packed broadcast and yields ``(hf_name, tensor)`` in plan order.

    Construct on each receiver rank, with the sender's plan (an :class:`ExportPlan` or its JSON)
    and the same :class:`PackedBroadcastConfig`; the constructor runs the handshake (collective
    over ``group``) and raises :class:`PlanMismatchError` naming both fingerprints and the first
    differing entry. Then iterate :meth:`receive` (or ``drain(receiver.receive(), sink)``).

    Tensor lifetime: each yielded tensor is a view of a receive buffer (or of one scratch tensor
    for a tensor split across buffers) and is valid until the generator advances; copy it to
    keep it. ``num_buffers - 1`` buckets are in flight while one is consumed.

    With checksums on, a bucket whose checksum differs raises :class:`ChecksumError` (naming the
    bucket and its tensors) before any of its tensors is yielded; the receiver first runs the
    rest of the protocol (discarding the data) so the sender learns the failure and raises too.
    ``_corrupt_hook(bucket, data)``, test-only, may modify a received bucket before the check.
    """

    def __init__(
        self,
        plan: ExportPlan | str,
        config: PackedBroadcastConfig,
        *,
        group: Any,
        src: int,
        device: torch.device | str | None = None,
    ) -> None:
        self.plan, self.config, self.packing, self.device = _endpoint(plan, config, device)
        self.group, self.src = as_broadcast_group(group), src
        self._corrupt_hook: Callable[[int, torch.Tensor], None] | None = None
        self._used = False
        self.settled = False  # the protocol ended in a state every member knows (module docstring)
        _check_member(self.group)
        if self.group.is_source(src):
            raise ValueError(f"rank {src} is the source of the broadcast; construct PackedBroadcastSender there")
        try:
            _handshake(
                plan=self.plan,
                packing=self.packing,
                config=config,
                group=self.group,
                src=src,
                device=self.device,
                is_source=False,
            )
        except PlanMismatchError:
            self.settled = True
            raise
        except BaseException as err:
            post_failure(self.group, "a packed-broadcast receiver", err)
            raise

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Run the bulk broadcasts and yield every tensor of the plan (once per receiver)."""
        if self._used:
            raise RuntimeError("PackedBroadcastReceiver.receive() runs once; construct a new receiver per refit")
        self._used = True
        return self._receive()

    def _receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        packing, config = self.packing, self.config
        n = config.num_buffers
        try:
            buffers = [
                torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device)
                for _ in range(min(n, max(packing.num_buckets, 1)))
            ]
            sums = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in buffers]
            scratch = torch.empty(packing.max_split_bytes(), dtype=torch.uint8, device=self.device)
        except BaseException as err:  # e.g. out of memory: the sender is about to broadcast
            post_failure(self.group, "a packed-broadcast receiver", err)
            raise
        works: dict[int, list[Any]] = {}
        events = _bucket_events(packing)

        def post(bucket: int) -> None:
            if bucket < packing.num_buckets:
                index = bucket % len(buffers)
                data = buffers[index][: packing.bucket_length(bucket)]
                works[bucket] = [self.group.broadcast(data, self.src, async_op=True)]
                if config.checksum:
                    works[bucket].append(self.group.broadcast(sums[index], self.src, async_op=True))

        status, failed_bucket, error = _STATUS_OK, 0, None
        next_post, at_yield = 0, False
        try:
            for _ in buffers:
                post(next_post)
                next_post += 1
            for bucket in range(packing.num_buckets):
                for work in works.pop(bucket):
                    work.wait()
                index = bucket % len(buffers)
                data = buffers[index][: packing.bucket_length(bucket)]
                if self._corrupt_hook is not None:
                    self._corrupt_hook(bucket, data)
                if config.checksum:
                    local, sent = int(checksum(data)), int(sums[index])
                    if local != sent:
                        status, failed_bucket = _STATUS_CHECKSUM, bucket
                        error = ChecksumError(
                            f"checksum mismatch in packed-broadcast buffer {bucket} of {packing.num_buckets} "
                            f"(sender {_hex(sent)}, received {_hex(local)}); it held tensors {packing.names_in(bucket)}. "
                            "The transfer is corrupt: run the refit again"
                        )
                        break
                for item in _tensors_completed_in(bucket, events[bucket], data, scratch, self.device):
                    at_yield = True
                    yield item
                    at_yield = False
                post(next_post)  # this bucket's buffer is free again
                next_post += 1
        except BaseException as err:
            if not at_yield:  # a collective or a copy failed: the protocol is broken, run no more collectives
                post_failure(self.group, "a packed-broadcast receiver", err)
                raise
            status = _STATUS_CONSUMER  # the consumer raised or stopped early
            self._finish_protocol(works, post, next_post, status, failed_bucket)
            raise
        self._finish_protocol(works, post, next_post, status, failed_bucket)
        if error is not None:
            raise error

    def _finish_protocol(self, works, post, next_post: int, status: int, failed_bucket: int) -> None:
        """Step 3: after a local failure, run the remaining bulk broadcasts (data discarded) so
        the sender is not left blocked; then report the status to every member."""
        try:
            if status != _STATUS_OK:
                for bucket in sorted(works):
                    for work in works.pop(bucket):
                        work.wait()
                for bucket in range(next_post, self.packing.num_buckets):
                    post(bucket)
                    for work in works.pop(bucket):
                        work.wait()
            report = torch.tensor([status, failed_bucket], dtype=torch.int64, device=self.device)
            self.group.all_reduce(report, dist.ReduceOp.MAX)
        except BaseException as err:
            post_failure(self.group, "a packed-broadcast receiver", err)
            raise
        self.settled = True


def _tensors_completed_in(
    bucket: int, events: list, data: torch.Tensor, scratch: torch.Tensor, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors whose last byte is in ``bucket``: views of ``data``, or of ``scratch``
    for a tensor that began in an earlier bucket (its earlier pieces were copied there)."""
    for slot, within, start, length, complete in events:
        entry = slot.entry
        if slot.nbytes == 0:
            yield entry.hf_name, torch.empty(entry.shape, dtype=entry.torch_dtype, device=device)
            continue
        if length == slot.nbytes:
            view = data[within : within + length]
        else:
            scratch[start : start + length].copy_(data[within : within + length])
            if not complete:
                continue
            view = scratch[: slot.nbytes]
        yield entry.hf_name, view.view(entry.torch_dtype).view(entry.shape)


def _bucket_events(packing: StreamPacking) -> list[list[tuple[_Slot, int, int, int, bool]]]:
    """Per bucket, in stream order: (slot, offset in bucket, offset in tensor, length, tensor complete)."""
    events: list[list[tuple[_Slot, int, int, int, bool]]] = [[] for _ in range(max(packing.num_buckets, 1))]
    size = packing.bucket_bytes
    for slot in packing.slots:
        if slot.nbytes == 0:
            events[min(slot.offset // size, len(events) - 1)].append((slot, 0, 0, 0, True))
            continue
        position = slot.offset
        while position < slot.end:
            bucket, within = divmod(position, size)
            length = min(slot.end - position, size - within)
            events[bucket].append((slot, within, position - slot.offset, length, position + length == slot.end))
            position += length
    return events


__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "ChecksumError",
    "PackedBroadcastConfig",
    "PackedBroadcastReceiver",
    "PackedBroadcastSender",
    "PlanMismatchError",
    "RefitStatusError",
    "StreamPacking",
    "plan_fingerprint",
    "plan_signature",
    "post_failure",
    "share_verdict",
]
