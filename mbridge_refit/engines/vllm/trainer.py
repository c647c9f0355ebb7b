"""The vLLM adapter's trainer side: refit sessions into a vLLM ``LLM``, one per transport.

Both are ``engines.base.RefitSession``s (``open`` / ``refit`` / ``close``) whose ``refit`` returns
an ``engines.base.RefitStep``, and call the engine's workers through ``llm.collective_rpc``
(the worker extension ``engines.vllm.worker``, added by ``engine_kwargs()``):

* ``VLLMRefit`` (transport ``ipc``): the engine runs on this trainer rank's GPU.
* ``VLLMBroadcastRefit`` (transport ``broadcast``): the engine runs on other GPUs or hosts.

``VLLMRefit``: colocated, by CUDA IPC, every step. The engine maps the trainer's exported tensors (the
parameters and the export's held buffers, ``engines.sharing``) and applies them with the copies
its own ``load_weights`` makes, recorded on the first step (``engines.apply_plan``, engine side
``engines.ipc``). Tensors that are rows of a trainer parameter read as stored
(``RefitBridge.live_rows``: without tensor parallelism nearly all of them, q, k and v included)
are read by the engine from the parameter itself and never exported again; the export runs only
for the rest (gathers, FP8 quantization), every rank of the model's groups exporting the same
names. Per step: that export, one RPC telling every worker to replay, which returns when the
engine's parameters hold the new weights. No bytes are packed or staged, nothing is allocated
after the first step on either side. Who calls what:

* Start the engine with ``LLM(..., **engine_kwargs())`` (adds the worker extension).
* On the trainer rank that shares the engine's GPU: ``refit = VLLMRefit(llm)``, then each step
  ``refit.refit(bridge, model)`` (or ``fp8="blockwise"`` for an engine started from an FP8
  blockwise config); ``open`` first is optional (the first refit opens the layout). Every other
  rank of the model's groups must iterate the same export (it is collective) and drop the
  tensors: ``refit.refit(..., sender=False)`` does that.
* ``refit.close()`` before the trainer frees the model or the bridge's buffers.

Scope: one trainer rank feeds one engine worker on its GPU (engine tensor parallel size 1); the
engine process must not be the trainer's own (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs it
inside; then pass ``transport=LocalTransport()``). Every call is bounded by ``timeout_s``.

``VLLMBroadcastRefit``: on other GPUs, the packed broadcast from one trainer rank, every step.
The source trainer rank and every worker of the engine form a ``StoreGroup`` (NCCL; joined by
address, so the engine keeps its own ``torch.distributed`` world); the export is packed into
rotating buffers and broadcast bucket by bucket (``sinks.packed_broadcast``: a plan handshake
first, checksums optional, a status at the end, so a mismatch or a failure on either side raises
on both and no rank waits forever); each worker loads what it receives through the model's own
``load_weights`` (``engines.broadcast``). The four phases of vLLM's native weight
transfer (init, start, update, finish) map to ``open`` (the group, once) and ``refit`` (start,
update and finish, in one call on each side). Who calls what:

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mbridge_refit.engines.base import RefitStep
from mbridge_refit.engines.broadcast import SOURCE_RANK
from mbridge_refit.engines.sharing import CudaIpcTransport, LayoutRecorder, SharedLayout, Transport
from mbridge_refit.engines.vllm.worker import WORKER_EXTENSION
from mbridge_refit.errors import EngineError
from mbridge_refit.plan.entries import PlanError
from mbridge_refit.runtime.broadcast_group import PEER_SILENT_S, PeerFailedError, StoreGroup, as_broadcast_group
from mbridge_refit.runtime.selection import LiveRows
from mbridge_refit.runtime.weight_source import ExportsWeights, Model
from mbridge_refit.sinks.base import DiscardSink, drain
from mbridge_refit.sinks.packed_broadcast import (
    PackedBroadcastConfig,
    PackedBroadcastSender,
    PlanMismatchError,
    RefitStatusError,
    post_failure,
    share_verdict,
)

__all__ = [
    "TIED_OUTPUT_NAMES",
    "VLLMBroadcastRefit",
    "VLLMRefit",
    "engine_kwargs",
    "ignored_by_engine",
    "prompt_logprobs",
    "reset_prefix_cache",
]

logger = logging.getLogger(__name__)

Stream = Iterable[tuple[str, torch.Tensor]]


def engine_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` that a refit target needs (the worker extension)."""
    return {"worker_extension_cls": WORKER_EXTENSION, **overrides}


