"""The colocated transport's trainer side, engine-agnostic: ``IpcSession`` (transport ``ipc``).

The engine runs on this trainer rank's GPU, in its own process. Every step the engine maps the
trainer's exported tensors (the parameters and the export's held buffers, ``engines.ipc.sharing``) and
applies them with the copies its own loader makes, recorded on the first step
(``engines.replay.apply_plan``; engine side ``engines.ipc.engine.RefitReceiver``). Tensors that are rows of a
trainer parameter read as stored (``RefitBridge.live_rows``: without tensor parallelism nearly all
of them, q, k and v included) are read by the engine from the parameter itself and never exported
again; the export runs only for the rest (gathers, FP8 quantization of other tensors), every rank
of the model's groups exporting the same names. With ``fp8``, a weight that is such rows in whole
128-row blocks (``RefitBridge.quantized_live_rows``: every expert and, at real head sizes, q, k and v)
is not exported either: the session quantizes it once at an open, for the engine's loader, and names
it as the quantization of those rows (``sharing.QuantizedRef``); the engine then quantizes the rows
itself on every replay, into its own parameters where its loader copies the weight whole
(``ApplyPlan.compose_quantized``), so an FP8 step reads the BF16 weights once and writes the engine's
bytes once, with no export buffer between (``engine_quantizes=False``: the trainer quantizes them into
its export buffers and the engine copies those, as for the rest). Per step: that export, one RPC telling every worker to replay,
the engine's follow-up (``after_weights_written``) and, over CUDA IPC, a wait on the event the
worker recorded after launching its copies (``engines.ipc.completion``): the RPC returns once the copies
are launched, so the follow-up runs while they do, and ``refit`` returns once the engine's
parameters hold the new weights. Where the engine is another process (``early_apply``, on by default
over CUDA IPC) the apply RPC leaves before the export, on a thread, and the worker makes its own
checks while the trainer exports, then waits for the trainer's go-ahead (``engines.ipc.go_ahead``: one
message on a local socket, sent once the export is done and the device synchronized): the RPC's
way to the worker and the worker's look at its parameters cost the step nothing, and the worker
reads nothing of the trainer's before the export is done and found where the last one was. The
live parameters' addresses are read after the word, while the copies run: a parameter whose data
moved has had its old memory copied (still allocated: the session holds the storage, and CUDA IPC
keeps a block the engine maps from reuse), and the step then opens anew before it returns. A step
whose exported tensors moved tells the waiting worker to skip, then opens. An early apply that fails
(a word that came after the worker's wait gave up, a slow collective export) drops the line: the
step is applied after its export, and so are later ones until the next open; a real fault raises
there. No bytes are packed or staged, nothing is allocated after the first step on either side. A steady step that finds the export's tensors to be the last step's very
objects at the same addresses (``engines.ipc.sharing.ExportSnapshot``: stamped buckets by their stamps,
``runtime.stamps``, the others tensor by tensor) notes none of them anew; any other export is noted
tensor by tensor and, where it moved, shared anew.

Who calls it: an engine adapter's ``ipc`` session (for vLLM ``engines.vllm.VLLMRefit``, a subclass)
binds the three things that are its engine's: ``call_workers(method, *args)`` (the RPC to every
worker, returning their results in worker order, bounded by the adapter's timeout; the workers run
``engines.ipc.engine.RefitReceiver`` behind the ``engines.base.RefitWorker`` RPCs), ``ignored(bridge)``
(exported names the engine skips by design, e.g. a tied output layer) and ``after_weights_written``
(the engine's follow-up once its parameters hold new weights, e.g. dropping a prefix cache computed
with the old ones; its failure fails the step). The trainer then:

* on the rank that shares the engine's GPU: ``session.refit(bridge, model)`` each step (or
  ``fp8="blockwise"`` for an engine started from an FP8 blockwise config); ``open`` first is
  optional (the first refit opens the layout). Every other rank of the model's groups must iterate
  the same export (it is collective) and drop the tensors: ``refit(..., sender=False)`` does that.
* ``session.close()`` before the trainer frees the model or the bridge's buffers.

A parameter the model replaces between steps (a new object, ``module.weight = Parameter(...)``, or a
``param.data`` swap) is noticed at the next refit, which shares the layout anew: when it returns, the
engine holds the parameter's current data. A new object is noticed before anything is copied; a
``.data`` swap, on a step applied early, while the worker copies from the old storage the session
still holds (above).

Scope: one trainer rank feeds one engine worker on its GPU (engine tensor parallel size 1; above,
``engines.ipc.sharded``); the engine process must not be the trainer's own (an engine inside it
takes ``transport=LocalTransport()``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from mbridge_refit.engines.base import RPC_VERSION, CallWorkers, RefitStep
from mbridge_refit.engines.ipc.completion import DoneSignal
from mbridge_refit.engines.ipc.go_ahead import GoAheadError, GoAheadLine
from mbridge_refit.engines.ipc.sharing import (
    CudaIpcTransport,
    ExportSnapshot,
    LayoutRecorder,
    SharedLayout,
    Transport,
)
from mbridge_refit.engines.replay.fingerprint import fingerprints_from_wire
from mbridge_refit.engines.worker_call import WorkerCall
from mbridge_refit.errors import TransportError
from mbridge_refit.fp8.format import FP8_DTYPE, SCALE_DTYPE, scale_shape
from mbridge_refit.fp8.quantize import JobQuantizer, block_row_jobs
from mbridge_refit.plan.entries import PlanError
from mbridge_refit.runtime.gc_pause import GcPause
from mbridge_refit.runtime.live_params import registration_count
from mbridge_refit.runtime.selection import LiveRows
from mbridge_refit.runtime.weight_source import ExportsWeights, Model

__all__ = ["IpcSession", "Stream", "live_pointers"]

logger = logging.getLogger(__name__)

Stream = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class _Routes:
    """How each engine tensor of one (bridge, model, fp8) reaches the engine, decided from the plan
    (the same on every rank): read live from a trainer parameter, or exported every step."""

    bridge: ExportsWeights
    chunks: tuple[torch.nn.Module, ...]
    fp8: str  # repr of the fp8 argument
    engine_quantizes: bool  # the session's, when planned
    order: tuple[str, ...] | None  # engine tensors in plan order; None: the stream's own (stock fallback)
    ignored: frozenset[str]  # exported names the engine skips (the session's ``ignored``)
    live: dict[str, LiveRows]
    quantized: dict[str, tuple[LiveRows, str]]  # FP8 weights the engine quantizes from rows: (rows, scale name)
    exported: frozenset[str] | None  # the export's ``only=`` (None: every tensor)
    live_parameters: tuple[torch.Tensor, ...]  # distinct parameters the live tensors read
    registrations: int  # ``runtime.live_params.registration_count()`` when planned

    def serve(self, bridge: ExportsWeights, chunks: tuple, fp8: str, engine_quantizes: bool) -> bool:
        """Whether these routes are for exactly these objects (identity: a new model never
        inherits another's live parameters, whatever ids it reuses) and their parameters are
        still the model's: no module registered anything since (a replaced parameter object
        would otherwise be read where the old one was; ``param.data`` swaps change the step's
        key instead)."""
        return (
            self.registrations == registration_count()
            and self.bridge is bridge
            and self.fp8 == fp8
            and self.engine_quantizes == engine_quantizes
            and len(self.chunks) == len(chunks)
            and all(a is b for a, b in zip(self.chunks, chunks))
        )


class IpcSession:
    """A refit session from this trainer process into one engine on the same GPU (module docstring).

    ``call_workers``: ``(method, *args) -> list`` of the workers' results (the adapter bounds it). ``ignored``:
    exported names the engine skips, for a bridge. ``after_weights_written``: called after every open and replay
    (the engine's own follow-up). ``check_first_refit``: the engine proves its recorded copies against its own
    loader on every open (costs one more pass over the weights, once). ``allow_partial``: accept an export that
    leaves engine parameters unwritten or has tensors the engine does not load (a subset refit).
    ``overlap_follow_up``: where the engine signals the end of its copies by event (CUDA IPC), run
    ``after_weights_written`` while they run (off: the apply RPC returns when they are done, then the follow-up;
    an attribute, read each step). ``engine_quantizes``: with ``fp8``, the engine quantizes the weights that are
    whole-block rows of a trainer parameter itself (module docstring; off: exported like the rest).
    ``early_apply``: send each steady step's apply RPC before the export, its worker waiting for the go-ahead
    (module docstring; None: where the transport is CUDA IPC, an engine of its own process; the engine must
    accept the line at the open, else applies come late; an attribute, read each step, the line offered at an
    open where it is on). ``defer_gc``: a steady step on the sender (an open layout, no ``through``) holds
    Python's garbage collector off from its start until the engine's copies are let go (the go-ahead, or the
    late apply's return), so that a collection falling due then runs while they do (``runtime.gc_pause``; where
    the collector is enabled; an attribute, read each step). ``check_after_word``: on a steady step applied
    early, read the live parameters' addresses after the go-ahead, while the worker copies, and open anew over
    its copies where one moved (``_apply_checking_after_word``); off: before the go-ahead, so that the worker
    never reads a moved parameter's old memory, at the cost of that read on the step's critical path (an
    attribute, read each step). ``timeout_s`` bounds the wait for the engine's signal and the worker's wait for
    a go-ahead. The session references the last refit's model parameters, shared storages and exported tensors
    (``ExportSnapshot``) until ``close``, and, for the weights the engine quantizes, their e4m3 data and scales
    as quantized at the last open (the engine records its loader from them, and quantizes into them where its
    loader does more than copy them whole).
    """

    def __init__(
        self,
        call_workers: CallWorkers,
        *,
        transport: Transport | None = None,
        ignored: Callable[[ExportsWeights], frozenset[str]] = lambda bridge: frozenset(),
        after_weights_written: Callable[[], None] | None = None,
        check_first_refit: bool = True,
        allow_partial: bool = False,
        overlap_follow_up: bool = True,
        engine_quantizes: bool = True,
        early_apply: bool | None = None,
        defer_gc: bool = True,
        check_after_word: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        self.call_workers = call_workers
        self.defer_gc = defer_gc
        self.check_after_word = check_after_word
        self.engine_quantizes = engine_quantizes
        self.overlap_follow_up = overlap_follow_up
        self.timeout_s = timeout_s
        self.ignored = ignored
        self.after_weights_written = after_weights_written
        self.transport = transport or CudaIpcTransport()
        self.early_apply = isinstance(self.transport, CudaIpcTransport) if early_apply is None else early_apply
        self.check_first_refit = check_first_refit
        self.allow_partial = allow_partial
        self._layout: SharedLayout | None = None
        self._key: tuple | None = None
        self._held: list = []  # storages the engine maps: kept alive while it may read them
        self._payload: bytes | None = None
        self._routes: _Routes | None = None  # the last refit's (held until close)
        # the last refit's exported tensors (held until close) and the key they made
        self._steady: tuple[ExportSnapshot, tuple] | None = None
        self._rows_out: dict[str, torch.Tensor] = {}  # copies of live row runs the engine's loader reads at an open
        # weights the engine quantizes, quantized here at an open for its loader: name -> (e4m3 data, scale_inv)
        self._quantized_out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._done: DoneSignal | None = None  # the engine's replay event (CUDA IPC), waited on after each apply
        self._go_ahead: GoAheadLine | None = None  # the open layout's line to its worker (early applies)
        self._step = 0  # the last early apply's number
        self._stale: WorkerCall | None = None  # an early apply RPC that outlived its step's timeout
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
        steady = sender and through is None and self._layout is not None  # else: an open, or no apply to wait on
        with GcPause(self.defer_gc and steady) as pause:  # until the go-ahead or the apply's return (or an open)
            return self._refit(bridge, model, fp8, sender, through, pause)

    def _refit(
        self,
        bridge: ExportsWeights,
        model: Model,
        fp8: Any,
        sender: bool,
        through: Callable[[Stream], Stream] | None,
        pause: GcPause,
    ) -> RefitStep | None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        planned = self._routes
        routes = self._routes_for(bridge, model, fp8)
        if routes is not planned:
            pause.resume()  # planned anew (a parameter replaced, another model): the step opens
        try:
            self._check_no_stale_call()
            early = self._start_early_apply() if sender and through is None else None
        except BaseException as err:
            self._drop_go_ahead()  # an RPC may have left without its word: the line's close ends its wait
            if isinstance(err, Exception):  # not for an interrupt: the process is on its way out
                self._export_refused(bridge, model, fp8, routes)
            raise
        try:
            exported = self._export(bridge, model, fp8, routes, sender, through)
            export_cpu_ms = (time.thread_time() - started_cpu) * 1e3  # before the device wait, which may spin
            if exported is not None:
                _synchronize_trainer()  # the engine reads from another process
        except BaseException:
            self._end_early_apply(early, apply=False, quiet=True)  # never leave the worker waiting
            raise
        if exported is None:
            return None
        snapshot, exported_key = exported
        last = self._key if through is None and self._layout is not None else None
        checked_after = early is not None and self.check_after_word and routes is planned
        if checked_after and isinstance(last, _StepKey) and last.exported == exported_key:
            return self._apply_checking_after_word(routes, snapshot, last, started, export_cpu_ms, early, pause)
        key = _StepKey(exported_key, live_pointers(routes.live_parameters))
        if key == last:
            return self._apply(started, export_cpu_ms, early, copies_started=pause.resume)
        pause.resume()  # an open: seconds of work, not worth holding collections over
        self._end_early_apply(early, apply=False)  # the layout changed: the worker leaves it, the step opens
        tensors = dict(snapshot.pairs(routes.ignored))
        return self._open_step(routes, tensors, key if through is None else None, through, started)

    def _apply_checking_after_word(
        self,
        routes: _Routes,
        snapshot: ExportSnapshot,
        last: _StepKey,
        started: float,
        export_cpu_ms: float,
        early: _EarlyApply,
        pause: GcPause,
    ) -> RefitStep:
        """A steady step whose exported tensors are where the last step's were, with its worker waiting:
        the word goes first, and the live parameters' addresses (``live_pointers``: thousands of them for
        a many-expert model, each a few dependent memory reads) are read while the copies run. A
        parameter whose data moved since (a ``.data`` swap, its storage resized) has then had its old
        memory copied: still allocated, since the session holds the storage and CUDA IPC keeps a block
        the engine maps from reuse, and still not the parameter's. The step then shares the layout anew
        before it returns, so the engine holds the parameter's data when ``refit`` returns, as always."""
        read: list[tuple[int, ...]] = []
        step = self._apply(
            started,
            export_cpu_ms,
            early,
            copies_started=pause.resume,
            after_word=lambda: read.append(live_pointers(routes.live_parameters)),
        )
        pointers = read[0] if read else live_pointers(routes.live_parameters)
        if pointers == last.pointers:
            return step
        logger.info("refit: a live parameter's data moved: sharing the layout anew over this step's copies")
        tensors = dict(snapshot.pairs(routes.ignored))
        return self._open_step(routes, tensors, _StepKey(last.exported, pointers), None, started)

    def _export(
        self,
        bridge: ExportsWeights,
        model: Model,
        fp8: Any,
        routes: _Routes,
        sender: bool,
        through: Callable[[Stream], Stream] | None,
    ) -> tuple[ExportSnapshot, tuple] | None:
        """The step's export (collective) and, on the sender, its tensors with where they are (the first
        half of the step's ``_StepKey``)."""
        buckets = bridge.export_hf_weight_buckets(
            model, reuse_buffer_from_cache=True, hold_outputs=True, fp8=fp8, show_progress=False, only=routes.exported
        )
        if not sender:
            for _ in buckets:  # collective: to the end
                pass
            return None
        snapshot = ExportSnapshot(list(buckets), owner=routes)  # held outputs: valid until the next export
        exported = self._exported_key(snapshot, routes.ignored)
        self._steady = (snapshot, exported) if through is None else None
        return snapshot, exported

    def _export_refused(self, bridge: ExportsWeights, model: Model, fp8: Any, routes: _Routes) -> None:
        """A step the sender refuses before its export still runs the export to the end, tensors dropped:
        it is collective, and a rank that skipped it would pair its next export with its peers' export of
        this step, mixing two steps' shards without an error. A failure of that export is logged, and the
        refusal raised."""
        try:
            self._export(bridge, model, fp8, routes, sender=False, through=None)
        except Exception as err:
            logger.warning("refit: the refused step's export, run for the other ranks, failed too: %s", err)

    def _start_early_apply(self) -> _EarlyApply | None:
        """The steady step's apply RPC, sent now on a thread (its worker checks its side, then waits for
        the go-ahead); None where there is no open layout with a connected line."""
        if not self.early_apply or self._layout is None or self._go_ahead is None:
            return None
        self._step += 1
        step, fingerprint = self._step, self._layout.fingerprint
        signal = self._done is not None and self.overlap_follow_up
        call = WorkerCall(
            lambda: self.call_workers("mbridge_refit_apply", fingerprint, signal, step),
            name="rpc-early-apply",
            what="the engine's early apply RPC",
        )
        return _EarlyApply(step=step, signal=signal, call=call)

    def _end_early_apply(
        self,
        early: _EarlyApply | None,
        *,
        apply: bool,
        quiet: bool = False,
        before_word: Callable[[], None] = lambda: None,
        after_word: Callable[[], None] = lambda: None,
    ) -> list | None:
        """Give ``early``'s worker the word (``before_word`` called just before it, ``after_word`` just after
        it, while the worker copies), then its RPC's results; None where there was none or it failed.
        A failure drops the line (the step, and later ones until the next open, apply after the export: a
        worker whose word came too late, or whose apply failed, is asked again the old way, where a real
        fault raises). An RPC still running after ``timeout_s`` raises (``quiet``: only logged, the step
        already fails with its own error) and drops the open layout: the next step opens anew, once that RPC
        has returned (``_check_no_stale_call``)."""
        if early is None:
            return None
        before_word()
        try:
            if self._go_ahead is not None:
                self._go_ahead.send(early.step, apply)
        except GoAheadError as err:
            logger.warning(
                "refit: the go-ahead line failed (%s): applies come after the export until the next open", err
            )
            self._drop_go_ahead()
        after_word()
        try:
            return early.call.result(self.timeout_s)
        except Exception as err:
            self._drop_go_ahead()
            if early.call.running:
                self._stale = early.call
                self._layout, self._key, self._done = None, None, None
                if not quiet:
                    raise
            logger.warning(
                "refit: the engine's early apply of step %d failed (%s): applies come after the export until the "
                "next open",
                early.step,
                err,
            )
            return None

    def _check_no_stale_call(self) -> None:
        """Refuse a step while an earlier step's apply RPC that outlived its ``timeout_s`` still runs."""
        if self._stale is not None and self._stale.running:
            raise TransportError(
                f"{self._stale.what} of an earlier step has not returned (it outlived the session's timeout_s of "
                f"{self.timeout_s:g} s): the engine or its RPC path is stuck; close the session or restart the engine"
            )
        self._stale = None

    @property
    def live_parameters(self) -> tuple[torch.Tensor, ...]:
        """The trainer parameters the engine reads or quantizes in place, as the last refit planned them
        (each step reads their data addresses: ``live_pointers``); empty before the first."""
        return () if self._routes is None else self._routes.live_parameters

    def _exported_key(self, snapshot: ExportSnapshot, ignored: frozenset[str]) -> tuple:
        """Where the exported tensors are: the last refit's key when they are its very tensors at the
        same addresses (``ExportSnapshot``: sound while the exporter leaves its outputs as it made
        them and the shared storages are held), else noted tensor by tensor."""
        if self._steady is not None and snapshot.same_as(self._steady[0]):
            return self._steady[1]
        exported = LayoutRecorder()
        for name, tensor in snapshot.pairs(ignored):
            exported.add(name, tensor)
        return exported.key

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
        if self._routes is None or not self._routes.serve(bridge, chunks, repr(fp8), self.engine_quantizes):
            self._routes = _plan_routes(bridge, chunks, fp8, self.ignored(bridge), self.engine_quantizes)
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
        made = self._quantize_for_open(routes.quantized)
        pairs, rows_of = [], {}
        for name in order:
            live = routes.live.get(name)
            if live is None:
                pairs.append((name, made[name] if name in made else tensors[name]))
                continue
            tensor = live.tensor() if live.is_view else live.tensor(out=self._rows_buffer(name, live))
            if not live.is_view:
                rows_of[name] = (tensor, (live.source(), live.runs))
            pairs.append((name, tensor))
        # a step through ``through`` is loaded as it arrives (a check may alter any tensor, in place or not):
        # nothing is named as rows or as quantized from rows, and the next step opens anew
        quantized = {} if through is not None else routes.quantized
        recorder = LayoutRecorder()
        for name, tensor in through(iter(pairs)) if through is not None else pairs:
            self._check_device(name, tensor)
            rows = rows_of.get(name)
            named = quantized.get(name)
            recorder.add(
                name,
                tensor,
                rows=rows[1] if through is None and rows is not None and rows[0] is tensor else None,
                quantized=None if named is None else (named[0].source(), named[0].runs, named[1]),
            )
        _synchronize_trainer()
        return self._open(recorder, key, started)

    def _quantize_for_open(self, quantized: dict[str, tuple[LiveRows, str]]) -> dict[str, torch.Tensor]:
        """The weights the engine quantizes, quantized here from their rows for the engine's loader at an
        open (the engine records its copies from these, then quantizes the rows itself): name -> tensor,
        for each weight and its scale, in buffers the session keeps (the engine may quantize into them)."""
        jobs, made = [], {}
        for name, (rows, scale_name) in quantized.items():
            source = rows.source()
            kept = self._quantized_out.get(name)
            if kept is None or tuple(kept[0].shape) != rows.shape or kept[0].device != source.device:
                kept = self._quantized_out[name] = (
                    torch.empty(rows.shape, dtype=FP8_DTYPE, device=source.device),
                    torch.empty(scale_shape(rows.shape), dtype=SCALE_DTYPE, device=source.device),
                )
            jobs += block_row_jobs(source, rows.runs, *kept)
            made[name], made[scale_name] = kept
        if jobs:
            JobQuantizer(jobs).run()
        return made

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

    def _apply(
        self,
        started: float,
        export_cpu_ms: float | None = None,
        early: _EarlyApply | None = None,
        copies_started: Callable[[], None] = lambda: None,
        after_word: Callable[[], None] = lambda: None,
    ) -> RefitStep:
        exported = time.perf_counter()
        # the collector back on as the worker's copies are let go (early), or once the apply returned (late);
        # an early RPC that outlived its timeout raises here
        results = self._end_early_apply(early, apply=True, before_word=copies_started, after_word=after_word)
        if results is not None:
            signal, engine_ms = early.signal, (results[0] if results else None)
        else:
            signal = self._done is not None and self.overlap_follow_up
            engine_ms = self._rpc("mbridge_refit_apply", self._layout.fingerprint, signal)
        applied = time.perf_counter()
        copies_started()  # a late apply's copies are launched (an early one resumed before its word: no-op)
        try:
            self._after_apply()  # with a signal: while the engine's copies run
        finally:
            if signal:
                self._done.wait(self.timeout_s)  # even when the follow-up failed: the caller may touch the tensors next
        done = time.perf_counter()
        return RefitStep(
            tensors=len(self._layout.refs),
            bytes=self._layout.nbytes,
            ms=(done - started) * 1e3,
            opened=False,
            export_ms=(exported - started) * 1e3,
            export_cpu_ms=export_cpu_ms,
            apply_ms=(applied - exported) * 1e3,
            engine_ms=engine_ms,
            reset_ms=(done - applied) * 1e3,
            early=results is not None,
        )

    def _open(self, recorder: LayoutRecorder, key: tuple | None, started: float) -> RefitStep:
        exported = time.perf_counter()
        if self._layout is not None:
            logger.info("refit: the export's layout changed (other storages or tensors): sharing it anew")
        layout, storages = recorder.layout()
        payload = self.transport.share(storages)
        self._layout, self._key, self._done = None, None, None  # the engine drops its open layout first: if
        # anything below fails, the next step opens again instead of applying (or waiting) on the old one
        self._drop_go_ahead()
        line = _listen() if self.early_apply else None
        args = (
            layout.to_wire(),
            payload,
            self.transport.name,
            self.check_first_refit,
            self.allow_partial,
            isinstance(self.transport, CudaIpcTransport),  # an event from the engine's process, on this GPU
        )
        try:
            offer = None if line is None else line.offer(self.timeout_s)
            results = self.call_workers("mbridge_refit_open", *args, offer, RPC_VERSION)
        except BaseException:
            if line is not None:
                line.close()
            raise
        report = results[0] if results else None
        self._go_ahead = _accepted(line, results)
        signal = _done_signal(results, storages)
        self._release_payload()
        self._layout, self._key, self._held, self._payload, self._done = layout, key, storages, payload, signal
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
        if self.after_weights_written is not None:
            self.after_weights_written()

    def _drop_go_ahead(self) -> None:
        if self._go_ahead is not None:
            self._go_ahead.close()
        self._go_ahead = None

    def fingerprints(self) -> dict[str, tuple[int, int]]:
        """The engine's exact per-parameter fingerprints (first worker)."""
        return fingerprints_from_wire(self._rpc("mbridge_refit_fingerprints"))

    def close(self) -> None:
        """Tell the engine to forget the mapped tensors, then release them (also where the engine cannot
        be told: its failure is raised once they are released)."""
        try:
            if self._layout is not None:
                self._rpc("mbridge_refit_close")
        finally:
            self._release()

    def _release(self) -> None:
        self._release_payload()
        self._layout, self._key, self._held, self._rows_out, self._routes = None, None, [], {}, None
        self._quantized_out = {}
        self._steady = None
        self._done = None
        self._drop_go_ahead()

    def _release_payload(self) -> None:
        release = getattr(self.transport, "release", None)
        if release is not None and self._payload is not None:
            release(self._payload)  # the in-process transport keeps storages until told
        self._payload = None

    def _rpc(self, method: str, *args: Any) -> Any:
        """``method`` on every worker; the first worker's result."""
        results = self.call_workers(method, *args)
        return results[0] if results else None


