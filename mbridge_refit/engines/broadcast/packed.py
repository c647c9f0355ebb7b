"""Packed broadcast: non-colocated refit from one trainer rank to inference ranks.

Owns the wire protocol between a :class:`PackedBroadcastSender` (a :class:`WeightSink` on the
source trainer rank) and :class:`PackedBroadcastReceiver` (on each inference rank): the byte
packing of the stream (``StreamPacking``) (computed from the :class:`~mbridge_refit.plan.entries.ExportPlan` alone, so no
per-tensor metadata travels), the header/verdict handshake that makes a plan mismatch fail on
every rank instead of hanging, the rotating buffers that overlap packing with broadcasting, and
the per-bucket checksums (on by default).

Protocol over ``group`` (the source rank plus the receiver ranks; other trainer ranks are not
members): a ``torch.distributed`` group, or a ``engines.broadcast.group.StoreGroup`` that members
of different worlds join by address (a trainer rank and a separately launched inference engine's
workers); ``src`` is the source's rank as the group counts ranks. In this order on every member:

1. handshake: ``broadcast`` of the source's header (int64[8]: magic, version, plan fingerprint,
   stream bytes, bucket bytes, buffers, checksum flag, entry count) from ``src``; then an
   ``all_reduce(MAX)`` of int64[2] ``[mismatch, receiver fingerprint]`` so the source learns
   the verdict too. On a mismatch the source also broadcasts its ``(name, shape, dtype)`` list
   (object broadcast) and a second ``all_reduce(MIN)`` agrees on the first differing entry;
   then every member raises :class:`PlanMismatchError` (:class:`WireVersionError`, naming both
   versions, where a receiver's ``WIRE_VERSION`` is not the header's). No bulk data has moved. The source issues
   its header and goes on packing its first bucket while the receivers come to the handshake; it
   waits for the verdict only before that bucket would go out (or at its finish).
2. bulk: for each bucket ``b`` of ``ceil(stream_bytes / bucket_bytes)``, ``broadcast`` of the
   bucket's bytes (the last one only as long as it is full). With checksums on, each end computes
   every bucket's checksum on its device as the bucket goes out or lands (no host read), and after
   the last bucket the source broadcasts its int64[buckets] checksums (one collective per refit).
3. status: ``all_reduce(MAX)`` of int64[2] ``[status, bucket]``, each receiver's computed on its
   device (its checksums against the source's, first bad bucket); a receiver whose consumer
   failed still runs the remaining bulk broadcasts (discarding them) and reports here, so the
   source raises instead of blocking in a broadcast nobody receives. The status is the one read
   to the host per refit (the handshake's verdict aside).

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

Each end's memory may be kept from one refit to the next (``engines.broadcast.buffers``: the
source's ``SendBuffers``, a receiver's ``ReceiveBuffers``), so a steady refit computes no packing
and allocates nothing. On a receiver bucket ``b`` lands in buffer ``b % num_buffers`` every time
and each tensor is the same view every time, made once, so a consumer can record what it does
with them once and replay it (``engines.broadcast.engine``); ``receive_buckets`` hands a bucket's tensors
over together, right after the bucket landed and before its buffer is posted for bucket
``b + num_buffers``. Per bucket each end issues one broadcast and reads nothing to the host; its
device work (the source's copies and checksum, a receiver's checksum and consumer) is ordered
after the broadcasts it needs by stream waits, never by the host. The source's copies and both
ends' checksums run on a bounded number of GPU programs (``engines.broadcast.bounded_kernels``,
``PackedBroadcastConfig.device_programs``), so they leave the broadcast beside them its memory
bandwidth; there the source's copies sum the bytes they pack (``SendBuffers.checksum``) and a
receiver sums a landed bucket on a stream beside its consumer's copies (``ReceiveBuffers.side``). A ``BucketTimeline``
(``engines.broadcast.timing``) given to either end marks where each bucket's time goes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.engines.broadcast.buffers import ReceiveBuffers, SendBuffers, endpoint
from mbridge_refit.engines.broadcast.group import GroupLike, as_broadcast_group
from mbridge_refit.engines.broadcast.timing import BucketTimeline
from mbridge_refit.engines.broadcast.wire import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_BYTES,
    STATUS_CHECKSUM,
    STATUS_CONSUMER,
    STATUS_OK,
    WIRE_VERSION,
    ChecksumError,
    PackedBroadcastConfig,
    PlanMismatchError,
    RefitStatusError,
    SentHeader,
    StreamPacking,
    WireVersionError,
    check_member,
    check_wire_version,
    checksum,
    flat_bytes,
    handshake,
    hex64,
    plan_fingerprint,
    plan_signature,
    post_failure,
    send_header,
    share_verdict,
)
from mbridge_refit.plan.entries import ExportPlan
from mbridge_refit.sinks.base import WeightSink

# The wire format's and the buffers' public names are re-exported: importers name the packed
# broadcast, one module.
__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "ChecksumError",
    "PackedBroadcastConfig",
    "PackedBroadcastReceiver",
    "PackedBroadcastSender",
    "PlanMismatchError",
    "ReceiveBuffers",
    "RefitStatusError",
    "SendBuffers",
    "StreamPacking",
    "WIRE_VERSION",
    "WireVersionError",
    "check_wire_version",
    "checksum",
    "plan_fingerprint",
    "plan_signature",
    "post_failure",
    "share_verdict",
]

# --- sender ---------------------------------------------------------------------------------


class PackedBroadcastSender(WeightSink):
    """A :class:`WeightSink` that broadcasts the export stream from ``src`` in packed buckets.

    Construct on every trainer rank that iterates the export, at the same time as the receivers
    construct theirs. Only the source rank (``src`` in ``group``) is a member of ``group`` and
    sends (the other trainer ranks may pass ``group=None``); on the other trainer ranks the sender
    only checks the stream against the plan and discards it (``drain(bridge.export_hf_weights(...),
    sender)`` on every trainer rank is the whole recipe; ``for _ in stream: pass`` would do as
    well, without the check).

    The constructor starts the handshake on the source rank (its header's broadcast, over
    ``group``) and returns without waiting for the receivers, so the source packs its first bucket
    while they come. The source takes the verdict before that bucket goes out: in ``consume`` of the
    first tensor with bytes past bucket 0 (``SendBuffers.agree_at``), once that tensor's bytes in
    bucket 0 are packed, or in ``finish``. If any receiver disagrees (or the source's header or
    buffers failed), the tensors after it are only checked against the plan and discarded and
    ``finish`` raises :class:`PlanMismatchError` (or that failure); no bulk data has moved. With
    ``trainer_group`` (the ranks iterating the export, a ``torch.distributed`` group; the source is
    its rank ``trainer_src``, default ``src``) the source's outcome is shared with the other trainer
    ranks in ``finish``, so every trainer raises the same error; the source iterates the collective
    export to its end whatever the verdict, so no rank goes on into it alone. ``on_agreed`` is called
    on the source once the receivers agreed (they are inside their receive), before the first
    bucket goes out. ``finish`` raises :class:`RefitStatusError` if a receiver reported a bad
    checksum or a failed consumer.

    Memory: ``buffers``, the :class:`SendBuffers` of earlier refits of the same plan and config
    (kept by the caller: the packing is not computed again and the device buffers are reused);
    default: made for this refit alone and released at its end. The device buffers are
    ``min(num_buffers, buckets)`` uint8 tensors of ``bucket_bytes`` on ``device`` (default: CUDA's
    current device if available, else CPU), allocated by the source's constructor (before its header goes out) only.

    Overlap, with no host wait: each tensor is copied into its bucket's buffer on the current
    stream (the exporter's: the copy is ordered after the kernels that made the tensor and before
    any that overwrite it, so the exporter may reuse its own buffer as soon as ``consume``
    returns); a full bucket goes out with an asynchronous broadcast (which waits for those copies)
    and its checksum is queued behind it (where the bounded kernels run, the bucket's copies summed its
    bytes as they packed them: ``SendBuffers.checksum``); before a buffer is packed again the current stream waits
    for that buffer's broadcast (``Work.wait``, stream-ordered). With ``n`` buffers, packing bucket
    ``b + 1`` overlaps the broadcast of bucket ``b``, and up to ``n`` broadcasts are in flight; the
    exporter's own kernels wait for a broadcast only through a full set of buffers in flight.
    ``timeline``: a :class:`~mbridge_refit.engines.broadcast.timing.BucketTimeline` marking each
    bucket's phases (benchmarks).

    A stream that disagrees with the sender's own plan, ends early, or raises (``drain`` then
    calls ``abort``) once the handshake started is posted to the group (module docstring), so receivers
    over a ``StoreGroup`` raise too instead of waiting in a broadcast; over a ``TorchGroup`` they
    wait for the group's timeout.
    """

    wire_version = WIRE_VERSION  # the version its header claims (a test's subclass claims another)

    def __init__(
        self,
        plan: ExportPlan | str,
        config: PackedBroadcastConfig,
        *,
        group: GroupLike | None,
        src: int,
        trainer_group: GroupLike | None = None,
        trainer_src: int | None = None,
        device: torch.device | str | None = None,
        buffers: SendBuffers | None = None,
        timeline: BucketTimeline | None = None,
        on_agreed: Callable[[], None] | None = None,
    ) -> None:
        memory = _kept(buffers, plan, config) or SendBuffers(plan, config, device)
        self._memory, self._owns_memory = memory, buffers is None
        self.plan, self.config, self.packing, self.device = memory.plan, config, memory.packing, memory.device
        self.group, self.src = as_broadcast_group(group) if group is not None else None, src
        self.trainer_group = as_broadcast_group(trainer_group) if trainer_group is not None else None
        self.trainer_src = src if trainer_src is None else trainer_src
        self.is_source = self.group is not None and self.group.is_source(src)
        self.timeline = timeline if self.is_source else None
        self._next = 0
        self._closed = False
        self._works: list[Any] = [None] * config.num_buffers  # per buffer: the broadcast last reading it
        self._bucket = -1  # the bucket being packed
        self.bytes_sent = 0
        self.settled = not self.is_source  # the source's protocol is settled once its status (or verdict) is known
        self._abandoned = False
        self._on_agreed = on_agreed
        self._sent_header: SentHeader | None = None
        self._agreed = False  # the source has the handshake's verdict
        # the source's refit refused (its header or buffers failed, or the verdict): the rest of the stream is
        # checked and discarded, and finish raises it (shared with the trainer ranks there, as any outcome)
        self._refused: Exception | None = None
        if self.is_source:
            check_member(self.group)
            if self.timeline is not None:
                self.timeline.start()
            try:
                # the buffers first: nothing then frees device memory (a device-wide wait) while the header's
                # collective waits for the receivers
                memory.allocate()
                self._sent_header = send_header(self)
            except Exception as err:
                self._abandon(err)
                if self.trainer_group is None:
                    raise
                self._refused = err  # raised once the other trainer ranks iterated the collective export too

    # -- WeightSink ------------------------------------------------------------------------

    def consume(self, hf_name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("PackedBroadcastSender.consume() after finish() or abort(); create a new sender")
        try:
            index = self._check(hf_name, tensor)
            self._next += 1
            if not self.is_source or self._refused is not None or not tensor.numel():
                return  # refused: the rest of the collective export is checked and discarded; finish raises it
            if index == self._memory.agree_at:
                self._refused = self._pack_around_verdict(index, tensor)
                return
            data = flat_bytes(tensor)
            for bucket, target, start, length in self._memory.pieces[index]:
                if bucket != self._bucket:
                    self._enter(bucket)
                self._memory.pack(bucket, target, data if length == data.numel() else data[start : start + length])
        except BaseException as err:
            self._abandon(err)
            raise

    def finish(self) -> None:
        if self._closed:
            raise RuntimeError("PackedBroadcastSender.finish() called twice or after abort()")
        self._closed = True
        if self._next != len(self.packing.slots):
            missing = [s.entry.hf_name for s in self.packing.slots[self._next :]]
            error = ValueError(
                f"the export stream ended after {self._next} of {len(self.packing.slots)} planned tensors; "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
            self._note_refusal(error)
            self._abandon(error)
            raise error
        error: BaseException | None = None
        if self.is_source:
            if self._refused is None and not self._agreed:
                self._refused = self._agree()
            error = self._refused
            try:
                if error is None:
                    error = self._finish_source()
                    self.settled = True
            except BaseException as err:
                self._abandon(err)
                raise
        if self.trainer_group is not None:
            share_verdict(self.trainer_group, self.trainer_src, error, self.device)
        elif error is not None:
            raise error

    def abort(self) -> None:
        """Drop the buffers (kept ones too when the protocol did not settle: broadcasts may still read
        them); on the source, in the middle of the protocol, post the error being handled (``drain``
        calls this from its ``except``) so the receivers raise too."""
        self._closed = True
        if self._owns_memory or not self.settled:
            self._memory.release()
        error = sys.exc_info()[1]
        if error is not None:
            self._note_refusal(error)
        self._abandon(error if error is not None else RuntimeError("the sender was aborted"))

    def _note_refusal(self, error: BaseException) -> None:
        """An export that failed after the handshake refused the refit: say so on its error too (once)."""
        note = f"the handshake had refused this refit before: {type(self._refused).__name__}: {self._refused}"
        if self._refused is not None and error is not self._refused and note not in getattr(error, "__notes__", ()):
            error.add_note(note)

    def _abandon(self, error: BaseException) -> None:
        """Post ``error`` once, if this is the source and its protocol is not settled."""
        if self.is_source and not self.settled and not self._abandoned:
            self._abandoned = True
            post_failure(self.group, "the packed-broadcast source", error)

    # -- internals -------------------------------------------------------------------------

    def _agree(self) -> Exception | None:
        """The source's handshake verdict, once per refit, before the first bucket goes out (at
        ``SendBuffers.agree_at`` or in ``finish``): the refusal ``finish`` raises (``PlanMismatchError``,
        or the failure that stopped the handshake), or None."""
        self._agreed = True
        error = None
        try:
            handshake(self, is_source=True, sent=self._sent_header)
        except PlanMismatchError as err:
            error, self.settled = err, True
        except Exception as err:
            self._abandon(err)
            error = err
        self._sent_header = None
        if error is None:
            if self.timeline is not None:
                self.timeline.host("handshake")
            if self._on_agreed is not None:
                self._on_agreed()
        return error

    def _check(self, hf_name: str, tensor: torch.Tensor) -> int:
        """The plan index of ``tensor``, which must be the plan's next entry (name, shape, dtype)."""
        index = self._next
        expected = self._memory.expected
        if index >= len(expected):
            raise ValueError(
                f"the export stream has more tensors than the plan ({len(expected)}); "
                f"unexpected {hf_name!r}: build the sender from this export's plan (bridge.export_plan(model))"
            )
        name, shape, dtype = expected[index]
        if hf_name != name or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"export stream differs from the plan at entry #{index}: got {hf_name} {list(tensor.shape)} "
                f"{tensor.dtype}, plan has {name} {list(shape)} {dtype}; build the sender from "
                "this export's plan (bridge.export_plan(model))"
            )
        return index

    def _pack_around_verdict(self, index: int, tensor: torch.Tensor) -> Exception | None:
        """The source's ``consume`` of the entry at ``agree_at``: its bytes in bucket 0 packed (so the whole
        bucket is ready when the verdict comes), then the verdict (``_agree``), then its other bytes. The
        refusal, or None."""
        data = flat_bytes(tensor)
        for bucket, target, start, length in self._memory.pieces[index]:  # one has bytes past bucket 0
            if bucket > 0 and not self._agreed and (refused := self._agree()) is not None:
                return refused
            if bucket != self._bucket:
                self._enter(bucket)
            self._memory.pack(bucket, target, data if length == data.numel() else data[start : start + length])
        return None

    def _enter(self, bucket: int) -> None:
        """Make ``bucket`` the one being packed, sending every earlier bucket first."""
        while self._bucket < bucket:
            if self._bucket >= 0:
                self._send(self._bucket)
            self._bucket += 1
            self._acquire(self._bucket)

    def _acquire(self, bucket: int) -> None:
        """The current stream waits until the broadcast that last read ``bucket``'s buffer ended."""
        index = bucket % len(self._memory.buffers)
        work, self._works[index] = self._works[index], None
        if work is not None:
            work.wait()  # on CUDA: the current stream waits for the broadcast; the host does not
        if self.config.checksum:
            self._memory.start_bucket(bucket)
        if self.timeline is not None:
            self.timeline.mark("free", bucket)

    def _send(self, bucket: int) -> None:
        if not self._agreed:
            raise AssertionError("a bucket would go out before the handshake's verdict (SendBuffers.agree_at)")
        memory, timeline = self._memory, self.timeline
        data = memory.data[bucket]
        if timeline is not None:
            timeline.mark("packed", bucket)
        work = self.group.broadcast(data, self.src, async_op=True)
        self._works[bucket % len(memory.buffers)] = work
        if timeline is not None:
            timeline.host("issued", bucket)
            timeline.completion("sent", bucket, work)
        if self.config.checksum:  # beside the broadcast (both only read), before the buffer is packed again
            memory.checksum(bucket)
            if timeline is not None:
                timeline.mark("summed", bucket)
        self.bytes_sent += data.numel()

    def _finish_source(self) -> BaseException | None:
        last = self.packing.num_buckets - 1
        if last >= 0:
            self._enter(last)
            self._send(last)
        for index, work in enumerate(self._works):
            if work is not None:
                work.wait()
                self._works[index] = None
        if self.config.checksum:
            self.group.broadcast(self._memory.sums, self.src, async_op=True).wait()
        status = self._memory.status()
        self.group.all_reduce(status, dist.ReduceOp.MAX)
        code, bucket = (int(v) for v in status.tolist())
        if self.timeline is not None:
            self.timeline.host("status")
        if self._owns_memory:
            self._memory.release()
        if code == STATUS_OK:
            return None
        if code == STATUS_CHECKSUM:
            return RefitStatusError(
                f"a receiver found a checksum mismatch in buffer {bucket} (tensors {self.packing.names_in(bucket)}); "
                "the receivers' weights are not trustworthy: run the refit again"
            )
        return RefitStatusError("a receiver's consumer failed while applying the weights (see the receiver's log)")


