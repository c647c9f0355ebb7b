"""The memory each end of a packed broadcast keeps from one refit to the next (``engines.broadcast.packed``).

Both ends derive the same packing from the plan and the config (``engines.broadcast.wire``); what they
make of it once, and keep, lives here, so a steady refit parses no plan, computes no packing and
allocates nothing:

* ``SendBuffers`` (the source): the stream packing, each tensor's expected name, shape and dtype
  (the sender checks the export against them), and, made by the source rank's sender before its
  handshake's header goes out, the rotating buffers, the checksum slots, every tensor's destination views in them and the
  bounded kernels that pack and checksum them (``engines.broadcast.bounded_kernels``): where those kernels run, a bucket's copies
  sum the bytes they move as they move them, so its checksum adds only the words no copy took (the short pieces
  and the padding: ``rest_ranges``) instead of reading the whole bucket a second time.
* ``ReceiveBuffers`` (a receiver): the rotating buffers, their checksum slots, the scratch for
  tensors split across buckets, each bucket's tensors as views of them and the bounded kernels that
  checksum them, made once.

Bucket ``b`` always uses buffer ``b % len(buffers)`` on both ends (each end has
``min(num_buffers, buckets)`` buffers of ``bucket_bytes``).
"""

from __future__ import annotations

import torch

from mbridge_refit.engines.broadcast.bounded_kernels import BoundedKernels
from mbridge_refit.engines.broadcast.wire import (
    PackedBroadcastConfig,
    StreamPacking,
    StreamSlot,
    bucket_events,
    completed_views,
    split_pieces,
)
from mbridge_refit.plan.entries import ExportPlan

__all__ = ["Piece", "ReceiveBuffers", "SendBuffers", "default_device", "endpoint"]

# one piece of a tensor in the stream: (bucket, its destination view in the bucket's buffer, offset in the
# tensor's bytes, length); a tensor that lies in one bucket is one piece
Piece = tuple[int, torch.Tensor, int, int]


def endpoint(
    plan: ExportPlan | str, config: PackedBroadcastConfig, device: torch.device | str | None
) -> tuple[ExportPlan, PackedBroadcastConfig, StreamPacking, torch.device]:
    """What both ends derive from their arguments: the plan, the config, the stream packing, the device."""
    plan = ExportPlan.from_json(plan) if isinstance(plan, str) else plan
    return (
        plan,
        config,
        StreamPacking.build(plan, config.bucket_bytes),
        torch.device(device) if device is not None else default_device(),
    )


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _buffer_count(config: PackedBroadcastConfig, packing: StreamPacking) -> int:
    return min(config.num_buffers, max(packing.num_buckets, 1))


