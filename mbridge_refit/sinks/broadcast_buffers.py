"""The memory each end of a packed broadcast keeps from one refit to the next (``sinks.packed_broadcast``).

Both ends derive the same packing from the plan and the config (``sinks.broadcast_wire``); what they
make of it once, and keep, lives here, so a steady refit parses no plan, computes no packing and
allocates nothing:

* ``SendBuffers`` (the source): the stream packing, each tensor's expected name, shape and dtype
  (the sender checks the export against them), and, made by the source rank's sender before its
  handshake's header goes out, the rotating buffers, the checksum slots, every tensor's destination views in them and the
  bounded kernels that pack and checksum them (``sinks.bounded_kernels``).
* ``ReceiveBuffers`` (a receiver): the rotating buffers, their checksum slots, the scratch for
  tensors split across buckets, each bucket's tensors as views of them and the bounded kernels that
  checksum them, made once.

Bucket ``b`` always uses buffer ``b % len(buffers)`` on both ends (each end has
``min(num_buffers, buckets)`` buffers of ``bucket_bytes``).
"""

from __future__ import annotations

import torch

from mbridge_refit.plan.entries import ExportPlan
from mbridge_refit.sinks.bounded_kernels import BoundedKernels
from mbridge_refit.sinks.broadcast_wire import (
    PackedBroadcastConfig,
    StreamPacking,
    StreamSlot,
    bucket_events,
    completed_views,
    split_pieces,
)

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
        self._status: torch.Tensor | None = None

    @property
    def allocated(self) -> bool:
        return bool(self.buffers)

    def allocate(self) -> None:
        """The buffers (zeroed once, so the padding between tensors is sent as zeros), the checksum
        slots and every piece's destination view; a no-op once allocated."""
        if self.buffers:
            return
        packing, size = self.packing, self.config.bucket_bytes
        count = _buffer_count(self.config, packing)
        buffers = [torch.zeros(size, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self.sums = torch.zeros(max(packing.num_buckets, 1), dtype=torch.int64, device=self.device)
        self.data = [buffers[b % count][: packing.bucket_length(b)] for b in range(packing.num_buckets)]
        self.pieces = [_slot_pieces(slot, size, buffers) for slot in packing.slots]
        self.kernels = BoundedKernels(self.device, self.config.device_programs, slots=packing.num_buckets)
        self.buffers = buffers

    def status(self) -> torch.Tensor:
        """The int64[2] the status all-reduce runs on, zeroed (made once)."""
        if self._status is None:
            self._status = torch.zeros(2, dtype=torch.int64, device=self.device)
            return self._status
        return self._status.zero_()

    def release(self) -> None:
        """Drop the device memory (the next ``allocate`` makes it again)."""
        self.buffers, self.sums, self.data, self.pieces, self._status = [], None, [], [], None
        self.kernels = None


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
    references to those views (``engines.broadcast`` replays recorded copies from them) as long
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
