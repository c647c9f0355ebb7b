"""The broadcast transport's trainer side, engine-agnostic: ``BroadcastSession`` (transport ``broadcast``).

The engine runs on other GPUs or hosts. The source trainer rank and every worker of the engine form
a ``StoreGroup`` (NCCL; joined by address, so the engine keeps its own ``torch.distributed`` world);
every step the export is packed into rotating buffers and broadcast bucket by bucket
(``engines.broadcast.packed``: a plan handshake first, checksums optional, a status at the end, so a
mismatch or a failure on either side raises on both and no rank waits forever); each worker loads
what it receives through the model's own loader, recorded once and replayed (engine side
``engines.broadcast.engine.BroadcastTarget``). The four phases of a native weight transfer such as vLLM's
(init, start, update, finish) map to ``open`` (the group, once) and ``refit`` (start, update and
finish, in one call on each side).

Who calls it: an engine adapter's ``broadcast`` session (for vLLM ``engines.vllm.VLLMBroadcastRefit``,
a subclass) binds what is its engine's, on the source rank only: ``call_workers(method, *args)`` (the
RPC to every worker, waited for: leaving the group; bounded by the adapter's timeout),
``start_workers(method, *args)`` (the same RPC started in the background, since the workers' side of
joining and receiving runs while this rank takes part in the same collective: a ``WorkerCall``, or
any handle with its ``result`` / ``error`` / ``failure``; default: ``call_workers`` on a thread),
``ignored(bridge)`` (names the engine skips; they are sent anyway, and logged) and
``after_weights_written`` (the engine's follow-up to the new weights, such as vLLM's prefix-cache
reset; its failure fails the step on every trainer rank). The trainer then, on every trainer rank of the model's groups:
``open(bridge, model)`` once (``source=True`` on exactly one rank, the one holding the engine's
handle) and ``refit(bridge, model)`` each step (the export is collective; the other ranks only take
part in it), ``close()`` at the end.

The packed broadcast's memory (``SendBuffers``: the stream packing and, on the source, the
rotating buffers) is made at the session's first refit and kept until ``close``, so a steady
refit computes no packing and allocates nothing. ``timing=True`` (benchmarks) marks where each
bucket's time goes on the source (``engines.broadcast.timing``), returned in ``RefitStep.phases``.

The follow-up is started on a thread of its own as soon as the handshake's verdict shows the workers
inside their receive (the sender's ``on_agreed``, before the first bucket goes out) (``overlap_follow_up``, on by default), so it waits in the engine's queue, or runs,
while the buckets go out instead of costing its own round trip after them; the step still returns
only once both are done. That needs an engine for which the follow-up may come before the weights
have landed as long as nothing runs between: true of a cache reset during a refit, which runs
between generations. vLLM's engine core in its own process runs calls in the order they come, so
there the reset runs right after the receive; an engine core inside the trainer's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) runs it on the follow-up's thread beside the receive, which
it does not touch. A step whose receive or export fails may still have reset the cache (harmless:
the next refit resets it again); it does not wait for a follow-up still pending, which ends on its
own thread, and notes it on the step's error. ``overlap_follow_up=False`` calls the follow-up
after the receive, as before.

Each ``open`` makes the group a fresh secret (``engines.broadcast.group.new_secret``) and sends it
to the workers in the join RPC with the plan, the config and ``WIRE_VERSION`` (a worker of another
version refuses the join by name): the store's entries are signed with it, and a process that
reaches the store without it cannot forge a member's settings, heartbeat or failure
(``engines.broadcast.group``; docs/architecture.md states what it can still do).

``timeout_s`` bounds the join and every collective of both sides. A failure on either side reaches
the other within seconds (``engines.broadcast.group``): each side posts what stops it before its
protocol settled, and the source also treats the workers' background call ending in an error while
it still waits as the engine's failure. After such a failure the group is closed for good:
``close()`` and ``open()`` again.

The group's members must run NCCL with the same ``NCCL_*`` settings (``engines.broadcast.group``
checks them when the group forms): an engine that sets some in its workers (vLLM's batch-invariant
mode: one channel, the Simple protocol, ...) needs the same in the trainer's environment before its
first NCCL call.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from mbridge_refit.engines.base import RPC_VERSION, CallWorkers, RefitStep
from mbridge_refit.engines.broadcast.engine import SOURCE_RANK
from mbridge_refit.engines.broadcast.group import (
    PEER_SILENT_S,
    PeerFailedError,
    StoreGroup,
    as_broadcast_group,
    new_secret,
)
from mbridge_refit.engines.broadcast.packed import (
    WIRE_VERSION,
    PackedBroadcastConfig,
    PackedBroadcastSender,
    PlanMismatchError,
    RefitStatusError,
    SendBuffers,
    post_failure,
    share_verdict,
)
from mbridge_refit.engines.broadcast.timing import BucketTimeline, source_phases
from mbridge_refit.engines.worker_call import StartWorkers, WorkerCall, WorkerCallHandle, on_a_thread
from mbridge_refit.runtime.weight_source import ExportsWeights, Model
from mbridge_refit.sinks.base import DiscardSink, drain

__all__ = [
    "BroadcastSession",
    "StartWorkers",
    "WorkerCall",
    "WorkerCallHandle",
    "on_a_thread",
]

logger = logging.getLogger(__name__)


class BroadcastSession:
    """A broadcast refit session from the trainer ranks into one engine (module docstring).

    Args:
        call_workers: the RPC to every worker, waited for (source rank only; None elsewhere).
        start_workers: the RPC started in the background (``StartWorkers``; default: ``call_workers``
            on a thread, ``WorkerCall``).
        host, port: where the source rank hosts the group's store (reachable by the engine).
        engine_workers: how many workers the engine has (its tensor x pipeline x data parallel size).
        source: whether this rank sends (exactly one trainer rank); the others take part in the export.
        trainer_group: the ``torch.distributed`` group of the ranks iterating the export, with
            ``trainer_src`` the source's rank as that group's collectives name it (a global rank for a
            ``torch.distributed`` group): the source's outcome is shared with them.
        config: the packed broadcast's buffers (``PackedBroadcastConfig``).
        backend: the group's backend (default NCCL; ``"gloo"`` carries CUDA tensors through host
            memory, e.g. trainer and engine on one GPU, which NCCL refuses).
        allow_partial: accept a refit that leaves engine parameters unloaded (a subset).
        ignored: exported names the engine skips, for a bridge (sent anyway; logged at ``open``).
        after_weights_written: the engine's follow-up, on the source: started once the workers are in
            their receive (``overlap_follow_up``) or called after it.
        overlap_follow_up: start the follow-up while the buckets go out (module docstring).
        timing: mark each bucket's phases on the source (``RefitStep.phases``; benchmarks).
    """

    def __init__(
        self,
        call_workers: CallWorkers | None,
        *,
        host: str,
        port: int,
        start_workers: StartWorkers | None = None,
        engine_workers: int = 1,
        source: bool = True,
        trainer_group: Any = None,
        trainer_src: int = 0,
        config: PackedBroadcastConfig | None = None,
        backend: str | None = None,
        allow_partial: bool = False,
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
        ignored: Callable[[ExportsWeights], frozenset[str]] = lambda bridge: frozenset(),
        after_weights_written: Callable[[], None] | None = None,
        overlap_follow_up: bool = True,
        timing: bool = False,
    ) -> None:
        if source and call_workers is None:
            raise ValueError("the source rank needs the engine's workers; the other trainer ranks pass source=False")
        self.call_workers = call_workers
        if start_workers is None and call_workers is not None:
            start_workers = on_a_thread(call_workers)
        self.start_workers = start_workers
        self.host, self.port, self.engine_workers = host, port, engine_workers
        self.source, self.trainer_group, self.trainer_src = source, trainer_group, trainer_src
        self.config = config or PackedBroadcastConfig()
        self.backend, self.allow_partial, self.timeout_s = backend, allow_partial, timeout_s
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.ignored = ignored
        self.after_weights_written = after_weights_written
        self.overlap_follow_up = overlap_follow_up
        self.timing = timing
        self.group: StoreGroup | None = None
        self._session: tuple | None = None  # (bridge, chunks, fp8 repr, plan) of the open session
        self._memory: SendBuffers | None = None  # the packed broadcast's, kept across the session's refits

    def open(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None) -> None:
        """Form the group with the engine's workers and agree on the export plan; collective over
        the trainer ranks (the plan) and, on the source rank, with the engine."""
        chunks = model if isinstance(model, list) else [model]
        plan = bridge.export_plan(chunks, fp8=fp8)
        ignored = self.ignored(bridge)
        if ignored & {e.hf_name for e in plan.entries}:
            logger.info("broadcast refit: the engine skips %s (its ignored names); sent anyway", sorted(ignored))
        self._session = (bridge, tuple(chunks), repr(fp8), plan)
        self._memory = None
        if not self.source:
            return
        world = 1 + self.engine_workers
        secret = new_secret()  # this group's: to the workers in the join RPC, never through the store
        group = dict(
            host=self.host,
            port=self.port,
            world_size=world,
            plan_json=plan.to_json(),
            config=dataclasses.asdict(self.config),
            backend=self.backend,
            timeout_s=self.timeout_s,
            secret=secret.hex(),
            wire_version=WIRE_VERSION,
        )
        join = self.start_workers("mbridge_refit_join", group, SOURCE_RANK + 1, self.allow_partial, RPC_VERSION)
        try:
            self.group = StoreGroup(
                host=self.host,
                port=self.port,
                rank=SOURCE_RANK,
                world_size=world,
                device=self.device,
                secret=secret,
                backend=self.backend,
                peer_failure=join.failure,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
        except BaseException as err:
            err.add_note(_engine_outcome(join.error(PEER_SILENT_S), "joined"))
            raise
        ranks = join.result(self.timeout_s)
        logger.info("broadcast refit: %d engine workers joined (ranks %s)", len(ranks), ranks)

    def refit(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None) -> RefitStep | None:
        """Export ``model`` and broadcast it into the engine; returns the step on the source rank."""
        chunks = model if isinstance(model, list) else [model]
        if not self._serves(bridge, chunks, fp8):
            raise RuntimeError(
                "refit() of another bridge, model or fp8 than the open session: call open() for it first"
            )
        started = time.perf_counter()
        plan = self._session[3]
        stream = bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, fp8=fp8, show_progress=False)
        if not self.source:  # with a trainer group, its sender checks the stream against the plan
            drain(stream, self._sender(plan, None) if self.trainer_group is not None else DiscardSink())
            self._share(None)
            return None
        receive = self.start_workers("mbridge_refit_receive")
        sender, timeline, follow_ups = None, BucketTimeline(self.device) if self.timing else None, []
        try:
            with self.group.watching(receive.failure):
                # the follow-up starts once the handshake agreed: the workers are inside their receive
                sender = self._sender(
                    plan, self.group, timeline, on_agreed=lambda: follow_ups.extend(self._follow_up())
                )
                count = drain(stream, sender)  # the sender's own failures reach every trainer rank in there
            sent_at = time.perf_counter()
        except BaseException as sent:
            if not isinstance(sent, PlanMismatchError) and (sender is None or not sender.settled):
                # the workers may still wait in the protocol (a plan mismatch is settled by the handshake)
                post_failure(self.group, "the trainer", sent)
            engine_error = receive.error(PEER_SILENT_S)
            _settle(follow_ups, sent)
            if engine_error is not None and isinstance(sent, (RefitStatusError, PeerFailedError)):
                raise engine_error from sent  # the engine's own error says more than "a receiver failed"
            sent.add_note(_engine_outcome(engine_error, "completed their receive"))
            raise
        try:
            workers, error = receive.result(self.timeout_s), None
        except Exception as err:
            _settle(follow_ups, err)
            workers, error = [], err
        received_at = time.perf_counter()
        if error is None:
            try:
                if follow_ups:
                    follow_ups[0].result(self.timeout_s)
                elif self.after_weights_written is not None:
                    self.after_weights_written()
            except Exception as err:
                workers, error = [], err
        self._share(error)
        done = time.perf_counter()
        return RefitStep(
            tensors=count,
            bytes=sender.bytes_sent,
            ms=(done - started) * 1e3,
            workers=workers,
            export_ms=(sent_at - started) * 1e3,
            apply_ms=(received_at - sent_at) * 1e3,
            reset_ms=(done - received_at) * 1e3,
            phases=_phases(timeline),
        )

    def _follow_up(self) -> list[WorkerCall]:
        """The follow-up started on a thread of its own (``overlap_follow_up``), or none."""
        if not self.overlap_follow_up or self.after_weights_written is None:
            return []
        return [WorkerCall(self.after_weights_written, name="refit-follow-up", what="the engine's follow-up")]

    def _sender(
        self,
        plan: Any,
        group: StoreGroup | None,
        timeline: BucketTimeline | None = None,
        on_agreed: Callable[[], None] | None = None,
    ) -> PackedBroadcastSender:
        """This rank's packed-broadcast sender (over ``group`` on the source, None on the other
        trainer ranks), on the session's kept memory."""
        if self._memory is None:
            self._memory = SendBuffers(plan, self.config, self.device)
        return PackedBroadcastSender(
            plan,
            self.config,
            group=group,
            src=SOURCE_RANK,
            trainer_group=self.trainer_group,
            trainer_src=self.trainer_src,
            buffers=self._memory,
            timeline=timeline,
            on_agreed=on_agreed,
        )

    def _serves(self, bridge: ExportsWeights, chunks: list, fp8: Any) -> bool:
        """Whether the open session is for exactly these objects (identity, as ``open`` saw them)."""
        if self._session is None:
            return False
        open_bridge, open_chunks, open_fp8, _ = self._session
        return (
            open_bridge is bridge
            and open_fp8 == repr(fp8)
            and len(open_chunks) == len(chunks)
            and all(a is b for a, b in zip(open_chunks, chunks))
        )

    def _share(self, error: BaseException | None) -> None:
        """The engine's outcome of this step, on every trainer rank (only the source learns it)."""
        if self.trainer_group is not None:
            share_verdict(as_broadcast_group(self.trainer_group), self.trainer_src, error, self.device)
        elif error is not None:
            raise error

    def close(self) -> None:
        """End the session: the workers leave the group, then this rank."""
        if self.source and self.group is not None:
            self.call_workers("mbridge_refit_leave")
            self.group.close()
        self.group, self._session, self._memory = None, None, None


def _settle(follow_ups: list[WorkerCall], failure: BaseException) -> None:
    """A failed step's follow-up (if it was started), not waited for (an engine queues it behind the
    failed receive, or may never answer): its outcome so far noted on the step's ``failure``. One still
    pending ends on its own thread; its outcome is not reported (the step failed already, and the next
    one asks again)."""
    if not follow_ups:
        return
    follow_up = follow_ups[0]
    if follow_up.running:
        failure.add_note("the engine's follow-up was still pending when the step failed")
    elif (error := follow_up.error(0)) is not None:
        failure.add_note(f"the engine's follow-up also failed: {type(error).__name__}: {error}")


def _phases(timeline: BucketTimeline | None) -> dict[str, Any] | None:
    """The source's marks and phases of this step (``engines.broadcast.timing``), or None untimed."""
    if timeline is None:
        return None
    marks = timeline.summary()
    return {**marks, "phases": source_phases(marks)}


def _engine_outcome(error: BaseException | None, done: str) -> str:
    """What the engine's workers did, as a note on the trainer's error."""
    if error is None:
        return f"the engine's workers {done}"
    return f"the engine's workers: {type(error).__name__}: {error}"
