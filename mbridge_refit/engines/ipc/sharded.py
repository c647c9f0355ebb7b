"""The colocated refit into a tensor-parallel engine, engine-agnostic: each engine worker gets only
its shard from the sharded transfer and replays its own loader from it.

Placement: engine rank ``r`` runs on the GPU of trainer rank ``engine_ranks[r]`` (default ``r``:
trainer rank i hosts engine worker i). Every step, on every trainer rank of ``group``:

1. ``ShardedTransfer.run(shards)`` (``runtime.sharded_transfer``): each trainer rank's buffers
   receive the shards of the engine rank it hosts, straight from the trainer's parameters
   (collective; a trainer layout that agrees with the engine's moves nothing between ranks).
2. First step (or after ``close``): every rank describes its shards as a shared layout
   (``sharing.SharedLayout``, each tensor a ``ShardBox``: the HF tensor's shape and the shard's
   box) and shares their storages (CUDA IPC on its own GPU; in-process on CPU); the layouts and
   payloads of all engine ranks are gathered to every rank (one object gather). Each rank that
   holds a handle on the engine calls ``mbridge_refit_open_shards`` with the lists; each worker
   takes its own engine rank's entry (``worker_entry``) and opens it (``engines.ipc.engine.RefitReceiver``:
   the loader recorded against full-size tensors around the shards, every read moved into the
   shard, proven against the loader).
3. Later steps: ``mbridge_refit_apply_shards`` with every engine rank's layout fingerprint; each
   worker replays from its shards.

Who holds a handle: a multi-process engine (vLLM's default executor) is reached from one trainer
rank, whose call reaches every worker; an engine that runs inside the trainer's processes (vLLM's
``external_launcher``, the CPU tests) is reached by every rank, each call reaching its own worker.
Either way every worker gets every rank's entry and picks its own. The outcome of each call is
shared over the group (one object gather), so an engine's refusal raises on every trainer rank.
Before a call the ranks pass a barrier: a worker reads another trainer rank's buffers only once
that rank's transfer is done (each rank synchronizes its stream first). These control messages go
over a gloo group of the same ranks, made at the first ``open`` (collective over the whole job, as
``torch.distributed.new_group`` is): a rank waiting for the engine's answer then waits on the CPU,
not in an NCCL kernel that would share its GPU with the engine worker replaying there.

Blockwise FP8 (``fp8="blockwise"`` or a ``fp8.format.BlockwiseFP8Config``, for an engine started
from an FP8 checkpoint): the transfer still moves the trainer's BF16 values into the shards; then
each rank quantizes its shards of the weights the FP8 plan quantizes (``fp8.plan.fp8_plan``: the
config's keep patterns, routers and norms stay in their dtype) on its own device into FP8 data and
scale buffers made at the open and kept (``fp8.quantize.ShardQuantizer``), and those are what the
engine maps: the weight as its box of the full-size FP8 tensor, ``<name>_scale_inv`` as the scale
tensor's box ``fp8.format.scale_box(box)``. That equals the whole tensor's quantization cut to the
box only where each box starts on a 128-element block and ends on one or at the tensor's end, in
both dimensions; any other layout is refused by name before anything is allocated or moved
(``fp8.plan.check_engine_boxes``: the tensor, the engine rank's box and the fix).

Refused by name: an FP8 layout off the block grid (above), and a step with another model, bridge or
``fp8`` than the open one (``close`` first).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.engines.base import RPC_VERSION, CallWorkers, RefitStep
from mbridge_refit.engines.ipc.sharing import LayoutRecorder, ShardBox, SharedLayout, Transport
from mbridge_refit.errors import EngineError, InputError
from mbridge_refit.fp8.format import scale_box, scale_name, scale_shape
from mbridge_refit.fp8.plan import check_engine_boxes
from mbridge_refit.fp8.quantize import ShardQuantizer

__all__ = ["ShardedIpcSession", "ShardedRefitError", "worker_entry"]


class ShardedRefitError(EngineError):
    """A sharded colocated refit the engine or a trainer rank refused (the rank and the reason named)."""


def worker_entry(entries: list, engine_rank: int, what: str) -> Any:
    """Engine rank ``engine_rank``'s entry of a list sent to every worker (worker side)."""
    if not 0 <= engine_rank < len(entries) or entries[engine_rank] is None:
        raise ShardedRefitError(
            f"no {what} for engine rank {engine_rank}: the trainer sent {len(entries)} engine ranks' entries "
            f"({[i for i, e in enumerate(entries) if e is not None]} filled). The engine's tensor-parallel size must be "
            "the transfer plan's, and engine rank r must run on the GPU of the trainer rank the plan places it on"
        )
    return entries[engine_rank]