def _kept(
    buffers: SendBuffers | ReceiveBuffers | None, plan: ExportPlan | str, config: PackedBroadcastConfig
) -> SendBuffers | ReceiveBuffers | None:
    """``buffers`` if given and made for ``plan`` (the same object) and ``config``; raises otherwise."""
    if buffers is None:
        return None
    if buffers.plan is not plan or buffers.config != config:
        raise ValueError(
            f"`buffers` were made for another plan or config: make {type(buffers).__name__}(plan, config, device) "
            "from the plan object and config this end is given"
        )
    return buffers


# --- receiver -------------------------------------------------------------------------------


class PackedBroadcastReceiver:
    """Receives a packed broadcast and yields ``(hf_name, tensor)`` in plan order.

    Construct on each receiver rank, with the sender's plan (an :class:`ExportPlan` or its JSON)
    and the same :class:`PackedBroadcastConfig`; the constructor runs the handshake (collective
    over ``group``) and raises :class:`PlanMismatchError` naming both fingerprints and the first
    differing entry. Then iterate :meth:`receive` (or ``drain(receiver.receive(), sink)``), or
    :meth:`receive_buckets` for the tensors one bucket at a time.

    ``buffers``: the :class:`ReceiveBuffers` of earlier refits of the same plan and config (their
    memory and views are reused, and the plan is not parsed again); default: allocated for this
    refit alone.

    Tensor lifetime: each yielded tensor is a view of a receive buffer (or of one scratch tensor
    for a tensor split across buffers) and is valid until the generator advances past its bucket
    (:meth:`receive`: until it advances; :meth:`receive_buckets`: until the next bucket); copy it
    to keep it. ``num_buffers - 1`` buckets are in flight while one is consumed.

    With checksums on, each bucket's checksum is computed on the device as it arrives (the method
    ``_checksum(bucket, data)``: a subclass may extend it, the CPU fault tests corrupt a bucket there
    first; on CUDA it runs on a stream beside the consumer's, so the consumer must not write into the
    tensors it is handed, and a write in ``_checksum`` races with the consumer's reads) and compared
    with the sender's after the last bucket, with no host read per bucket: a
    mismatch raises :class:`ChecksumError` naming the first bad bucket and its tensors once the
    protocol ended (the sender raises too). The bucket's tensors have been yielded by then: a
    refit that raises leaves its consumer's weights untrustworthy, as any failed refit does.
    """

    wire_version = WIRE_VERSION  # the version it expects of the header (a test's subclass expects another)

    def __init__(
        self,
        plan: ExportPlan | str,
        config: PackedBroadcastConfig,
        *,
        group: GroupLike,
        src: int,
        device: torch.device | str | None = None,
        buffers: ReceiveBuffers | None = None,
        timeline: BucketTimeline | None = None,
    ) -> None:
        if _kept(buffers, plan, config) is None:
            self.plan, self.config, self.packing, self.device = endpoint(plan, config, device)
        else:
            self.plan, self.config, self.packing, self.device = buffers.plan, config, buffers.packing, buffers.device
        self.group, self.src = as_broadcast_group(group), src
        self.timeline = timeline
        self._buffers = buffers
        self._memory: ReceiveBuffers | None = None  # this refit's (``buffers``, or its own)
        self._used = False
        self.settled = False  # the protocol ended in a state every member knows (module docstring)
        check_member(self.group)
        if self.group.is_source(src):
            raise ValueError(f"rank {src} is the source of the broadcast; construct PackedBroadcastSender there")
        if timeline is not None:
            timeline.start()
        try:
            handshake(self, is_source=False)
        except PlanMismatchError:
            self.settled = True
            raise
        except BaseException as err:
            post_failure(self.group, "a packed-broadcast receiver", err)
            raise
        if timeline is not None:
            timeline.host("handshake")

    def _checksum_beside(self, bucket: int, data: torch.Tensor) -> None:
        """``_checksum`` of the landed bucket, on CUDA on the buffers' side stream (``ReceiveBuffers.side``),
        after what the current stream queued: beside the consumer's copies that follow."""
        side, timeline = self._memory.side, self.timeline
        if side is None:
            self._checksum(bucket, data)
        else:
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._checksum(bucket, data)
                if timeline is not None:
                    timeline.mark("summed", bucket)
            return
        if timeline is not None:
            timeline.mark("summed", bucket)

    def _checksum(self, bucket: int, data: torch.Tensor) -> None:
        """Queue the checksum of received bucket ``data`` into its slot (no host read)."""
        self._memory.kernels.checksum_into(data, self._memory.sums[bucket], bucket)

    def _checksum_report(self) -> torch.Tensor:
        """``[STATUS_CHECKSUM, first bad bucket]`` if a received bucket's checksum differs from the
        sender's, else ``[STATUS_OK, 0]``, computed on the device."""
        memory = self._memory
        bad = memory.sums != memory.sent_sums
        found = bad.any().to(torch.int64)
        return torch.stack([found * STATUS_CHECKSUM, found * bad.to(torch.int64).argmax()])

    def _checksum_error(self, bucket: int) -> ChecksumError:
        packing, memory = self.packing, self._memory
        local, sent = int(memory.sums[bucket]), int(memory.sent_sums[bucket])
        return ChecksumError(
            f"checksum mismatch in packed-broadcast buffer {bucket} of {packing.num_buckets} "
            f"(sender {hex64(sent)}, received {hex64(local)}); it held tensors {packing.names_in(bucket)}. "
            "The transfer is corrupt: run the refit again"
        )

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Run the bulk broadcasts and yield every tensor of the plan (once per receiver)."""
        return _each_tensor(self.receive_buckets())

    def receive_buckets(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        """Run the bulk broadcasts and yield ``(bucket, its tensors)`` for every bucket, in order:
        the tensors whose last byte is in that bucket (once per receiver)."""
        if self._used:
            raise RuntimeError("PackedBroadcastReceiver.receive() runs once; construct a new receiver per refit")
        self._used = True
        return self._receive()

    def _receive(self) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
        packing, config = self.packing, self.config
        try:
            memory = self._memory = self._buffers or ReceiveBuffers(self.plan, config, self.device)
        except BaseException as err:  # e.g. out of memory: the sender is about to broadcast
            post_failure(self.group, "a packed-broadcast receiver", err)
            raise
        data, timeline = memory.data, self.timeline
        works: dict[int, Any] = {}

        def post(bucket: int) -> None:
            if bucket < packing.num_buckets:
                works[bucket] = self.group.broadcast(data[bucket], self.src, async_op=True)
                if timeline is not None:
                    timeline.host("issued", bucket)
                    timeline.completion("received", bucket, works[bucket])

        next_post, at_yield = 0, False
        try:
            for _ in memory.buffers:
                post(next_post)
                next_post += 1
            for bucket in range(packing.num_buckets):
                works.pop(bucket).wait()  # on CUDA: the current stream waits for the broadcast; the host does not
                if timeline is not None:
                    timeline.mark("landed", bucket)
                if config.checksum:
                    self._checksum_beside(bucket, data[bucket])
                completing, continuing = memory.pieces[bucket]
                for piece, received in completing:
                    piece.copy_(received)
                at_yield = True
                yield bucket, memory.tensors[bucket]
                at_yield = False
                for piece, received in continuing:
                    piece.copy_(received)
                if timeline is not None:
                    timeline.mark("consumed", bucket)
                if config.checksum and memory.side is not None:  # the checksum beside ended too
                    torch.cuda.current_stream(self.device).wait_stream(memory.side)
                post(next_post)  # this bucket's buffer is free again
                next_post += 1
        except BaseException as err:
            if not at_yield:  # a collective or a copy failed: the protocol is broken, run no more collectives
                if config.checksum and memory.side is not None:  # no checksum left writing into memory about to go
                    torch.cuda.current_stream(self.device).wait_stream(memory.side)
                post_failure(self.group, "a packed-broadcast receiver", err)
                raise
            self._finish_protocol(works, post, next_post, STATUS_CONSUMER)  # the consumer raised or stopped early
            raise
        self._finish_protocol(works, post, next_post, STATUS_OK)

    def _finish_protocol(self, works: dict[int, Any], post, next_post: int, status: int) -> None:
        """Steps 3 and 4: after a local failure, run the remaining bulk broadcasts (data discarded)
        so the sender is not left blocked; receive the sender's checksums; report the status to
        every member. Raises ``ChecksumError`` if a bucket's checksum differed."""
        checksum_on = self.config.checksum
        try:
            if self._memory.side is not None:  # checksums still reading a buffer end before it is posted again
                torch.cuda.current_stream(self.device).wait_stream(self._memory.side)
            if status != STATUS_OK:
                for bucket in sorted(works):
                    works.pop(bucket).wait()
                for bucket in range(next_post, self.packing.num_buckets):
                    post(bucket)
                    works.pop(bucket).wait()
            if checksum_on:  # ordered before the comparison on the device; the status below is the host's one wait
                self.group.broadcast(self._memory.sent_sums, self.src, async_op=True).wait()
            if checksum_on and status == STATUS_OK:
                mine = self._checksum_report()
            else:
                mine = torch.tensor([status, 0], dtype=torch.int64, device=self.device)
            report = mine.clone()
            self.group.all_reduce(report, dist.ReduceOp.MAX)
            code, bucket = (int(v) for v in mine.tolist()) if checksum_on else (status, 0)
            if self.timeline is not None:
                self.timeline.host("status")
        except BaseException as err:
            post_failure(self.group, "a packed-broadcast receiver", err)
            raise
        self.settled = True
        if code == STATUS_CHECKSUM:
            raise self._checksum_error(bucket)


def _each_tensor(
    buckets: Iterator[tuple[int, list[tuple[str, torch.Tensor]]]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' tensors one by one; closing this closes the buckets' generator (the receiver
    then reports the consumer's failure, as if it had stopped at the bucket)."""
    try:
        for _, tensors in buckets:
            yield from tensors
    finally:
        buckets.close()