class SendBuffers:
    """The source's memory, kept from one refit to the next (module docstring).

    Pass the same object to each refit's ``PackedBroadcastSender`` (every trainer rank may: the
    ranks that do not send use only its packing and expectations, and allocate nothing). The
    buffers are allocated by the source's sender before its header goes out (``allocate``) and kept
    until ``release``; a sender that created its own releases them when it finishes.
    """

    def __init__(self, plan: ExportPlan | str, config: PackedBroadcastConfig, device: torch.device | str | None = None):
        self.plan, self.config, self.packing, self.device = endpoint(plan, config, device)
        # (hf_name, shape, dtype) of each entry, as the export must yield it
        self.expected = [(s.entry.hf_name, tuple(s.entry.shape), s.entry.torch_dtype) for s in self.packing.slots]
        # the first entry with bytes past bucket 0: the source takes the handshake's verdict once its bytes
        # in bucket 0 are packed (None: at the stream's end)
        self.agree_at = next(
            (i for i, s in enumerate(self.packing.slots) if s.nbytes and s.end > self.packing.bucket_bytes), None
        )
        self.buffers: list[torch.Tensor] = []
        self.sums: torch.Tensor | None = None  # int64[buckets]: each bucket's checksum, sent after the last bucket
        self.data: list[torch.Tensor] = []  # each bucket's bytes (a view of its buffer)
        self.pieces: list[tuple[Piece, ...]] = []  # per plan entry: its pieces, in stream order
        self.kernels: BoundedKernels | None = None  # the pack's copies and the checksums (made with the buffers)
        # per bucket: its words no copy sums (``rest_ranges``), or None where its checksum reads the bucket
        self.rest: list[torch.Tensor | None] = []
        self._unsummed: list[bool] = []  # per bucket: a copy meant to sum its bytes could not (``pack``)
        self._status: torch.Tensor | None = None

    @property
    def allocated(self) -> bool:
        return bool(self.buffers)

    def allocate(self) -> None:
        """The buffers (zeroed once; the padding between tensors then holds whatever an earlier bucket in
        the same buffer left there, and is sent as it is), the checksum slots and every piece's destination
        view; a no-op once allocated."""
        if self.buffers:
            return
        packing, size = self.packing, self.config.bucket_bytes
        count = _buffer_count(self.config, packing)
        buffers = [torch.zeros(size, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self.sums = torch.zeros(max(packing.num_buckets, 1), dtype=torch.int64, device=self.device)
        self.data = [buffers[b % count][: packing.bucket_length(b)] for b in range(packing.num_buckets)]
        self.pieces = [_slot_pieces(slot, size, buffers) for slot in packing.slots]
        self.kernels = BoundedKernels(self.device, self.config.device_programs, slots=packing.num_buckets)
        self.rest = [self.rest_ranges(b) for b in range(packing.num_buckets)]
        self._unsummed = [False] * packing.num_buckets
        self.buffers = buffers

    def rest_ranges(self, bucket: int) -> torch.Tensor | None:
        """The words of ``bucket`` its copies do not sum, as int64[k, 2] (first word, words) on the device: every
        whole word of the bucket outside the pieces the summing copy takes (``BoundedKernels.fusable``), so the
        pieces too short for it and the padding between tensors, which holds whatever an earlier bucket left
        in the rotating buffer (``checksum`` adds the bytes after the last whole word one by one, as
        ``broadcast_wire.checksum_into`` does). None where no copy of the bucket sums (the kernels do not run
        here, checksums are off, or no piece is long enough): its checksum reads the bucket."""
        if not (self.config.checksum and self.kernels is not None and self.kernels.enabled):
            return None
        summed = sorted(  # whole words each: a piece starts 16-byte aligned (its tensor, or the bucket)
            (target.storage_offset() // 8, (target.storage_offset() + length) // 8)
            for pieces in self.pieces
            for piece_bucket, target, _, length in pieces
            if piece_bucket == bucket and self.kernels.fusable(length)
        )
        if not summed:
            return None
        rest, position = [], 0
        for first, stop in [*summed, (self.packing.bucket_length(bucket) // 8,) * 2]:
            if first > position:
                rest.append((position, first - position))
            position = max(position, stop)
        return torch.tensor(rest, dtype=torch.int64, device=self.device).reshape(-1, 2)

    def start_bucket(self, bucket: int) -> None:
        """Before ``bucket``'s first ``pack``, on the stream that packs it: its copies' sums start at zero."""
        if self.rest[bucket] is not None:
            self.kernels.start_sum(bucket)
            self._unsummed[bucket] = False

    def pack(self, bucket: int, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` (flat uint8) into ``target``, a piece of ``bucket``'s buffer, on the current stream;
        where the bucket's checksum is summed by its copies (``rest_ranges``), summing it too."""
        if self.rest[bucket] is not None and self.kernels.fusable(source.numel()):
            if not self.kernels.copy_summing(target, source, bucket):
                self._unsummed[bucket] = True  # torch copied it (an unaligned source): checksum reads the bucket
            return
        self.kernels.copy(target, source)

    def summed_by_copies(self, bucket: int) -> bool:
        """Whether ``bucket``'s last checksum came from its copies' sums (``checksum``), not a read of it."""
        return self.rest[bucket] is not None and not self._unsummed[bucket]

    def checksum(self, bucket: int) -> None:
        """``bucket``'s checksum into its slot of ``sums``, on the current stream once the bucket is packed:
        ``broadcast_wire.checksum_into``'s value of its bytes. Where its copies summed them, their sums and
        the ``rest_ranges``' (one small read); else one read of the bucket."""
        data, out, rest = self.data[bucket], self.sums[bucket], self.rest[bucket]
        if rest is None or self._unsummed[bucket]:
            self.kernels.checksum_into(data, out, bucket)
            return
        if rest.numel():
            self.kernels.sum_ranges(data[: data.numel() // 8 * 8], rest, bucket)
        self.kernels.summed_into(bucket, out)
        if data.numel() % 8:
            out.add_(data[data.numel() // 8 * 8 :].sum(dtype=torch.int64))

    def status(self) -> torch.Tensor:
        """The int64[2] the status all-reduce runs on, zeroed (made once)."""
        if self._status is None:
            self._status = torch.zeros(2, dtype=torch.int64, device=self.device)
            return self._status
        return self._status.zero_()

    def release(self) -> None:
        """Drop the device memory (the next ``allocate`` makes it again)."""
        self.buffers, self.sums, self.data, self.pieces, self._status = [], None, [], [], None
        self.kernels, self.rest, self._unsummed = None, [], []


def _slot_pieces(slot: StreamSlot, size: int, buffers: list[torch.Tensor]) -> tuple[Piece, ...]:
    """``slot``'s pieces: one per bucket it lies in, each with its destination view."""
    pieces, position = [], slot.offset
    while position < slot.end:
        bucket, within = divmod(position, size)
        length = min(slot.end - position, size - within)
        target = buffers[bucket % len(buffers)][within : within + length]
        pieces.append((bucket, target, position - slot.offset, length))
        position += length
    return tuple(pieces)


class ReceiveBuffers:
    """A receiving end's memory, kept from one refit to the next: the rotating buffers, their
    checksum slots, the scratch for tensors split across buckets, and each bucket's tensors as
    views of them, made once.

    Bucket ``b`` always lands in buffer ``b % len(buffers)`` and a split tensor always ends in
    ``scratch``, so a tensor is the same view of the same memory every refit: a consumer may keep
    references to those views (``engines.broadcast.engine`` replays recorded copies from them) as long
    as it keeps this object. Pass it to each refit's ``PackedBroadcastReceiver``.
    """

    def __init__(self, plan: ExportPlan | str, config: PackedBroadcastConfig, device: torch.device | str) -> None:
        self.plan, self.config, self.packing, self.device = endpoint(plan, config, device)
        count = _buffer_count(config, self.packing)
        self.buffers = [torch.empty(config.bucket_bytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        # each bucket's checksum as received and as the sender computed it (sent after the last bucket)
        self.sums, self.sent_sums = (
            torch.zeros(max(self.packing.num_buckets, 1), dtype=torch.int64, device=self.device) for _ in range(2)
        )
        self.scratch = torch.empty(self.packing.max_split_bytes(), dtype=torch.uint8, device=self.device)
        self.kernels = BoundedKernels(self.device, config.device_programs, slots=self.packing.num_buckets)
        # on CUDA, the stream a landed bucket's checksum runs on, beside its consumer's copies (both only read the
        # bucket; on 2x H100 in scripts/bench_broadcast_contention.py the broadcasts beside them ended 1.3 ms sooner
        # over 16.4 GB, not measured inside an engine); the consumer's stream waits for it before the buffer is
        # posted again
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.events = bucket_events(self.packing)
        self.data = [self.buffers[b % count][: self.packing.bucket_length(b)] for b in range(self.packing.num_buckets)]
        self.tensors = [
            completed_views(self.events[b], data, self.scratch, self.device) for b, data in enumerate(self.data)
        ]
        self.pieces = [  # per bucket: the split tensors' pieces to copy (before, after) its tensors are used
            tuple(split_pieces(self.events[b], data, self.scratch, completing=c) for c in (True, False))
            for b, data in enumerate(self.data)
        ]

    def storages(self) -> list[torch.Tensor]:
        """The tensors whose memory every received view lies in (buffers and scratch)."""
        return [*self.buffers, self.scratch]