def reset_prefix_cache(llm: Any, what: str = "weights") -> None:
    """Drop the engine's cached prompt blocks after a refit (every session here does, unless told
    not to). vLLM keys them by the tokens (and the adapter's name), not by the weights: without the
    reset a prompt seen before the refit reuses KV blocks computed with the old ``what``. Raises
    ``EngineError`` when the engine refuses (requests still running: refit between generations)."""
    if not llm.reset_prefix_cache():
        raise EngineError(
            f"the engine refused to reset its prefix cache (requests still running): prompts seen before the refit "
            f"would reuse KV blocks computed with the previous {what}; refit between generations"
        )


TIED_OUTPUT_NAMES = ("lm_head.weight",)  # what an engine skips when its config ties embeddings


def ignored_by_engine(bridge: ExportsWeights) -> frozenset[str]:
    """Exported names an engine started from ``bridge``'s HF config skips by design: the output
    layer when the config ties it to the embedding (vLLM then never loads it)."""
    config = getattr(bridge.hf_pretrained, "config", None) or bridge.hf_pretrained
    return frozenset(TIED_OUTPUT_NAMES) if getattr(config, "tie_word_embeddings", False) else frozenset()


@dataclass(frozen=True)
class _Routes:
    """How each engine tensor of one (bridge, model, fp8) reaches the engine, decided from the plan
    (the same on every rank): read live from a trainer parameter, or exported every step."""

    bridge: ExportsWeights
    chunks: tuple[torch.nn.Module, ...]
    fp8: str  # repr of the fp8 argument
    order: tuple[str, ...] | None  # engine tensors in plan order; None: the stream's own (stock fallback)
    ignored: frozenset[str]  # exported names the engine skips (``ignored_by_engine``)
    live: dict[str, LiveRows]
    exported: frozenset[str] | None  # the export's ``only=`` (None: every tensor)
    live_parameters: tuple[torch.Tensor, ...]  # distinct parameters the live tensors read

    def serve(self, bridge: ExportsWeights, chunks: tuple, fp8: str) -> bool:
        """Whether these routes are for exactly these objects (identity: a new model never
        inherits another's live parameters, whatever ids it reuses)."""
        return (
            self.bridge is bridge
            and self.fp8 == fp8
            and len(self.chunks) == len(chunks)
            and all(a is b for a, b in zip(self.chunks, chunks))
        )


