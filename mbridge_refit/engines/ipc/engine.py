"""The colocated transport's engine side, engine-agnostic: open a shared layout, apply steps, report.

The trainer side is an engine adapter's ``ipc`` session (``engines.base``; for vLLM
``engines.vllm.VLLMRefit``), which shares the export's storages by CUDA IPC (``engines.ipc.sharing``);
the engine's worker extension hands its RPCs to a ``RefitReceiver``. Protocol (any RPC that
carries plain data works):

1. ``open(wire, payload, transport)``: the trainer's first step, and every step whose layout
   changed. Runs the engine adapter's ``precheck`` first (what the engine cannot take, refused by
   name before anything is mapped or loaded: for vLLM, DeepGEMM processing a refit cannot redo,
   ``engines.vllm.deep_gemm``). Maps the shared storages, runs the engine's loader once per tensor
   while recording its copies (this *is* the step's load), composes the copies of tensors that name their rows
   so they read those rows where the trainer keeps them (``ApplyPlan.compose_rows``), has the
   FP8 tensors that name their BF16 rows quantized from those rows on every replay, into the
   parameters where the loader copies them whole (``ApplyPlan.compose_quantized``), optionally
   proves the recording against the loader (``ApplyPlan.check_against_loader``), and returns a
   report: what was loaded against what the engine holds (``missing`` parameters,
   ``unexpected`` tensors, ``partial`` parameters). Any missing or unexpected name fails the
   open (``EngineRefitError``) unless ``allow_partial``.
2. ``apply(fingerprint, signal)``: every later step. Refuses a fingerprint that is not the open
   layout's (the trainer's export changed without a new ``open``), replays, and either waits for the
   copies (the trainer may overwrite its buffers once the call returns) or, with ``signal`` on a
   layout opened with ``completion=True`` on a CUDA device, records the shared event of
   ``engines.ipc.completion`` and returns at once: the trainer then waits on that event before it
   touches the tensors the engine reads. Returns the milliseconds the worker spent. If the engine
   has replaced a parameter the plan writes (a weight reload through another path), it records its
   loader again instead of replaying into the old storage. An early apply (``go=step``, on a layout
   opened with a go-ahead line: ``open(..., go_ahead=offer)``, ``engines.ipc.go_ahead``) arrives while the
   trainer still exports: the worker makes its own checks (the fingerprint, its replaced
   parameters), then waits for the trainer's word for that step and reads nothing of the trainer's
   memory before it; told to skip, it returns None and leaves everything as it was.
3. ``close()``: forgets the plan and the mapped storages.

A layout whose tensors are an engine rank's shards (``sharing.ShardBox``: a sharded refit, each
engine rank fed its part by ``runtime.sharded_transfer``) opens the same way, the loader recorded
against full-size tensors built around the shards, one at a time, and every recorded read moved
into its shard (``engines.replay.shard_remap``, ``ApplyPlan.record(shards=...)``); no full-size tensor is
kept but for those the loader loads every step.

Lifetimes: the mapped storages belong to the trainer; the trainer keeps them alive and
unchanged from the start of its export until ``open``/``apply`` returns. The engine writes into one
kind of them only: the FP8 tensors it quantizes itself (``QuantizedRef``), which the trainer writes
at an open and then leaves to the engine for the layout's life. No engine memory is allocated after
``open`` (the plan holds views and the quantizer's launch tables, made there).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mbridge_refit.engines.ipc.completion import ReplayDone
from mbridge_refit.engines.ipc.go_ahead import GoAheadError, GoAheadWaiter
from mbridge_refit.engines.ipc.sharing import (
    TRANSPORTS,
    SharedLayout,
    SharingError,
    quantized_sources,
    row_sources,
    views,
)
from mbridge_refit.engines.replay.apply_plan import (
    ApplyPlan,
    ApplyPlanError,
    LoadWeights,
    Recompute,
    Shards,
    StagedLoad,
)
from mbridge_refit.errors import EngineError

__all__ = ["EngineRefitError", "OpenReport", "RefitReceiver"]

logger = logging.getLogger(__name__)


class EngineRefitError(EngineError):
    """A refit cannot be applied as asked (names the problem and the fix)."""


@dataclass
class OpenReport:
    """What an ``open`` found, returned to the trainer (plain data)."""

    fingerprint: str
    tensors: int
    storages: int
    bytes: int
    copies: int
    composed: int  # tensors read from the rows they are copies of (never from the copy)
    shards: int  # tensors that are this engine rank's shards (recorded full-size, read from the shard)
    refreshed: list[str]  # tensors with rows whose copies could not be composed: rebuilt before each replay
    via_loader: list[str]
    recomputed: list[str]  # modules whose derived parameters the engine recomputes after each replay
    missing: list[str]
    unexpected: list[str]
    partial: list[str]
    checked_against_loader: bool
    open_ms: float
    completion: str | None = None  # the IPC handle of the event each replay records (``engines.ipc.completion``)
    quantized: int = 0  # FP8 tensors this engine quantizes from the trainer's rows each replay (``QuantizedRef``)
    quantized_in_place: int = 0  # of those, written straight into its parameters (no copy after)
    go_ahead: bool = False  # connected to the trainer's go-ahead line: early applies wait on it
    go_ahead_error: str | None = None  # why an offered line could not be reached (applies come late)
    go_ahead_pid: int | None = None  # this worker's pid, the one the trainer accepts on the line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RefitReceiver:
    """Engine-side state of one refit session (see the module docstring for the protocol)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        load_weights: LoadWeights | None = None,
        staged: StagedLoad | None = None,
        recompute: Recompute | None = None,
        precheck: Callable[[], object] | None = None,
    ) -> None:
        self.model = model
        self._precheck = precheck  # the engine's own refusals, before an open maps or loads anything
        self.device = device
        self._load_weights = load_weights
        self._staged = staged  # the engine's reload bracket, for models whose loaders fail after processing
        self._staged_in_use = False
        self._recompute = recompute  # the engine's own code for parameters it derives from others
        self._plan: ApplyPlan | None = None
        self._fingerprint: str | None = None
        self._storages: list = []
        self._shards: Shards = {}
        self._done: ReplayDone | None = None  # set when the trainer waits on an event instead of the apply RPC
        self._checked = False  # the open layout's plan was proven against the loader (so is a re-recorded one)
        self._go_ahead: GoAheadWaiter | None = None  # the trainer's go-ahead line, for early applies

    def open(
        self,
        wire: dict[str, Any],
        payload: bytes,
        transport: str,
        *,
        check: bool = True,
        allow_partial: bool = False,
        completion: bool = False,
        go_ahead: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        started = time.perf_counter()
        self.close()
        if self._precheck is not None:
            self._precheck()  # raises naming what this engine cannot take, and the fix: nothing has moved yet
        layout = SharedLayout.from_wire(wire)  # a layout of another version: refused before the line is connected
        go_ahead_error = None
        if go_ahead is not None:  # first: the trainer takes the connection when this open returns
            try:
                self._go_ahead = GoAheadWaiter.connect(go_ahead)
            except GoAheadError as err:
                go_ahead_error = str(err)
                logger.info("refit: no go-ahead line (%s): every apply waits for the trainer's export", err)
        if transport not in TRANSPORTS:
            raise EngineRefitError(f"unknown transport {transport!r}; known: {sorted(TRANSPORTS)}")
        try:
            storages = TRANSPORTS[transport]().open(payload, self.device)
            sources = views(layout, storages, self.device)
            rows = row_sources(layout, storages, self.device)
            quantized = quantized_sources(layout, storages, self.device)
        except SharingError as err:
            raise EngineRefitError(f"cannot map the trainer's tensors: {err}") from err
        shards = _shards(layout, sources)
        plan = self._record(sources, shards)
        refreshed = plan.compose_rows(rows)
        in_place = plan.compose_quantized(quantized)
        _synchronize(self.device)
        if self._staged_in_use and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the reload's staging tensors: return their blocks, not keep them reserved
        if (plan.missing or plan.unexpected) and not allow_partial:
            raise EngineRefitError(_mismatch_message(plan))
        if check:
            plan.check_against_loader()
            _synchronize(self.device)
        self._plan, self._fingerprint, self._storages, self._shards = plan, layout.fingerprint, storages, shards
        self._checked = check
        self._done = ReplayDone.for_device(self.device) if completion else None
        report = OpenReport(
            fingerprint=layout.fingerprint,
            tensors=len(layout.refs),
            storages=len(storages),
            bytes=layout.nbytes,
            copies=plan.copies,
            composed=len(rows) - len(refreshed),
            shards=len(shards),
            refreshed=refreshed,
            via_loader=plan.via_loader,
            recomputed=plan.recomputed,
            missing=plan.missing,
            unexpected=plan.unexpected,
            partial=plan.partial,
            checked_against_loader=check,
            open_ms=(time.perf_counter() - started) * 1e3,
            completion=None if self._done is None else self._done.handle,
            quantized=len(quantized),
            quantized_in_place=len(in_place),
            go_ahead=self._go_ahead is not None,
            go_ahead_error=go_ahead_error,
            go_ahead_pid=None if self._go_ahead is None else os.getpid(),
        )
        if plan.via_loader:
            logger.info(
                "refit: %d tensor(s) go through the engine's loader every step, e.g. %s",
                len(plan.via_loader),
                plan.via_loader[:3],
            )
        if plan.recomputed:
            logger.info(
                "refit: the engine recomputes the derived parameters of %d module(s) after every replay, e.g. %s",
                len(plan.recomputed),
                plan.recomputed[:3],
            )
        return report.to_dict()

    def apply(self, fingerprint: str, *, signal: bool = False, go: int | None = None) -> float | None:
        """Replay the open layout (module docstring, step 2); the milliseconds spent from the trainer's
        go-ahead (or the call's start) to the return. ``go``: the step number of an early apply, which
        waits for the trainer's word after this worker's own checks (``GoAheadWaiter.wait``); None when
        told to skip."""
        started = time.perf_counter()
        if self._plan is None:
            raise EngineRefitError(
                "no refit layout is open on this engine: the trainer must open one first "
                "(its refit session does on its first step)"
            )
        if fingerprint != self._fingerprint:
            raise EngineRefitError(
                f"plan mismatch: the trainer's step has layout {fingerprint} but this engine opened {self._fingerprint}; "
                "the trainer must open the new layout (its refit session does when its export changes)"
            )
        moved = self._plan.reallocated(self.model)  # before any copy: a replaced parameter's old storage may be freed
        if go is not None:
            if self._go_ahead is None:
                raise EngineRefitError(
                    "an early apply on a layout opened without a go-ahead line: the trainer must apply late "
                    "(its session does when the open report has no go_ahead)"
                )
            try:
                if not self._go_ahead.wait(go):
                    return None
            except GoAheadError as err:
                raise EngineRefitError(f"step {go}'s go-ahead never came: {err}") from err
            started = time.perf_counter()
        try:
            if moved:
                self._record_again()
            else:
                self._plan.replay()
        except BaseException:
            _synchronize(self.device)  # nothing launched may still run when the caller hears of the failure
            raise
        if signal and self._done is not None:
            self._done.record()  # the trainer waits on it (module docstring)
        else:
            _synchronize(self.device)
        return (time.perf_counter() - started) * 1e3

    def _record_again(self) -> None:
        """The engine replaced parameters the plan writes: record its loader again from the same sources."""
        self._plan.refresh_sources()
        plan = self._record([(s.name, s.source) for s in self._plan.steps], self._shards)
        plan.compose_rows(self._plan.rows)
        plan.compose_quantized(self._plan.quantized)
        if self._checked:  # as the open was: the new plan's copies and in-place quantizing proven before use
            plan.check_against_loader()
        self._plan = plan

    def close(self) -> None:
        self._plan, self._fingerprint, self._storages, self._shards, self._done = None, None, [], {}, None
        if self._go_ahead is not None:
            self._go_ahead.close()
        self._go_ahead = None

    def _record(self, sources: list[tuple[str, torch.Tensor]], shards: Shards) -> ApplyPlan:
        """The engine's loader recorded plainly; where it fails (the engine replaced a parameter
        after processing, as vLLM's FP8 layers do) and a reload bracket is known, through it."""
        if not self._staged_in_use:
            try:
                return ApplyPlan.record(
                    self.model, sources, self._load_weights, recompute=self._recompute, shards=shards
                )
            except ApplyPlanError as err:
                if self._staged is None:
                    raise
                logger.info(
                    "refit: the engine's loader fails on its processed parameters (%s); recording through "
                    "its reload instead",
                    err,
                )
        self._staged_in_use = True
        return ApplyPlan.record(
            self.model, sources, self._load_weights, staged=self._staged, recompute=self._recompute, shards=shards
        )

    @property
    def last_go_ahead(self) -> dict[str, float | None]:
        """The last early apply's word: its way from the trainer's sending to this worker's reading it
        (``wake_ms``, on the host's monotonic clock) and the wait (``waited_ms``); None before any."""
        line = self._go_ahead
        return {
            "wake_ms": None if line is None else line.last_wake_ms,
            "waited_ms": None if line is None else line.last_waited_ms,
        }

    @property
    def is_open(self) -> bool:
        return self._plan is not None

    @property
    def staged_load(self) -> StagedLoad | None:
        """The reload bracket the open layout was recorded through (None: plain loads)."""
        return self._staged if self._staged_in_use else None

    @property
    def plan(self) -> ApplyPlan | None:
        """The open layout's recorded plan (None before ``open``)."""
        return self._plan


def _shards(layout: SharedLayout, sources: list[tuple[str, torch.Tensor]]) -> Shards:
    """``{name: (shard view, HF shape, box)}`` of the layout's tensors that are shards of larger HF tensors."""
    tensors = dict(sources)
    return {
        ref.name: (tensors[ref.name], ref.shard.shape, ref.shard.box) for ref in layout.refs if ref.shard is not None
    }


def _mismatch_message(plan: ApplyPlan) -> str:
    parts = []
    if plan.missing:
        parts.append(f"{len(plan.missing)} engine parameter(s) received nothing, e.g. {plan.missing[:5]}")
    if plan.unexpected:
        parts.append(
            f"{len(plan.unexpected)} exported tensor(s) were not loaded by the engine, e.g. {plan.unexpected[:5]}"
        )
    return (
        "the export does not match the engine's model: "
        + "; ".join(parts)
        + ". Check that the engine was started from the same architecture and config (and the same FP8 "
        "quantization_config for an FP8 refit); pass allow_partial=True to refit a subset on purpose"
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