class ShardedIpcSession:
    """Trainer side of a sharded colocated refit (module docstring for the protocol).

    ``call_workers``: how this rank calls the engine's workers (None on a rank without a handle).
    ``engine``: the engine's layout (``"tp2"``, ``plan.engine_layout.EngineLayout``).
    ``ignored``: exported names the engine skips (a tied output layer), left out of the plan.
    ``transport``: shares this rank's shard storages with the worker on its GPU.
    ``after_weights_written``: called on each rank with a handle once the workers hold the new weights
    (the engine's own follow-up, e.g. dropping caches computed with the old ones); it failing fails
    the step on every rank, like a worker's refusal.
    """

    def __init__(
        self,
        call_workers: CallWorkers | None,
        *,
        engine: Any,
        transport: Transport,
        ignored: Callable[[Any], frozenset[str]] = lambda bridge: frozenset(),
        engine_ranks: Iterable[int] | None = None,
        group: Any = None,
        check_first_refit: bool = True,
        allow_partial: bool = False,
        after_weights_written: Callable[[], None] | None = None,
    ) -> None:
        self.call_workers = call_workers
        self.after_weights_written = after_weights_written
        self.engine = engine
        self.transport = transport
        self.ignored = ignored
        self.engine_ranks = None if engine_ranks is None else tuple(engine_ranks)
        self.group = group
        self.check_first_refit = check_first_refit
        self.allow_partial = allow_partial
        self.plan = None
        self._owner: tuple | None = None  # (bridge, chunks, FP8 config) the transfer reads
        self._transfer = None
        self._shards: dict[str, torch.Tensor] = {}
        self._quantizer: ShardQuantizer | None = None  # FP8: this rank's quantized shards, kept
        self._layout: SharedLayout | None = None
        self._fingerprints: list[str | None] | None = None
        self._payload: bytes | None = None
        self._held: list = []  # this rank's shard storages the worker maps
        self._hf_shapes: dict[str, tuple[int, ...]] = {}
        self._control: Any = None  # gloo group of the same ranks, for the control messages
        self.last_reports: list[dict] = []

    def open(self, bridge: Any, model: Any, *, fp8: Any = None) -> None:
        """Plan the transfer (collective on the first call for a model) and allocate this rank's
        shards (with ``fp8``, and their FP8 buffers); the engine opens them on the first ``refit``.
        An FP8 layout off the block grid raises ``FP8FormatError`` on every rank, before any shard
        is allocated or any byte moves."""
        chunks = tuple(model if isinstance(model, list) else [model])
        config = bridge.fp8_config(fp8)
        if self._owner is not None and (
            self._owner[0] is not bridge or self._owner[1] != chunks or self._owner[2] != config
        ):
            raise InputError("this sharded refit session is open for another model, bridge or fp8: close() it first")
        if self._transfer is None:
            entries = bridge.export_plan(list(chunks)).entries
            quantizing = None if config is None else bridge.export_plan(list(chunks), fp8=config)  # refuses by name
            ignored = self.ignored(bridge)
            names = [e.hf_name for e in entries]
            plan = bridge.transfer_plan(
                list(chunks),
                self.engine,
                engine_ranks=self.engine_ranks,
                only=[n for n in names if n not in ignored] if ignored & set(names) else None,
            )
            if quantizing is not None:
                check_engine_boxes(quantizing, plan)
            self.plan = plan
            self._transfer = bridge.sharded_transfer(list(chunks), self.plan, group=self.group)
            if self._control is None:
                self._control = _control_group(self.group)
            self._shards = self._transfer.allocate_shards()
            if quantizing is not None:
                quantized = {e.scale_of for e in quantizing.entries if e.scale_of is not None}
                self._quantizer = ShardQuantizer({n: t for n, t in self._shards.items() if n in quantized})
            self._hf_shapes = {e.hf_name: tuple(e.shape) for e in entries}
            self._owner = (bridge, chunks, config)

    def refit(self, bridge: Any, model: Any, *, fp8: Any = None) -> RefitStep | None:
        """One step on every trainer rank of ``group``: the sharded transfer, then the engine opens
        (first step) or replays. Returns the step on a rank with a handle (None elsewhere); raises
        on every rank when a worker or a rank refused."""
        started = time.perf_counter()
        self.open(bridge, model, fp8=fp8)
        self._transfer.run(self._shards)
        if self._quantizer is not None:
            self._quantizer.run()
        _synchronize()
        transferred = time.perf_counter()
        opened = self._fingerprints is None
        results = self._open_engine() if opened else self._apply_engine()
        done = time.perf_counter()
        if self.call_workers is None:
            return None
        layout = self._layout
        return RefitStep(
            tensors=len(layout.refs),
            bytes=layout.nbytes,
            ms=(done - started) * 1e3,
            opened=opened,
            report=results[0] if opened and results else None,
            export_ms=(transferred - started) * 1e3,
            apply_ms=(done - transferred) * 1e3,
            engine_ms=None if opened else max(results, default=None),
            workers=results if opened else [],
        )

    def close(self) -> None:
        """Tell the workers to forget the mapped shards (from ranks with a handle), then release them."""
        if self._fingerprints is not None and self.call_workers is not None:
            self.call_workers("mbridge_refit_close")
        release = getattr(self.transport, "release", None)
        if release is not None and self._payload is not None:
            release(self._payload)
        self._owner, self._transfer, self._shards, self._quantizer, self.plan = None, None, {}, None, None
        self._layout, self._fingerprints, self._payload, self._held = None, None, None, []

    @property
    def shards(self) -> dict[str, torch.Tensor]:
        """This rank's engine shards (hf_name -> tensor), valid until ``close``."""
        return self._shards

    def _open_engine(self) -> list:
        recorder = LayoutRecorder()
        for shard in self.plan.shards_on(dist.get_rank()):
            name, shape = shard.hf_name, self._hf_shapes[shard.hf_name]
            if self._quantizer is None or name not in self._quantizer.q:
                recorder.add(name, self._shards[name], shard=ShardBox(shape, shard.box))
                continue
            recorder.add(name, self._quantizer.q[name], shard=ShardBox(shape, shard.box))
            recorder.add(
                scale_name(name), self._quantizer.scales[name], shard=ShardBox(scale_shape(shape), scale_box(shard.box))
            )
        layout, storages = recorder.layout()
        payload = self.transport.share(storages) if layout.refs else None
        self._layout, self._held, self._payload = layout, storages, payload
        entries = self._gather((self._engine_rank(), layout.to_wire() if layout.refs else None, payload))
        wires, payloads = [None] * len(self.plan.engine_ranks), [None] * len(self.plan.engine_ranks)
        for engine_rank, wire, shared in entries:
            if engine_rank is not None:
                wires[engine_rank], payloads[engine_rank] = wire, shared
        self._fingerprints = [None if w is None else SharedLayout.from_wire(w).fingerprint for w in wires]
        results = self._call(
            "mbridge_refit_open_shards",
            wires,
            payloads,
            self.transport.name,
            self.check_first_refit,
            self.allow_partial,
            RPC_VERSION,
        )
        self.last_reports = results
        return results

    def _apply_engine(self) -> list:
        return self._call("mbridge_refit_apply_shards", self._fingerprints)

    def _call(self, method: str, *args: Any) -> list:
        """``method`` (an open or a replay: both write the weights) on the workers from every rank with a
        handle, after every rank's transfer, then ``after_weights_written``; the outcome shared over
        ``group`` (every rank raises if one call failed)."""
        dist.barrier(group=self._control)
        results, failure = [], None
        if self.call_workers is not None:
            try:
                results = list(self.call_workers(method, *args))
                if self.after_weights_written is not None:
                    self.after_weights_written()
            except Exception as err:  # the engine's refusal: shared, then raised on every rank
                failure = f"rank {dist.get_rank()}: {type(err).__name__}: {err}"
        failures = [f for f in self._gather(failure) if f is not None]
        if failures:
            if method == "mbridge_refit_open_shards":
                self._fingerprints = None
            raise ShardedRefitError(f"{method} failed: " + "; ".join(failures))
        return results

    def _gather(self, item: Any) -> list:
        out = [None] * dist.get_world_size(self._control)
        dist.all_gather_object(out, item, group=self._control)
        return out

    def _engine_rank(self) -> int | None:
        rank = dist.get_rank()
        return self.plan.engine_ranks.index(rank) if rank in self.plan.engine_ranks else None


def _control_group(group: Any) -> Any:
    """A gloo group of ``group``'s ranks (``group`` itself when it is gloo already)."""
    if dist.get_backend(group) == dist.Backend.GLOO:
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