def _plan_routes(
    bridge: ExportsWeights, chunks: tuple, fp8: Any, ignored: frozenset[str], engine_quantizes: bool
) -> _Routes:
    """Which engine tensors are live, which the engine quantizes from live rows, and which the export
    yields (module docstring)."""
    owner = {
        "bridge": bridge,
        "chunks": chunks,
        "fp8": repr(fp8),
        "ignored": ignored,
        "engine_quantizes": engine_quantizes,
    }
    try:
        plan = bridge.export_plan(list(chunks), fp8=fp8)
    except PlanError:
        return _Routes(
            **owner,
            order=None,
            live={},
            quantized={},
            exported=None,
            live_parameters=(),
            registrations=registration_count(),
        )
    order = tuple(e.hf_name for e in plan.entries if e.hf_name not in ignored)
    live = {name: rows for name, rows in bridge.live_rows(list(chunks), fp8=fp8).items() if name not in ignored}
    quantized = {}
    if fp8 is not None and engine_quantizes:
        quantized = {
            name: (rows, scale)
            for name, (rows, scale) in bridge.quantized_live_rows(list(chunks), fp8=fp8).items()
            if name not in ignored and scale not in ignored
        }
    scales = {scale for _, scale in quantized.values()}
    exported = frozenset(name for name in order if name not in live and name not in quantized and name not in scales)
    parameters = {id(rows.parameter): rows.parameter for rows in (*live.values(), *(r for r, _ in quantized.values()))}
    everything = not live and not ignored and not quantized
    return _Routes(
        **owner,
        order=order,
        live=live,
        quantized=quantized,
        exported=None if everything else exported,
        live_parameters=tuple(parameters.values()),
        registrations=registration_count(),  # after the bridge looked its parameters up again
    )


