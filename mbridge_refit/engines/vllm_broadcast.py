"""Refit a vLLM engine on other GPUs: the packed broadcast from one trainer rank, every step.

The source trainer rank and every worker of the engine form a ``StoreGroup`` (NCCL; joined by
address, so the engine keeps its own ``torch.distributed`` world); the export is packed into
rotating buffers and broadcast bucket by bucket (``sinks.packed_broadcast``: a plan handshake
first, checksums optional, a status at the end, so a mismatch or a failure on either side raises
on both and no rank waits forever); each worker loads what it receives through the model's own
``load_weights`` (``engines.broadcast_receiver``). The four phases of vLLM's native weight
transfer (init, start, update, finish) map to ``open`` (the group, once) and ``refit`` (start,
update and finish, in one call on each side).

Who calls what:

* Start the engine with ``LLM(..., **engine_kwargs())`` (the worker extension).
* On every trainer rank of the model's groups: ``refit = VLLMBroadcastRefit(llm, host=, port=,
  source=...)`` with ``source=True`` on exactly one rank (it holds ``llm``; the others pass
  ``llm=None``), then ``refit.open(bridge, model)`` once and ``refit.refit(bridge, model)`` each
  step: the export is collective, and the other ranks only take part in it.
* ``refit.close()`` at the end.

The engine's workers are called through ``llm.collective_rpc`` from a thread of the source rank
while it sends (each side's call returns when the other side's does). ``timeout_s`` bounds the
join and every collective of both sides. A failure on either side reaches the other within
seconds (``runtime.broadcast_group``): each side posts what stops it before its protocol
settled, and the source also treats the workers' RPC ending in an error while it still waits as
the engine's failure. After such a failure the group is closed for good: ``close()`` and
``open()`` again.

The group's members must run NCCL with the same ``NCCL_*`` settings (``runtime.broadcast_group``
checks them when the group forms). vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``) sets
some in its workers (one channel, the Simple protocol, ...): set the same in the trainer's
environment before its first NCCL call.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from mbridge_refit.engines.broadcast_receiver import SOURCE_RANK
from mbridge_refit.engines.vllm import ignored_by_engine
from mbridge_refit.runtime.broadcast_group import StoreGroup, as_broadcast_group
from mbridge_refit.sinks.base import DiscardSink, drain
from mbridge_refit.runtime.broadcast_group import PEER_SILENT_S, PeerFailedError
from mbridge_refit.sinks.packed_broadcast import (
    PackedBroadcastConfig, PackedBroadcastSender, PlanMismatchError, RefitStatusError, post_failure, share_verdict,
)

logger = logging.getLogger(__name__)


@dataclass
class BroadcastStep:
    """One broadcast refit, on the source rank: ``ms`` from the start of the export until every
    worker had loaded its weights; ``workers``: each worker's ``ReceiveReport`` (plain data)."""

    tensors: int
    bytes: int
    ms: float
    workers: list[dict[str, Any]]


