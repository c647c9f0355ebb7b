"""The wire format of the packed broadcast (``engines.broadcast.packed``), shared by its two ends.

Owns what sender and receiver must compute alike from the plan and the configuration, and the
collectives that settle whether they agree: ``WIRE_VERSION``; ``PackedBroadcastConfig``; the byte packing of the
stream (``StreamPacking``: tensors back to back in plan order, each at a multiple of
``ALIGN_BYTES``, cut into buckets); the per-bucket ``checksum``; the header handshake (step 1 of
the protocol described in ``engines.broadcast.packed``) and its mismatch message; the failure
posting and the verdict shared with the other trainer ranks; the errors of the protocol. No
tensor of the stream is moved here except by the handshake's small collectives.

``WIRE_VERSION`` versions all of it (the packing, the checksum, the handshake's words, the join's
arguments an engine takes, ``engines.broadcast``). Its first collective is the same in every
version (the header: int64[8], the magic and the version first), and so is the verdict (int64[2]),
so a receiver of another version sees the version in the header and both ends raise
``WireVersionError`` naming both versions, after the same collectives as a plan mismatch (the
sequence a receiver of version 2, before versions were compared, runs too: there the source sees a
plan mismatch and the receiver names the header's version field).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.engines.broadcast.bounded_kernels import DEFAULT_PROGRAMS, MAX_PROGRAMS
from mbridge_refit.engines.broadcast.group import BroadcastGroup
from mbridge_refit.errors import TransportError, wire_version_mismatch
from mbridge_refit.plan.entries import ExportPlan, PlanEntry

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "STATUS_CHECKSUM",
    "STATUS_CONSUMER",
    "STATUS_OK",
    "WIRE_VERSION",
    "ChecksumError",
    "PackedBroadcastConfig",
    "PlanMismatchError",
    "RefitStatusError",
    "StreamPacking",
    "StreamSlot",
    "WireVersionError",
    "bucket_events",
    "check_wire_version",
    "check_member",
    "checksum",
    "checksum_into",
    "completed_views",
    "flat_bytes",
    "handshake",
    "hex64",
    "plan_fingerprint",
    "plan_signature",
    "post_failure",
    "share_verdict",
    "split_pieces",
]

DEFAULT_BUCKET_BYTES = 512 * 1024**2
ALIGN_BYTES = 16
_MAGIC = 0x5042_5246  # "PBRF"
# 3: the join carries the group's secret and this version (2: checksums of 8-byte words; 1: of 4-byte words)
WIRE_VERSION = 3
_WIRE_FORMAT = "packed broadcast"
_PLAN_MISMATCH = 1  # a receiver's verdict word; another wire version: _OTHER_VERSION | (its version << 8)
_OTHER_VERSION = 2
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
STATUS_OK, STATUS_CHECKSUM, STATUS_CONSUMER = 0, 1, 2

logger = logging.getLogger(__name__)


class PlanMismatchError(TransportError):
    """Sender and receiver do not agree on the plan or the buffer configuration."""


class WireVersionError(PlanMismatchError):
    """The two ends speak other versions of the packed broadcast (another mbridge_refit on one side)."""


def check_wire_version(theirs: object, peer: str) -> None:
    """Refuse ``theirs`` (a peer's ``WIRE_VERSION``; None: it sent none) unless it is this one's."""
    if theirs != WIRE_VERSION:
        raise WireVersionError(wire_version_mismatch(_WIRE_FORMAT, WIRE_VERSION, theirs, peer))


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
        checksum: compute and compare a checksum of every bucket (on by default). The checksum
            is the sum of the bucket's 8-byte words modulo 2**64 (plus its trailing bytes, one by
            one): one read of the bucket per side, on the device, written into its slot with no
            temporary, queued as the bucket goes out or lands; the source's checksums travel in
            one broadcast after the last bucket and are compared on the receivers' devices, so
            the check adds no host round trip and one collective per refit. Memory-bound: about
            0.4-0.55 ms per GB per side measured on an H100 (docs/benchmarks/history/), beside the next
            bucket's broadcast; 0.1-0.3 s per GB on one CPU core. Detects any single corrupted
            byte and truncated or stale buckets; it is order-insensitive at the 8-byte-word
            level, so it does not detect two words swapped. A mismatch is raised after the last
            bucket (the receiver's consumer has seen the corrupt bucket by then; the refit fails
            on every member: run it again).
        device_programs: GPU programs (thread blocks) the broadcast's own copies and checksums run
            on (``engines.broadcast.bounded_kernels``): few enough that they leave the broadcast its memory
            bandwidth (the source's pack copies on every SM slowed 512 MiB broadcasts by ~20% on
            2x H200), enough to keep ahead of it. 0: torch's kernels, on every SM. Each end uses
            its own; the bytes sent do not depend on it.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    num_buffers: int = 2
    checksum: bool = True
    device_programs: int = DEFAULT_PROGRAMS

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0 or self.bucket_bytes % ALIGN_BYTES:
            raise ValueError(
                f"bucket_bytes must be a positive multiple of {ALIGN_BYTES}, got {self.bucket_bytes!r} "
                f"(e.g. {DEFAULT_BUCKET_BYTES} for 512 MiB)"
            )
        if not isinstance(self.num_buffers, int) or self.num_buffers < 1:
            raise ValueError(f"num_buffers must be an integer >= 1, got {self.num_buffers!r}")
        if not isinstance(self.device_programs, int) or not 0 <= self.device_programs <= MAX_PROGRAMS:
            raise ValueError(
                f"device_programs must be an integer 0 .. {MAX_PROGRAMS} (0: torch's kernels), got {self.device_programs!r}"
            )


# --- the stream packing, from the plan alone ---------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamSlot:
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

    slots: tuple[StreamSlot, ...]
    stream_bytes: int
    bucket_bytes: int
    fingerprint: int

    @classmethod
    def build(cls, plan: ExportPlan | str, bucket_bytes: int) -> StreamPacking:
        plan = ExportPlan.from_json(plan) if isinstance(plan, str) else plan
        slots, offset = [], 0
        for index, entry in enumerate(plan.entries):
            offset = _align(offset)
            slots.append(StreamSlot(index=index, entry=entry, offset=offset, nbytes=entry.nbytes))
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


def _header(packing: StreamPacking, config: PackedBroadcastConfig, version: int) -> list[int]:
    return [
        _MAGIC,
        version,
        packing.fingerprint,
        packing.stream_bytes,
        config.bucket_bytes,
        config.num_buffers,
        int(config.checksum),
        len(packing.slots),
    ]


def checksum(data: torch.Tensor) -> torch.Tensor:
    """The checksum of uint8 ``data`` (``PackedBroadcastConfig.checksum``) as an int64[1] tensor."""
    out = torch.zeros(1, dtype=torch.int64, device=data.device)
    if data.data_ptr() % 8:  # a view at an odd offset (e.g. of a parameter): its words, aligned
        data = data.clone()
    checksum_into(data, out[0])
    return out


def checksum_into(data: torch.Tensor, out: torch.Tensor) -> None:
    """Write the checksum of uint8 ``data`` into the int64 scalar ``out`` (a slot of the ends'
    checksum table), queued on the current stream: the sum of its 8-byte words modulo 2**64, its
    trailing bytes added one by one. The words are read in place (``data`` starts 8-byte aligned:
    a bucket's buffer) and summed in their own dtype, so nothing is allocated and the bucket is
    read once (``sum(dtype=int64)`` of int32 words would first copy them into an int64 tensor
    twice the bucket's size). Integer addition wraps and is associative, so every device and
    reduction order gives the same value."""
    words = data.numel() // 8 * 8
    torch.sum(data[:words].view(torch.int64), dim=0, out=out)
    if words < data.numel():
        out.add_(data[words:].sum(dtype=torch.int64))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``tensor`` (a copy only if it is not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


# --- the handshake --------------------------------------------------------------------------


def check_member(group: BroadcastGroup) -> None:
    if not group.is_member():
        raise ValueError(
            "this process is not a member of `group`; the packed-broadcast group must hold the source "
            "rank and every receiver rank (torch.distributed.new_group on all ranks, or a StoreGroup)"
        )


@dataclass
class SentHeader:
    """The source's header, its broadcast issued and not waited for (``send_header``); the tensor is
    kept until the handshake ends, the broadcast may still be reading it."""

    tensor: torch.Tensor
    work: Any


def send_header(end: Any) -> SentHeader:
    """The first collective of the source's handshake, issued without waiting for the receivers:
    the source packs its first bucket meanwhile and finishes with ``handshake(end, is_source=True,
    sent=...)`` before that bucket goes out."""
    header = torch.tensor(_header(end.packing, end.config, end.wire_version), dtype=torch.int64, device=end.device)
    return SentHeader(header, end.group.broadcast(header, end.src, async_op=True))


def handshake(end: Any, *, is_source: bool, sent: SentHeader | None = None) -> None:
    """Step 1 of the protocol (collective over ``end.group``); raises PlanMismatchError on every
    member (``WireVersionError`` where the versions differ). ``end``: the sender or receiver (its
    ``plan``, ``packing``, ``config``, ``group``, ``src``, ``device`` and ``wire_version``).
    ``sent``: on the source, its header already issued (``send_header``)."""
    plan, packing, config, group, src, device = end.plan, end.packing, end.config, end.group, end.src, end.device
    mine = _header(packing, config, end.wire_version)
    if sent is None:
        header = torch.tensor(mine, dtype=torch.int64, device=device)
        group.broadcast(header, src)
    theirs = mine if is_source else [int(v) for v in header.tolist()]
    mismatch = 0 if is_source or theirs == mine else _verdict_word(theirs, end.wire_version)
    verdict = torch.tensor(
        [mismatch, packing.fingerprint if mismatch else torch.iinfo(torch.int64).min], dtype=torch.int64, device=device
    )
    group.all_reduce(verdict, dist.ReduceOp.MAX)  # a StoreGroup polls it, watching the peers
    if sent is not None:
        sent.work.wait()  # ended before the all-reduce (one group runs its collectives in order): returns at once
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
    word = int(verdict[0])
    if word & 0xFF == _OTHER_VERSION:  # raised after the same collectives as a plan mismatch: every member in step
        theirs_version, peer = word >> 8, "a receiver (an engine worker)"
        if not is_source and theirs[1] != end.wire_version:
            theirs_version, peer = theirs[1], "the sender (the trainer)"
        raise WireVersionError(wire_version_mismatch(_WIRE_FORMAT, end.wire_version, theirs_version, peer))
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


def _verdict_word(header: list[int], version: int) -> int:
    """A receiver's verdict on a ``header`` that is not its own: another wire version (its own in the high
    bits, so the source can name it) when the magic agrees and the version does not, else a plan mismatch."""
    if header[0] == _MAGIC and header[1] != version:
        return _OTHER_VERSION | (version << 8)
    return _PLAN_MISMATCH


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
            f"{f}: sender {hex64(s) if f == 'fingerprint' else s}, receiver {hex64(r) if f == 'fingerprint' else r}"
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
        f"packed broadcast plan mismatch ({who}): sender fingerprint {hex64(source[2])}, receiver fingerprint "
        f"{hex64(receiver_fingerprint)}{fields}{where}. Build the receiver from the sender's plan "
        "(ExportPlan.to_json on the trainer) and the same PackedBroadcastConfig; no weight data was sent."
    )


def hex64(value: int) -> str:
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


def split_pieces(
    events: list, data: torch.Tensor, scratch: torch.Tensor, *, completing: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(scratch view, data view)`` of each piece in bucket ``data`` of a tensor split across
    buckets: of those whose last byte is in this bucket (``completing``), or of those that go on
    into the next one. The receiver copies the completing pieces before it hands the bucket's
    tensors out and the others after, so one scratch serves every split tensor (at most one
    completes, and one begins, per bucket)."""
    return [
        (scratch[start : start + length], data[within : within + length])
        for slot, within, start, length, complete in events
        if complete == completing and 0 < length < slot.nbytes
    ]


def completed_views(
    events: list, data: torch.Tensor, scratch: torch.Tensor, device: torch.device
) -> list[tuple[str, torch.Tensor]]:
    """The tensors whose last byte is in bucket ``data``: views of ``data``, or of ``scratch`` for a
    tensor split across buckets (its pieces copied there). The same memory every refit, so the
    views may be made once and kept."""
    out = []
    for slot, within, _, length, complete in events:
        entry = slot.entry
        if not complete:
            continue
        if slot.nbytes == 0:
            out.append((entry.hf_name, torch.empty(entry.shape, dtype=entry.torch_dtype, device=device)))
            continue
        view = data[within : within + length] if length == slot.nbytes else scratch[: slot.nbytes]
        out.append((entry.hf_name, view.view(entry.torch_dtype).view(entry.shape)))
    return out


def bucket_events(packing: StreamPacking) -> list[list[tuple[StreamSlot, int, int, int, bool]]]:
    """Per bucket, in stream order: (slot, offset in bucket, offset in tensor, length, tensor complete)."""
    events: list[list[tuple[StreamSlot, int, int, int, bool]]] = [[] for _ in range(max(packing.num_buckets, 1))]
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