class _StepKey(NamedTuple):
    """Where a step's engine tensors were: the exported ones (``IpcSession._exported_key``) and the live
    parameters' bytes (``live_pointers``). A step that finds both where the open found them replays."""

    exported: tuple
    pointers: tuple[int, ...]


@dataclass(frozen=True)
class _EarlyApply:
    """A steady step's apply RPC in flight before the export (``IpcSession._start_early_apply``)."""

    step: int  # its go-ahead's number
    signal: bool  # it asked the worker to record the replay's event
    call: WorkerCall


_ACCEPT_S = 10.0  # the worker connected during its open, which has returned: its connection is in (or refused)


def _listen() -> GoAheadLine | None:
    """A new go-ahead line for an open, or None where this host has none (the applies come late)."""
    try:
        return GoAheadLine.listen()
    except OSError as err:
        logger.info("refit: no go-ahead line on this host (%s): every apply comes after the export", err)
        return None


def _accepted(line: GoAheadLine | None, results: list) -> GoAheadLine | None:
    """``line`` once its worker connected (one worker that reported ``go_ahead``, from the pid it reported),
    else closed: None."""
    if line is None:
        return None
    report = results[0] if len(results) == 1 and isinstance(results[0], dict) else {}
    if not report.get("go_ahead"):
        reason = report.get("go_ahead_error") or "the engine did not take the line"
        logger.info("refit: no go-ahead line (%s): every apply comes after the export", reason)
        line.close()
        return None
    try:
        line.accept(_ACCEPT_S, peer_pid=report.get("go_ahead_pid"))
    except GoAheadError as err:
        logger.warning("refit: the engine's go-ahead connection never arrived (%s): applies come late", err)
        line.close()
        return None
    return line


def _done_signal(results: list, storages: list[torch.UntypedStorage]) -> DoneSignal | None:
    """The engine's replay event from its open report, on the GPU of the shared storages; None where its
    applies return when done: no handle, or more than one worker answered (each would signal its own)."""
    handle = results[0].get("completion") if len(results) == 1 and isinstance(results[0], dict) else None
    if handle is None:
        return None
    device = storages[0].device if storages and storages[0].device.type == "cuda" else None
    return DoneSignal.open(handle, device or torch.device("cuda", torch.cuda.current_device()))


def live_pointers(parameters: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """Where each live parameter's bytes are, read every step (a ``param.data`` swap changes it): one C
    call per parameter, no Python call per parameter."""
    return tuple(map(torch.Tensor.data_ptr, parameters))


def _synchronize_trainer() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