class VLLMBroadcastRefit:
    """A broadcast refit session from the trainer ranks into one vLLM ``LLM`` (module docstring).

    Args:
        llm: the engine (``collective_rpc``); only on the source rank.
        host, port: where the source rank hosts the group's store (reachable by the engine).
        engine_workers: how many workers the engine has (its tensor x pipeline x data parallel size).
        source: whether this rank sends (exactly one trainer rank); the others take part in the export.
        trainer_group: the ``torch.distributed`` group of the ranks iterating the export, with
            ``trainer_src`` the source's rank in it: the source's outcome is shared with them.
        config: the packed broadcast's buffers (``PackedBroadcastConfig``).
        backend: the group's backend (default NCCL; ``"gloo"`` carries CUDA tensors through host
            memory, e.g. trainer and engine on one GPU, which NCCL refuses).
        allow_partial: accept a refit that leaves engine parameters unloaded (a subset).
    """

    def __init__(
        self, llm: Any, *, host: str, port: int, engine_workers: int = 1, source: bool = True,
        trainer_group: Any = None, trainer_src: int = 0, config: PackedBroadcastConfig | None = None,
        backend: str | None = None, allow_partial: bool = False, timeout_s: float = 600.0,
        device: torch.device | str | None = None,
    ) -> None:
        if source and llm is None:
            raise ValueError("the source rank needs the engine (llm); the other trainer ranks pass source=False")
        self.llm, self.host, self.port, self.engine_workers = llm, host, port, engine_workers
        self.source, self.trainer_group, self.trainer_src = source, trainer_group, trainer_src
        self.config = config or PackedBroadcastConfig()
        self.backend, self.allow_partial, self.timeout_s = backend, allow_partial, timeout_s
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.group: StoreGroup | None = None
        self._session: tuple | None = None  # (bridge, chunks, fp8 repr, plan) of the open session

    def open(self, bridge: Any, model: Any, *, fp8: Any = None) -> None:
        """Form the group with the engine's workers and agree on the export plan; collective over
        the trainer ranks (the plan) and, on the source rank, with the engine."""
        chunks = model if isinstance(model, list) else [model]
        plan = bridge.export_plan(chunks, fp8=fp8)
        ignored = ignored_by_engine(bridge)
        if ignored & {e.hf_name for e in plan.entries}:
            logger.info("broadcast refit: the engine skips %s (tied to the embedding); it is sent anyway", sorted(ignored))
        self._session = (bridge, tuple(chunks), repr(fp8), plan)
        if not self.source:
            return
        world = 1 + self.engine_workers
        join = _Call(self.llm, "mbridge_broadcast_join", self.host, self.port, 1, world, plan.to_json(),
                     dataclasses.asdict(self.config), self.backend, self.allow_partial, self.timeout_s)
        try:
            self.group = StoreGroup(host=self.host, port=self.port, rank=SOURCE_RANK, world_size=world,
                                    device=self.device, backend=self.backend, peer_failure=join.failure,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
        except BaseException as err:
            err.add_note(_engine_outcome(join.error(PEER_SILENT_S), "joined"))
            raise
        ranks = join.result(self.timeout_s)
        logger.info("broadcast refit: %d engine workers joined (ranks %s)", len(ranks), ranks)

    def refit(self, bridge: Any, model: Any, *, fp8: Any = None) -> BroadcastStep | None:
        """Export ``model`` and broadcast it into the engine; returns the step on the source rank."""
        chunks = model if isinstance(model, list) else [model]
        if not self._serves(bridge, chunks, fp8):
            raise RuntimeError("refit() of another bridge, model or fp8 than the open session: call open() for it first")
        started = time.perf_counter()
        plan = self._session[3]
        stream = bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, fp8=fp8, show_progress=False)
        if not self.source:
            drain(stream, PackedBroadcastSender(plan, self.config, group=None, src=SOURCE_RANK, device=self.device,
                                                trainer_group=self.trainer_group, trainer_src=self.trainer_src)
                  if self.trainer_group is not None else DiscardSink())
            self._share(None)
            return None
        receive = _Call(self.llm, "mbridge_broadcast_receive")
        sender = None
        try:
            with self.group.watching(receive.failure):
                sender = PackedBroadcastSender(plan, self.config, group=self.group, src=SOURCE_RANK, device=self.device,
                                               trainer_group=self.trainer_group, trainer_src=self.trainer_src)
                count = drain(stream, sender)  # the sender's own failures reach every trainer rank in there
        except BaseException as sent:
            if not isinstance(sent, PlanMismatchError) and (sender is None or not sender.settled):
                # the workers may still wait in the protocol (a plan mismatch is settled by the handshake)
                post_failure(self.group, "the trainer", sent)
            engine_error = receive.error(PEER_SILENT_S)
            if engine_error is not None and isinstance(sent, (RefitStatusError, PeerFailedError)):
                raise engine_error from sent  # the engine's own error says more than "a receiver failed"
            sent.add_note(_engine_outcome(engine_error, "completed their receive"))
            raise
        try:
            workers, error = receive.result(self.timeout_s), None
        except Exception as err:
            workers, error = [], err
        self._share(error)
        return BroadcastStep(tensors=count, bytes=sender.bytes_sent, ms=(time.perf_counter() - started) * 1e3, workers=workers)

    def _serves(self, bridge: Any, chunks: list, fp8: Any) -> bool:
        """Whether the open session is for exactly these objects (identity, as ``open`` saw them)."""
        if self._session is None:
            return False
        open_bridge, open_chunks, open_fp8, _ = self._session
        return (open_bridge is bridge and open_fp8 == repr(fp8) and len(open_chunks) == len(chunks)
                and all(a is b for a, b in zip(open_chunks, chunks)))

    def _share(self, error: BaseException | None) -> None:
        """The engine's outcome of this step, on every trainer rank (only the source learns it)."""
        if self.trainer_group is not None:
            share_verdict(as_broadcast_group(self.trainer_group), self.trainer_src, error, self.device)
        elif error is not None:
            raise error

    def close(self) -> None:
        """End the session: the workers leave the group, then this rank."""
        if self.source and self.group is not None:
            self.llm.collective_rpc("mbridge_broadcast_close", timeout=self.timeout_s)
            self.group.close()
        self.group, self._session = None, None


def _engine_outcome(error: BaseException | None, done: str) -> str:
    """What the engine's workers did, as a note on the trainer's error."""
    if error is None:
        return f"the engine's workers {done}"
    return f"the engine's workers: {type(error).__name__}: {error}"


class _Call:
    """``llm.collective_rpc(method, args)`` on a thread of its own: the workers' side of a
    collective this thread takes part in at the same time."""

    def __init__(self, llm: Any, method: str, *args: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(llm, method, args), name=f"rpc-{method}", daemon=True)
        self._thread.start()

    def _run(self, llm: Any, method: str, args: tuple) -> None:
        try:
            self._result = llm.collective_rpc(method, args=args)
        except BaseException as err:  # re-raised in the caller's thread
            self._error = err

    def failure(self) -> str | None:
        """The call's error as text once it ended with one; None while it runs or after it returned."""
        if self._thread.is_alive() or self._error is None:
            return None
        return f"the engine's workers' RPC ended with {type(self._error).__name__}: {self._error}"

    def error(self, timeout_s: float) -> BaseException | None:
        """Wait for the call; its error, or None."""
        try:
            self.result(timeout_s)
        except Exception as err:
            return err
        return None

    def result(self, timeout_s: float) -> Any:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the engine's workers did not answer within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result