class VLLMRefit:
    """A refit session from this trainer process into one vLLM ``LLM`` on the same GPU.

    ``check_first_refit``: the engine proves its recorded copies against its own loader on every
    open (costs one more pass over the weights, once). ``reset_prefix_cache``: drop the engine's
    cached prompt blocks after each refit (``reset_prefix_cache``; one engine call). ``allow_partial``: accept an export that
    leaves engine parameters unwritten or has tensors the engine does not load (a subset refit).
    The session references the last refit's model parameters and shared storages until ``close``.
    """

    def __init__(
        self,
        llm: Any,
        *,
        transport: Transport | None = None,
        check_first_refit: bool = True,
        allow_partial: bool = False,
        timeout_s: float = 600.0,
        reset_prefix_cache: bool = True,
    ) -> None:
        self.llm = llm
        self.reset_prefix_cache = reset_prefix_cache
        self.transport = transport or CudaIpcTransport()
        self.check_first_refit = check_first_refit
        self.allow_partial = allow_partial
        self.timeout_s = timeout_s
        self._layout: SharedLayout | None = None
        self._key: tuple | None = None
        self._held: list = []  # storages the engine maps: kept alive while it may read them
        self._payload: bytes | None = None
        self._routes: _Routes | None = None  # the last refit's (held until close)
        self._rows_out: dict[str, torch.Tensor] = {}  # copies of live row runs the engine's loader reads at an open
        self.last_report: dict[str, Any] | None = None

    def open(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None) -> None:
        """Decide which tensors the engine reads live and which are exported (collective on the
        first call for a model: the plan). Optional: ``refit`` does it too; the layout itself is
        shared with the engine by the first refit (its step has ``opened`` and the report)."""
        self._routes_for(bridge, model, fp8)

    def refit(
        self,
        bridge: ExportsWeights,
        model: Model,
        *,
        fp8: Any = None,
        sender: bool = True,
        through: Callable[[Stream], Stream] | None = None,
    ) -> RefitStep | None:
        """Export ``model`` with ``bridge`` (held cached buffers) and apply it to the engine.

        Collective like ``export_hf_weights``: every rank of the model's groups calls it, with
        the same ``fp8``; the ranks with ``sender=False`` only take part in the export. Every
        rank exports the same names (those not live on this layout). ``through`` wraps the
        sender's stream of every engine tensor (e.g. a check that alters a tensor on its way);
        such a step always shares its layout anew. Returns the step on the sender."""
        started = time.perf_counter()
        routes = self._routes_for(bridge, model, fp8)
        stream = bridge.export_hf_weights(
            model, reuse_buffer_from_cache=True, hold_outputs=True, fp8=fp8, show_progress=False, only=routes.exported
        )
        if not sender:
            drain(stream, DiscardSink())
            return None
        exported = LayoutRecorder()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in stream:  # held outputs: valid until the next export
            if name in routes.ignored:
                continue
            exported.add(name, tensor)
            tensors[name] = tensor
        key = (exported.key, tuple(p.data_ptr() for p in routes.live_parameters))
        _synchronize_trainer()  # the engine reads from another process
        if through is None and self._layout is not None and key == self._key:
            return self._apply(started)
        return self._open_step(routes, tensors, key if through is None else None, through, started)

    def refit_stream(self, stream: Stream, *, started: float | None = None) -> RefitStep:
        """Apply ``stream`` (``(hf_name, tensor)`` on this GPU, each valid until the stream ends);
        every tensor is read from the stream's memory (nothing is live)."""
        started = time.perf_counter() if started is None else started
        recorder = LayoutRecorder()
        for name, tensor in stream:
            self._check_device(name, tensor)
            recorder.add(name, tensor)
        _synchronize_trainer()
        if self._layout is not None and recorder.key == self._key:
            return self._apply(started)
        return self._open(recorder, recorder.key, started)

    def _routes_for(self, bridge: ExportsWeights, model: Model, fp8: Any) -> _Routes:
        """The routes of this (bridge, model, fp8); those of the last refit are kept."""
        chunks = tuple(model if isinstance(model, list) else [model])
        if self._routes is None or not self._routes.serve(bridge, chunks, repr(fp8)):
            self._routes = _plan_routes(bridge, chunks, fp8)
        return self._routes

    def _open_step(
        self,
        routes: _Routes,
        tensors: dict[str, torch.Tensor],
        key: tuple | None,
        through: Callable[[Stream], Stream] | None,
        started: float,
    ) -> RefitStep:
        """Share this step's layout: every engine tensor, live ones as views of the parameters
        (row runs copied once, for the engine's loader, and named as rows)."""
        order = routes.order if routes.order is not None else tuple(tensors)
        pairs, rows_of = [], {}
        for name in order:
            live = routes.live.get(name)
            if live is None:
                pairs.append((name, tensors[name]))
                continue
            tensor = live.tensor() if live.is_view else live.tensor(out=self._rows_buffer(name, live))
            if not live.is_view:
                rows_of[name] = (tensor, (live.source(), live.runs))
            pairs.append((name, tensor))
        recorder = LayoutRecorder()
        for name, tensor in through(iter(pairs)) if through is not None else pairs:
            self._check_device(name, tensor)
            rows = rows_of.get(name)
            recorder.add(name, tensor, rows=rows[1] if rows is not None and rows[0] is tensor else None)
        _synchronize_trainer()
        return self._open(recorder, key, started)

    def _rows_buffer(self, name: str, live: LiveRows) -> torch.Tensor:
        source = live.source()
        buffer = self._rows_out.get(name)
        if (
            buffer is None
            or tuple(buffer.shape) != live.shape
            or buffer.dtype != source.dtype
            or buffer.device != source.device
        ):
            buffer = self._rows_out[name] = torch.empty(live.shape, dtype=source.dtype, device=source.device)
        return buffer

    def _check_device(self, name: str, tensor: torch.Tensor) -> None:
        if isinstance(self.transport, CudaIpcTransport) and tensor.device.type != "cuda":
            raise ValueError(f"{name} is on {tensor.device}: CUDA IPC shares GPU memory (export with cpu=False)")

    def _apply(self, started: float) -> RefitStep:
        exported = time.perf_counter()
        engine_ms = self._rpc("mbridge_refit_apply", self._layout.fingerprint)
        self._after_apply()
        done = time.perf_counter()
        return RefitStep(
            tensors=len(self._layout.refs),
            bytes=self._layout.nbytes,
            ms=(done - started) * 1e3,
            opened=False,
            export_ms=(exported - started) * 1e3,
            apply_ms=(done - exported) * 1e3,
            engine_ms=engine_ms,
        )

    def _open(self, recorder: LayoutRecorder, key: tuple | None, started: float) -> RefitStep:
        exported = time.perf_counter()
        if self._layout is not None:
            logger.info("refit: the export's layout changed (other storages or tensors): sharing it anew")
        layout, storages = recorder.layout()
        payload = self.transport.share(storages)
        report = self._rpc(
            "mbridge_refit_open",
            layout.to_wire(),
            payload,
            self.transport.name,
            self.check_first_refit,
            self.allow_partial,
        )
        self._release_payload()
        self._layout, self._key, self._held, self._payload = layout, key, storages, payload
        self.last_report = report
        self._after_apply()
        done = time.perf_counter()
        return RefitStep(
            tensors=len(layout.refs),
            bytes=layout.nbytes,
            ms=(done - started) * 1e3,
            opened=True,
            export_ms=(exported - started) * 1e3,
            apply_ms=(done - exported) * 1e3,
            report=report,
        )

    def _after_apply(self) -> None:
        if self.reset_prefix_cache:
            reset_prefix_cache(self.llm)

    def fingerprints(self) -> dict[str, tuple[int, int]]:
        """The engine's exact per-parameter fingerprints (first worker)."""
        return {name: tuple(fp) for name, fp in self._rpc("mbridge_refit_fingerprints").items()}

    def close(self) -> None:
        """Tell the engine to forget the mapped tensors, then release them."""
        if self._layout is not None:
            self._rpc("mbridge_refit_close")
        self._release_payload()
        self._layout, self._key, self._held, self._rows_out, self._routes = None, None, [], {}, None

    def _release_payload(self) -> None:
        release = getattr(self.transport, "release", None)
        if release is not None and self._payload is not None:
            release(self._payload)  # the in-process transport keeps storages until told
        self._payload = None

    def _rpc(self, method: str, *args: Any) -> Any:
        results = self.llm.collective_rpc(method, timeout=self.timeout_s, args=args)
        return results[0] if results else None


