"""The broadcast transport's engine side, engine-agnostic: join the group, receive each refit, apply it.

The trainer side is an engine adapter's ``broadcast`` session (``engines.base``; for vLLM
``engines.vllm.VLLMBroadcastRefit``): one trainer rank sends the
export by the packed broadcast (``engines.broadcast.packed``) over a ``StoreGroup`` that the engine's
workers join by address (``engines.broadcast.group``), so the engine may run on other GPUs, other
hosts, and in a ``torch.distributed`` world of its own. Every worker receives every tensor; the
engine's own ``load_weights`` decides where it lands (each worker takes its shard, as with vLLM's
native weight transfer).

Recorded once, replayed after (``engines.replay.apply_plan``, as the colocated transport does). The
receive buffers (``ReceiveBuffers``) live as long as the session, bucket ``b`` always lands in
buffer ``b % num_buffers`` and a tensor split across buckets in one scratch, so each tensor is the
same view of the same memory every refit. The session's first refit hands each received tensor
to the loader, one per call, recording its copies (``LoadRecording``); after each bucket its
copies are proven against the loader (``LoadRecording.check``: loader and replay each rerun from
scribbled parameters, bit for bit) while the bucket's bytes are still there, and compiled into one
replay (one ``torch._foreach_copy_`` per run of copies into disjoint memory). Every later refit
runs bucket ``b``'s replay right after ``b`` lands and before the receiver posts bucket
``b + num_buffers`` into the same buffer: no loader, no name parsing, no per-tensor Python. A
tensor the loader reads through a temporary (a conversion, an in-place op) or writes no parameter
from (names the engine skips) goes through the loader every refit, logged with the reason; a
write the recorder cannot see fails the check on both sides. A parameter reallocated since the
recording, or a loader replaced (``load_weights`` set anew), records again.

Protocol (any RPC that carries plain data calls these, on every worker):

1. ``BroadcastTarget(load_weights, model, device, ...)`` then ``join(host, port, rank, world_size,
   plan_json, config, secret, wire_version)``: once per session; refuses a trainer of another
   ``WIRE_VERSION`` by name before it connects; returns when every member joined (the trainer joins
   at the same time: the call blocks until it does, or raises after the timeout). ``secret``: the
   group's, in hex, as the trainer sent it (never logged, never in the store).
2. ``receive()``: every step, at the time the trainer sends. Runs the whole broadcast protocol
   (handshake, buckets, checksums, status), so a mismatch or a failure on either side raises on
   both and neither is left waiting: a failure that stops this worker before its protocol settled
   (the plan does not parse, a receive buffer does not fit, a collective fails) is posted to the
   group, and the trainer raises it within seconds (``engines.broadcast.group``); a loader or a
   check failing in a bucket is reported by the protocol's status. Returns the report: tensors,
   bytes, what the engine did not load, ``mode`` ("recorded", "replayed", or "loader").
3. ``close()``: leaves the group, frees the receive buffers and forgets the recording.

Loading under a reload bracket (``StagedLoad``: vLLM's layerwise reload, which FP8 engines need
so their loaders write the e4m3 data and scales and their layers are processed again) keeps
references to the loaded tensors until each layer is complete, so there each received tensor is
copied first (the copies live until the layer is processed) and every tensor goes through the
loader every refit (``mode`` "loader"): recording through the reload would need the sources of a
whole layer alive at once, which streamed buffers do not keep.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mbridge_refit.engines.broadcast.group import StoreGroup
from mbridge_refit.engines.broadcast.packed import (
    PackedBroadcastConfig,
    PackedBroadcastReceiver,
    PlanMismatchError,
    ReceiveBuffers,
    check_wire_version,
    post_failure,
)
from mbridge_refit.engines.broadcast.timing import BucketTimeline, receiver_phases
from mbridge_refit.engines.replay.apply_plan import ApplyPlan, LoadRecording, LoadWeights, StagedLoad
from mbridge_refit.errors import EngineError

__all__ = ["SOURCE_RANK", "BroadcastRefitError", "BroadcastTarget", "ReceiveReport"]

logger = logging.getLogger(__name__)

SOURCE_RANK = 0  # the trainer's rank in the group; workers are 1..world_size-1


class BroadcastRefitError(EngineError):
    """A broadcast refit the engine cannot apply as asked (names the problem and the fix)."""


@dataclass
class ReceiveReport:
    """What one ``receive`` did (plain data, returned to the trainer)."""

    tensors: int
    bytes: int
    unloaded: list[str]  # engine parameters the loader did not report as loaded (when it reports)
    receive_ms: float
    mode: str  # "recorded" (the loader, its copies recorded and proven), "replayed", or "loader" (every tensor)
    via_loader: int  # tensors that went through the engine's loader
    phases: dict[str, Any] | None = None  # with ``timing``: each bucket's marks and phases (engines.broadcast.timing)


class BroadcastTarget:
    """One engine worker's end of a broadcast refit (module docstring).

    ``load_weights``: the engine's loader (``model.load_weights``); if it returns the names it
    loaded (vLLM's do), parameters it left out are reported, and fail the step unless
    ``allow_partial``. ``model``: the engine's module, whose parameters that report is about and
    whose parameters the recorded copies write. ``staged``: the engine's reload bracket (FP8
    engines): every tensor through the loader inside it, every refit. ``check``: prove each
    bucket's recorded copies against the loader before trusting them (default; off only to
    measure what the proof costs, once per session). ``timing``: mark where each bucket's time
    goes (``engines.broadcast.timing``), returned in the report's ``phases`` (benchmarks; settable
    between refits).
    """

    def __init__(
        self,
        load_weights: LoadWeights,
        model: torch.nn.Module,
        device: torch.device | str,
        *,
        staged: StagedLoad | None = None,
        allow_partial: bool = False,
        check: bool = True,
        timing: bool = False,
    ) -> None:
        self.load_weights, self.model, self.device = load_weights, model, torch.device(device)
        self.staged, self.allow_partial, self.check, self.timing = staged, allow_partial, check, timing
        self.group: StoreGroup | None = None
        self.plan_json: str | None = None
        self.config: PackedBroadcastConfig | None = None
        self._memory: ReceiveBuffers | None = None  # kept across the session's refits
        self._memory_for: tuple = ()
        self._bytes = 0  # the tensors' bytes in a refit
        self._plan: ApplyPlan | None = None  # the loader's copies, recorded from views of self._memory
        self._replays: list = []  # each bucket's replay (LoadRecording.check), by bucket
        self._unloaded_now: list[str] = []

    def join(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        plan_json: str,
        config: dict,
        secret: str | None = None,
        wire_version: int | None = None,
        backend: str | None = None,
        timeout_s: float = 600.0,
        **newer: Any,
    ) -> int:
        """Join the trainer's group as ``rank``; keep the plan and the buffer config for every step.
        ``wire_version``: the trainer's ``WIRE_VERSION`` (None: a trainer from before it was sent),
        refused by name unless it is this one's, before any other argument is looked at (``newer``:
        what a trainer of another version may send); ``secret``: the group's secret in hex."""
        check_wire_version(wire_version, "the trainer")
        if newer:
            raise BroadcastRefitError(f"the trainer sent join arguments this worker does not know: {sorted(newer)}")
        if secret is None:
            raise BroadcastRefitError("the trainer sent no group secret: every member of a broadcast group needs it")
        if not SOURCE_RANK < rank < world_size:
            raise BroadcastRefitError(
                f"worker rank {rank} is outside 1..{world_size - 1}: rank {SOURCE_RANK} is the trainer's"
            )
        self.close()
        self.config = PackedBroadcastConfig(**config)
        self.plan_json = plan_json
        self.group = StoreGroup(
            host=host,
            port=port,
            rank=rank,
            world_size=world_size,
            device=self.device,
            secret=bytes.fromhex(secret),
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        logger.info(
            "broadcast refit: joined %s:%d as rank %d of %d (%s)", host, port, rank, world_size, self.group.backend
        )
        return rank

    def receive(self) -> dict[str, Any]:
        """Receive one refit and load it (module docstring); collective with the trainer's send."""
        if self.group is None:
            raise BroadcastRefitError("no broadcast group: call join() before receive()")
        started = time.perf_counter()
        receiver, timeline = None, BucketTimeline(self.device) if self.timing else None
        try:
            memory = self._receive_buffers()
            receiver = PackedBroadcastReceiver(
                memory.plan,
                self.config,
                group=self.group,
                src=SOURCE_RANK,
                device=self.device,
                buffers=memory,
                timeline=timeline,
            )
            mode = self._apply(receiver, memory)
            self.group.synchronize()  # watched: a load waiting for a broadcast whose sender failed ends
        except BaseException as err:
            if not isinstance(err, PlanMismatchError) and (receiver is None or not receiver.settled):
                # the trainer may still wait in the protocol (a plan mismatch is settled by the handshake)
                post_failure(self.group, f"engine worker {self.group.rank}", err)
            raise
        report = ReceiveReport(
            tensors=len(memory.packing.slots),
            bytes=self._bytes,
            unloaded=self._unloaded_now,
            receive_ms=(time.perf_counter() - started) * 1e3,
            mode=mode,
            via_loader=len(self._plan.via_loader) if self._plan is not None else len(memory.packing.slots),
            phases=_phases(timeline, self.config.num_buffers),
        )
        if report.unloaded and not self.allow_partial:
            raise BroadcastRefitError(
                f"the refit left {len(report.unloaded)} engine parameters unloaded, e.g. {report.unloaded[:4]}: the "
                "trainer's export does not cover this engine's model (another model or a subset); pass "
                "allow_partial=True for a subset refit"
            )
        return asdict(report)

    def _receive_buffers(self) -> ReceiveBuffers:
        """The session's receive buffers; made again (and the recording dropped) when the plan or config changed."""
        memory = self._memory
        if memory is None or self._memory_for != (self.plan_json, self.config):
            self._memory = self._plan = None  # free the old buffers first
            memory = ReceiveBuffers(self.plan_json, self.config, self.device)
            self._memory, self._memory_for = memory, (self.plan_json, self.config)
            self._bytes = sum(slot.nbytes for slot in memory.packing.slots)
        return memory

    def _apply(self, receiver: PackedBroadcastReceiver, memory: ReceiveBuffers) -> str:
        """Load the received refit: replay the recorded copies bucket by bucket, or record them
        (the first refit, or the engine moved a parameter the plan writes), or, under a reload
        bracket, hand every tensor to the loader. Returns which it did."""
        if self.staged is not None:
            self._unloaded_now = self._load(receiver.receive())
            return "loader"
        stale = self._stale()
        buckets = receiver.receive_buckets()
        try:
            if self._plan is not None and not stale:
                for bucket, _ in buckets:
                    self._replays[bucket]()
                return "replayed"
            self._plan = None
            self._record(buckets, memory)
            return "recorded"
        except BaseException:
            buckets.close()  # stopped at a bucket: the receiver runs the protocol to its end, reporting the failure
            raise

    def _stale(self) -> bool:
        """Whether the recorded copies no longer describe the engine: a parameter they write was
        reallocated, or the loader they were recorded from was replaced (``load_weights`` set anew)."""
        if self._plan is None:
            return False
        if self._plan.load_weights is not self.load_weights:
            logger.warning(
                "broadcast refit: the engine's loader was replaced since it was recorded: recording it again"
            )
            return True
        return self._plan.reallocated(self.model)

    def _record(self, buckets: Iterator[tuple[int, list[tuple[str, torch.Tensor]]]], memory: ReceiveBuffers) -> None:
        """This refit loaded through the engine's loader, one tensor at a time, its copies recorded
        and each bucket's proven (``check``) before its buffer is received into again."""
        recording = LoadRecording(self.model, memory.storages(), self.load_weights)
        replays = []
        for _, tensors in buckets:
            loaded = [recording.load(name, tensor) for name, tensor in tensors]
            unwritten = [step for step in loaded if not step.wrote]  # e.g. names the engine skips: as they were
            recording.load_every_step(unwritten, "the engine's loader wrote no parameter from it")
            replays.append(recording.check(loaded) if self.check else recording.replayer(loaded))
        plan = recording.finish()
        if plan.via_loader:
            logger.info(
                "broadcast refit: %d tensor(s) go through the engine's loader every step, e.g. %s",
                len(plan.via_loader),
                [f"{s.name} ({s.reason})" for s in plan.steps if s.via_loader][:3],
            )
        loaded = recording.loaded
        self._unloaded_now = self._unloaded(loaded) if loaded is not None else []
        self._plan, self._replays = plan, replays

    def _load(self, stream: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
        """Feed the received stream to the engine's loader inside its reload bracket; the parameters
        it left unloaded."""
        copied = _Copied(stream)
        try:
            with self.staged.around():
                copied.loaded = self.load_weights(copied)
            copied.drain()  # a loader that stops early still runs the protocol to its end
        except BaseException:
            stream.close()  # stopped at a tensor: the receiver runs the protocol to its end, reporting the failure
            raise
        loaded = copied.loaded
        return self._unloaded(loaded) if isinstance(loaded, (set, frozenset)) else []

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.plan_json, self.config = None, None, None
        self._memory, self._plan, self._replays = None, None, []

    def _unloaded(self, loaded: set[str]) -> list[str]:
        """Parameters (by identity, under any of their names) no loaded name reaches. A loader may
        name parameters as they were when it was written (an engine that moves a layer's
        parameters into a submodule after loading, as vLLM's fused experts do): names it returns
        that are no parameter of the model now make the report unknowable, and it is skipped."""
        every_name = dict(self.model.named_parameters(remove_duplicate=False))
        unknown = sorted(name for name in loaded if name not in every_name)
        if unknown:
            logger.warning(
                "broadcast refit: the loader reports %d names the model has no parameter of (e.g. %s): "
                "unloaded parameters cannot be told",
                len(unknown),
                unknown[:2],
            )
            return []
        reached = {id(every_name[name]) for name in loaded}
        return sorted(name for name, param in self.model.named_parameters() if id(param) not in reached)


def _phases(timeline: BucketTimeline | None, buffers: int) -> dict[str, Any] | None:
    """This receive's marks and phases (``engines.broadcast.timing``), or None untimed."""
    if timeline is None:
        return None
    marks = timeline.summary()
    return {**marks, "phases": receiver_phases(marks, buffers)}


class _Copied:
    """The received stream as the loader reads it under a reload bracket: each tensor copied first."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.stream = stream
        self.loaded: Any = None  # what the loader returned

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.stream:
            yield name, tensor.clone()

    def drain(self) -> None:
        for _ in self:
            pass