def _plan_routes(bridge: ExportsWeights, chunks: tuple, fp8: Any) -> _Routes:
    """Which engine tensors are live and which the export yields (module docstring)."""
    ignored = ignored_by_engine(bridge)
    owner = {"bridge": bridge, "chunks": chunks, "fp8": repr(fp8), "ignored": ignored}
    try:
        plan = bridge.export_plan(list(chunks), fp8=fp8)
    except PlanError:
        return _Routes(**owner, order=None, live={}, exported=None, live_parameters=())
    order = tuple(e.hf_name for e in plan.entries if e.hf_name not in ignored)
    live = {name: rows for name, rows in bridge.live_rows(list(chunks), fp8=fp8).items() if name not in ignored}
    exported = frozenset(name for name in order if name not in live)
    parameters = {id(rows.parameter): rows.parameter for rows in live.values()}
    everything = not live and not ignored
    return _Routes(
        **owner,
        order=order,
        live=live,
        exported=None if everything else exported,
        live_parameters=tuple(parameters.values()),
    )


def _synchronize_trainer() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


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
        reset_prefix_cache: drop the engine's cached prompt blocks after each refit (``reset_prefix_cache``).
    """

    def __init__(
        self,
        llm: Any,
        *,
        host: str,
        port: int,
        engine_workers: int = 1,
        source: bool = True,
        trainer_group: Any = None,
        trainer_src: int = 0,
        config: PackedBroadcastConfig | None = None,
        backend: str | None = None,
        allow_partial: bool = False,
        timeout_s: float = 600.0,
        device: torch.device | str | None = None,
        reset_prefix_cache: bool = True,
    ) -> None:
        if source and llm is None:
            raise ValueError("the source rank needs the engine (llm); the other trainer ranks pass source=False")
        self.llm, self.host, self.port, self.engine_workers = llm, host, port, engine_workers
        self.source, self.trainer_group, self.trainer_src = source, trainer_group, trainer_src
        self.config = config or PackedBroadcastConfig()
        self.backend, self.allow_partial, self.timeout_s = backend, allow_partial, timeout_s
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.reset_prefix_cache = reset_prefix_cache
        self.group: StoreGroup | None = None
        self._session: tuple | None = None  # (bridge, chunks, fp8 repr, plan) of the open session

    def open(self, bridge: ExportsWeights, model: Model, *, fp8: Any = None) -> None:
        """Form the group with the engine's workers and agree on the export plan; collective over
        the trainer ranks (the plan) and, on the source rank, with the engine."""
        chunks = model if isinstance(model, list) else [model]
        plan = bridge.export_plan(chunks, fp8=fp8)
        ignored = ignored_by_engine(bridge)
        if ignored & {e.hf_name for e in plan.entries}:
            logger.info(
                "broadcast refit: the engine skips %s (tied to the embedding); it is sent anyway", sorted(ignored)
            )
        self._session = (bridge, tuple(chunks), repr(fp8), plan)
        if not self.source:
            return
        world = 1 + self.engine_workers
        group = dict(
            host=self.host,
            port=self.port,
            world_size=world,
            plan_json=plan.to_json(),
            config=dataclasses.asdict(self.config),
            backend=self.backend,
            timeout_s=self.timeout_s,
        )
        join = _Call(self.llm, "mbridge_refit_join", group, SOURCE_RANK + 1, self.allow_partial)
        try:
            self.group = StoreGroup(
                host=self.host,
                port=self.port,
                rank=SOURCE_RANK,
                world_size=world,
                device=self.device,
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
        if not self.source:
            drain(
                stream,
                PackedBroadcastSender(
                    plan,
                    self.config,
                    group=None,
                    src=SOURCE_RANK,
                    device=self.device,
                    trainer_group=self.trainer_group,
                    trainer_src=self.trainer_src,
                )
                if self.trainer_group is not None
                else DiscardSink(),
            )
            self._share(None)
            return None
        receive = _Call(self.llm, "mbridge_refit_receive")
        sender = None
        try:
            with self.group.watching(receive.failure):
                sender = PackedBroadcastSender(
                    plan,
                    self.config,
                    group=self.group,
                    src=SOURCE_RANK,
                    device=self.device,
                    trainer_group=self.trainer_group,
                    trainer_src=self.trainer_src,
                )
                count = drain(stream, sender)  # the sender's own failures reach every trainer rank in there
            sent_at = time.perf_counter()
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
            received_at = time.perf_counter()
            if self.reset_prefix_cache:
                reset_prefix_cache(self.llm)
        except Exception as err:
            workers, error, received_at = [], err, time.perf_counter()
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
            self.llm.collective_rpc("mbridge_refit_leave", timeout=self.timeout_s)
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


def prompt_logprobs(llm: Any, prompts: list[list[int]], lora_request: Any = None) -> list[list[float]]:
    """vLLM's log-probability of every prompt token after the first, for each prompt (token ids),
    computed by the engine itself (greedy, one generated token), with ``lora_request``'s adapter if given."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    adapter = {} if lora_request is None else {"lora_request": lora_request}
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False, **adapter)
    result = []
    for ids, output in zip(prompts, outputs):
        steps = output.prompt_logprobs[1:]
        result.append([step[token].logprob if step and token in step else None for token, step in zip(ids[1:], steps)])
    return result
