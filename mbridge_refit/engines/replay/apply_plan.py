"""The copies an engine's own loader performs, recorded once and replayed every refit.

An engine's ``load_weights`` knows how HF tensors land in its parameters (q, k and v into one
fused ``qkv_proj``, experts into a stacked tensor, a tensor-parallel slice per rank). Reading it
again every step costs name parsing and Python per tensor; re-implementing it per model would
be a second truth. Instead the first refit runs the engine's loader once per tensor under a
``TorchFunctionMode`` that records every ``copy_`` (and ``__setitem__``) from a source tensor
into a parameter: the destination view, the source view. Later refits replay exactly those
copies; the sources are views of the same shared storages, so a replay reads the new step's
bytes. A tensor whose loading is not plain copies from the source (a conversion into a
temporary first, an in-place op on a parameter) is loaded by the engine's loader every step.

Engines that rework a layer's weights after loading it (vLLM's FP8 layers re-register their
parameters, so their loaders no longer run on the processed layer) are recorded through a
*staged* load: the engine's own reload bracket (``StagedLoad``: vLLM's layerwise reload) puts the
loadable parameters back, its loader writes into staging tensors, the layer is processed, and
the results are copied into the parameters the engine computes with. The recorder composes the
two copies (source → staging, staging → parameter) into one, source → parameter, which is exact
when processing kept those bytes as they were; the check below proves that it did. Where processing
wrote over bytes a source put in a staging tensor (vLLM's DeepGEMM requantizes a block-FP8 weight and
its scale to power-of-two scales in place), the parameters that tensor is copied into are *processed*:
the composed copies put the exported bytes there, and the engine processes them again after every
replay's copies (``Recompute``, below); a processed parameter the engine cannot process again is
refused by name when the plan is made, checked or not. A copy of a
tensor onto itself is no copy and is not recorded (vLLM's reload copies every kernel tensor back,
also those it never staged, such as DeepSeek's ``e_score_correction_bias``).

Some parameters are not loaded at all but *derived* by the engine's processing from others
(vLLM's MLA computes ``W_UV`` and ``W_UK_T`` from ``kv_b_proj``, dequantized, after every load).
The engine names how to recompute a module's derived (or processed) parameters through its own code
(``Recompute``); a plan runs that after its copies on every replay, the modules of processed parameters
first (a layer's processing reads its own parameters, a derived one may read theirs), then by name. Derived
parameters are what the reload's final processing writes from anything but a staged source, or,
without a reload, the parameters the loader left unwritten. A derived parameter the engine cannot
recompute is refused by name. Under a reload every tensor must be plain copies: replaying the
loader for one tensor outside the bracket writes checkpoint-format data into processed parameters
(or fails on them), and inside it only a complete layer is ever processed, so one tensor would
cost reloading its whole layer and a walk over every module each step; the plan refuses instead,
naming each tensor with what its loader did.

A source that is a copy of row runs of another tensor (the trainer's q, k and v are runs of its
fused QKV parameter) is *composed* (``compose_rows``): every recorded copy that reads whole rows
of the copy is rewritten to read the same rows from the runs, equally spaced runs as one
strided copy, so a replay moves each byte once, from where the trainer keeps it, and the copy is
never refreshed. A source whose copies cannot be rewritten so is refreshed from its runs before
each replay instead (correct, one copy more).

A blockwise FP8 source that is the quantization of row runs of another tensor (the trainer's expert
and attention weights, ``sharing.QuantizedRef``) is quantized by the engine itself on every replay,
before the copies (``compose_quantized``, ``fp8.quantize.JobQuantizer``): where the loader's only use
of the weight and of its scale was one copy of each, whole, the quantizer writes straight into those
destinations and the copies are dropped; otherwise it writes into the source, which the copies read.
``check_against_loader`` then proves the plan against what the loader loaded from those sources.

A source may be an engine rank's shard of the HF tensor the loader expects (a sharded refit,
``record(shards=...)``): the loader is recorded against a full-size tensor built around the shard,
and every recorded read is moved into the shard (``engines.replay.shard_remap``). In a plain recording
that happens right after the tensor's load, so one full-size tensor is alive at a time (but for
those the loader loads every step); under a reload bracket, which may hold a layer's tensors until
the layer is complete, after the bracket.

``check_against_loader`` proves a plan before it is trusted: after the recorded load, it
fingerprints every written parameter (and every other parameter viewing a derived one's memory:
vLLM registers ``W_UV`` and ``W_UK_T`` as strided views of one tensor), overwrites them with a
pattern, replays, and requires the same fingerprints bit for bit. Engine-agnostic: needs a module and its loader.

Sources that arrive a few at a time into memory that is then reused (the broadcast transport's
rotating receive buffers) are recorded with ``LoadRecording`` one source at a time (``record`` is
it over a list). Such a plan cannot be proven at the end, when most sources have been
overwritten, so each group of sources is proven while it is still there (``LoadRecording.check``:
the loader and the replay each run again from the same scribbled parameters and must leave the
same bytes, then the recorded load's bytes are put back) and compiled into one call that replays
it: each run of copies into disjoint memory as one ``torch._foreach_copy_`` (one launch on CUDA
however many tensors), a loader step or overlapping memory cutting the run.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mbridge_refit.engines.replay.copy_batches import CopySchedule, byte_span
from mbridge_refit.engines.replay.fingerprint import differing, named_fingerprints
from mbridge_refit.engines.replay.shard_remap import (
    OUTSIDE_PATTERNS,
    Box,
    ShardRemapError,
    box_view,
    expand,
    fill_outside,
    remap,
)
from mbridge_refit.errors import EngineError
from mbridge_refit.fp8.format import FP8_DTYPE, SCALE_DTYPE, scale_shape
from mbridge_refit.fp8.quantize import JobQuantizer, block_row_jobs, block_row_runs

__all__ = [
    "ApplyPlan",
    "ApplyPlanError",
    "Copy",
    "LoadRecording",
    "LoadWeights",
    "Recompute",
    "Runs",
    "Shards",
    "StagedLoad",
]

logger = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]
Runs = tuple[tuple[int, int, int], ...]  # (row of the source tensor, row of the rows' origin, rows)
Copy = tuple[torch.Tensor, torch.Tensor]  # (destination, source)
# an engine module -> the engine's own code that recomputes its derived parameters in place (None: none)
Recompute = Callable[[torch.nn.Module], Callable[[], object] | None]
Shards = dict[str, tuple[torch.Tensor, tuple[int, ...], Box]]  # source name -> (its shard, HF shape, box)


_SCRIBBLE = 0x5A


@dataclass(frozen=True)
class StagedLoad:
    """An engine's reload bracket: ``begin()`` before loading (the loaders write into staging
    tensors), ``end()`` after the last tensor (every layer processed and copied back)."""

    begin: Callable[[], object]
    end: Callable[[], object]

    @contextlib.contextmanager
    def around(self, during_end: Callable[[], Any] = contextlib.nullcontext) -> Iterator[None]:
        """``begin()``, the block, then ``end()`` (also when the block raises), inside ``during_end()``."""
        self.begin()
        try:
            yield
        finally:
            with during_end():
                self.end()


class ApplyPlanError(EngineError):
    """The engine's loader cannot be recorded, or a replay does not reproduce it."""


@dataclass
class _Step:
    """What one source tensor does to the engine: plain copies, or a call of the loader."""

    name: str
    source: torch.Tensor
    copies: list[Copy] = field(default_factory=list)  # (destination, source view)
    via_loader: bool = False
    reason: str = ""  # why the loader's work is not plain copies (the first thing seen)
    wrote: bool = False  # some engine tensor took bytes of this source (perhaps while a later source loaded)
    refresh: list[Copy] = field(default_factory=list)  # run before the step: the source rebuilt from its rows
    composed: bool = False  # the copies read the source's rows where they live, not the source
    targets: set[str] = field(default_factory=set)  # engine tensors this source's load wrote (seen)


@dataclass
class ApplyPlan:
    """Recorded application of one shared layout into one engine model.

    ``steps`` in export order; ``written`` maps each engine parameter to the bytes written into
    it; ``unexpected`` lists source names the loader wrote nowhere; ``missing`` engine
    parameters nothing wrote; ``partial`` parameters written with fewer bytes than they hold.
    """

    steps: list[_Step]
    load_weights: LoadWeights
    params: dict[str, torch.Tensor]
    written: dict[str, int]
    unexpected: list[str]
    parameter_names: frozenset[str]
    owners: dict[str, tuple[torch.nn.Module, str]] = field(default_factory=dict)  # parameter -> (module, attribute)
    rows: dict[str, tuple[torch.Tensor, Runs]] = field(default_factory=dict)  # source name -> its rows (compose_rows)
    derived: list[str] = field(default_factory=list)  # parameters the engine's processing computes from others
    processed: list[str] = field(default_factory=list)  # parameters the engine's processing reworks after its loader
    recomputations: list[tuple[str, Callable[[], object]]] = field(default_factory=list)  # (module, its recompute)
    aliases: dict[str, torch.Tensor] = field(default_factory=dict)  # other parameters viewing a derived one's memory
    pointers: dict[str, int] = field(default_factory=dict)  # written parameter -> its storage, as recorded
    expanded: list[tuple[torch.Tensor, torch.Tensor, Box]] = field(default_factory=list)  # (full, shard, box) kept
    # source name -> (its rows' origin, runs, its scale's source name): quantized by the engine (compose_quantized)
    quantized: dict[str, tuple[torch.Tensor, Runs, str]] = field(default_factory=dict)
    quantized_in_place: list[str] = field(default_factory=list)  # of those, written straight into the parameters
    _quantizer: JobQuantizer | None = field(default=None, repr=False)  # runs before the copies of every replay
    _schedule: CopySchedule | None = field(default=None, repr=False)  # the replay, built at its first run

    @property
    def recomputed(self) -> list[str]:
        """Modules whose derived parameters the engine recomputes after each replay's copies."""
        return [name for name, _ in self.recomputations]

    @property
    def copies(self) -> int:
        return sum(len(step.copies) for step in self.steps if not step.via_loader)

    @property
    def via_loader(self) -> list[str]:
        return [step.name for step in self.steps if step.via_loader]

    @property
    def missing(self) -> list[str]:
        """Engine parameters (not buffers) that nothing wrote."""
        return sorted(name for name in self.parameter_names if name not in self.written)

    @property
    def partial(self) -> list[str]:
        return sorted(name for name, n in self.written.items() if n < _nbytes(self.params[name]))

    @classmethod
    def record(
        cls,
        model: torch.nn.Module,
        sources: list[tuple[str, torch.Tensor]],
        load_weights: LoadWeights | None = None,
        staged: StagedLoad | None = None,
        recompute: Recompute | None = None,
        shards: Shards | None = None,
    ) -> "ApplyPlan":
        """Run ``load_weights`` (default ``model.load_weights``) once per source tensor, recording
        its copies. This is the first refit's load: the model holds the sources afterwards.
        ``staged``: record through the engine's reload bracket (module docstring); every tensor
        must then be plain copies, or the plan is refused. ``recompute``: how the engine
        recomputes a module's derived parameters (module docstring). ``shards``: sources that are
        shards of larger HF tensors (module docstring; a read outside a shard's box raises
        ``ShardRemapError``)."""
        shards = shards or {}
        recording = LoadRecording(model, [t for _, t in sources], load_weights, staged=staged, recompute=recompute)
        bracket = staged.around(recording.processing) if staged is not None else contextlib.nullcontext()
        with torch.no_grad(), bracket:
            for name, tensor in sources:
                try:
                    recording.load(name, tensor, shard=shards.get(name))
                except ShardRemapError:
                    raise  # the load ran; its reads do not fit the shard (names the tensor and both boxes)
                except Exception as err:
                    raise ApplyPlanError(
                        f"the engine's load_weights failed on {name} {tuple(tensor.shape)} {tensor.dtype}: "
                        f"{type(err).__name__}: {err}. An engine that replaces its parameters after loading "
                        "(vLLM's FP8 linear layers do) is recorded through its reload bracket (StagedLoad)"
                    ) from err
        return recording.finish()

    def targets_moved(self, model: torch.nn.Module, *, subclass_dispatch: bool = False) -> list[str]:
        """Written parameters whose storage ``model`` no longer uses (the engine replaced them,
        e.g. a weight reload or quantization post-processing): a replay would miss them. Reads
        each written parameter's owning module attribute (no walk over the model; a parameter read
        from the module's table, as ``getattr`` would find it, without a Python call per parameter).
        Engines' parameter classes may override ``__torch_function__`` (vLLM's ``BasevLLMParameter``
        does), which puts every tensor method called on them through Python: the look runs with
        subclass dispatch off, so reading a storage's address stays one C call (about 4 µs a
        parameter otherwise: 1.1 ms of every Qwen3-8B apply, H200). ``subclass_dispatch=True``
        leaves it on (benchmarks: what the look cost before)."""
        moved = []  # one loop, no call per parameter (tests/test_broadcast_host_work.py counts them)
        with contextlib.nullcontext() if subclass_dispatch else torch._C.DisableTorchFunctionSubclass():
            for name, pointer in self.pointers.items():
                module, attribute = self.owners.get(name, (None, None))
                current = None if module is None else module._parameters.get(attribute)
                if current is None and module is not None:
                    current = getattr(module, attribute, None)
                if not isinstance(current, torch.Tensor) or current.untyped_storage().data_ptr() != pointer:
                    moved.append(name)
        return sorted(moved)

    def reallocated(self, model: torch.nn.Module) -> bool:
        """Whether ``targets_moved`` names any parameter (logged: the caller records the loader again)."""
        moved = self.targets_moved(model)
        if moved:
            logger.warning(
                "refit: %d engine parameter(s) were reallocated since the copies were recorded (e.g. %s): "
                "recording the engine's loader again",
                len(moved),
                moved[:3],
            )
        return bool(moved)

    def replay(self) -> None:
        """Apply the sources' current bytes (same stream as the engine's compute: no sync here):
        the recorded copies in groups of independent ones (``engines.replay.copy_batches``), the loader
        where a tensor is not plain copies, then the recomputations."""
        if self._schedule is None:
            self._schedule = _replay_schedule(self.steps, self.load_weights, self.recomputations)
        with torch.no_grad():
            if self._quantizer is not None:
                self._quantizer.run()
            self._schedule.run()

    def compose_rows(self, rows: dict[str, tuple[torch.Tensor, Runs]]) -> list[str]:
        """Sources that are copies of row runs of another tensor (``{name: (origin, runs)}``):
        rewrite their recorded copies to read the runs from ``origin`` (module docstring).
        Returns the names that could not be composed; those are refreshed from their runs before
        each replay instead. Call right after ``record``, before ``check_against_loader``."""
        self.rows = dict(rows)
        self._schedule = None
        refreshed = []
        for step in self.steps:
            if step.name not in rows:
                continue
            origin, runs = rows[step.name]
            composed = None if step.via_loader else _compose(step.copies, step.source, origin, runs)
            if composed is None:
                step.refresh = _row_copies(step.source, origin, runs)
                refreshed.append(step.name)
            else:
                step.copies, step.composed = composed, True
        return refreshed

    def compose_quantized(self, quantized: dict[str, tuple[torch.Tensor, Runs, str]]) -> list[str]:
        """Sources that are the blockwise FP8 quantization of row runs of another tensor (``{name:
        (origin, runs, scale name)}``, ``sharing.QuantizedRef``): the engine quantizes them itself on
        every replay, before the copies. Where the loader's only use of such a weight and of its scale
        was one copy of the whole source into a destination the quantizer can write (same shape, dtype
        and device, rows contiguous; the scale's destination contiguous) that nothing else the replay
        does writes (no other copy's destination and no parameter a loader step writes overlaps it, so
        writing it first, not at the weight's turn, leaves the same bytes), the quantizer writes there and
        those copies are dropped: the replay reads each source element once and writes the engine's
        bytes once. Otherwise it writes into the sources themselves, which the recorded copies then
        read in the loader's order (still exact: the sources' memory is the trainer's, held and no longer
        written by it). Returns the names written in place. Call after ``compose_rows``, before
        ``check_against_loader``, which proves the plan against the loader's load from the sources as
        the trainer quantized them (the quantizer's bits themselves are the export's: ``fp8.kernels``
        proves its kernels against the reference before use)."""
        self.quantized = dict(quantized)
        self._schedule = None
        steps = {step.name: step for step in self.steps}
        shared = _shared_writes(self.steps, self.params)
        jobs, in_place = [], []
        for name, (origin, runs, scale_name) in quantized.items():
            weight, scale = steps.get(name), steps.get(scale_name)
            if weight is None or scale is None:
                raise ApplyPlanError(f"{name} is named quantized with the scale {scale_name}, and the layout lacks one")
            _check_quantizable(name, weight.source, scale.source, origin, runs)
            targets = (
                _whole_copy_target(weight, origin.device, shared),
                _whole_copy_target(scale, origin.device, shared, contiguous=True),
            )
            if None in targets:
                jobs += _into_sources(steps, name, self.quantized[name])
                continue
            jobs += block_row_jobs(origin, runs, *targets)
            weight.copies, scale.copies = [], []
            in_place.append(name)
        self.quantized_in_place = in_place
        self._quantizer = JobQuantizer(jobs) if jobs else None
        return in_place

    def refresh_sources(self) -> None:
        """Rebuild every composed or engine-quantized source from its rows (before recording the
        loader again: replays keep neither up to date)."""
        with torch.no_grad():
            for step in self.steps:
                if step.composed:
                    for destination, source in _row_copies(step.source, *self.rows[step.name]):
                        destination.copy_(source)
            steps = {step.name: step for step in self.steps}
            jobs = [job for name, quantized in self.quantized.items() for job in _into_sources(steps, name, quantized)]
            if jobs:
                JobQuantizer(jobs).run()

    def check_against_loader(self) -> None:
        """Raise ``ApplyPlanError`` unless a replay rewrites every written parameter exactly as the
        loader did (call right after ``record``; the parameters keep the loaded values)."""
        written = {name: self.params[name] for name in self.written} | self.aliases
        expected = named_fingerprints(written.items())
        with torch.no_grad():
            for full, shard, box in self.expanded:  # the loader must not read outside a shard's box
                fill_outside(full, shard, box, OUTSIDE_PATTERNS[1])
        wrong = _replay_differs(written, expected, self.replay)
        if wrong:
            recomputed = {name for name, _ in self.recomputations}
            orphans = [name for name in wrong if name in self.derived and _module_of(name) not in recomputed]
            raise ApplyPlanError(
                f"replaying the recorded copies does not reproduce the engine's loader for {len(wrong)} "
                f"parameter(s), e.g. {wrong[:5]}"
                + (
                    f"; {len(orphans)} of them ({orphans[:5]}) are derived by the engine's processing from other "
                    "tensors (not copies of an exported tensor), and the engine names no way to recompute them"
                    if orphans
                    else ""
                )
                + (
                    f"; {len(reworked)} of them ({reworked[:5]}) are reworked by the engine's processing, which the "
                    "replay runs again after its copies: that processing did not give the same bytes twice"
                    if (reworked := [name for name in wrong if name in self.processed])
                    else ""
                )
                + (
                    f"; {len(self.expanded)} tensor(s) go through the loader from a full-size tensor around their shard: "
                    "a loader that reads outside the shard's box (the transfer plan's rule is not the engine's) fails here"
                    if self.expanded
                    else ""
                )
            )


class LoadRecording:
    """The engine's loader recorded one source at a time, as the sources arrive: ``load`` each,
    then ``finish`` for the plan (``ApplyPlan.record`` is this over a list). ``sources``: tensors
    whose memory holds every source that will be loaded (a streamed refit names its receive
    buffers). ``staged``: recorded inside the engine's reload bracket, entered by the caller with
    ``processing`` as its ``during_end`` (``StagedLoad.around(recording.processing)``).

    ``check(steps)`` proves some steps while their sources still hold what was loaded (a streamed
    refit overwrites its buffers) and returns their replay (``replayer``): the loader and that
    replay each run again from the same scribbled parameters and must leave the same bytes; the
    parameters then get back what the recorded load wrote. A step whose copies change after its
    replay was made (a loader that keeps references to earlier sources and writes from them
    later) fails ``finish``. ``loaded``: the union of what the loader returned, if it returns the names
    it loaded (vLLM's do), else None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sources: Iterable[torch.Tensor],
        load_weights: LoadWeights | None = None,
        *,
        staged: StagedLoad | None = None,
        recompute: Recompute | None = None,
    ) -> None:
        self.model, self.load_weights = model, load_weights or model.load_weights
        self.staged, self.recompute = staged, recompute
        self.params = _unique_tensors([*model.named_parameters(), *model.named_buffers()])
        self.recorder = _CopyRecorder(self.params, sources, compose_staged=staged is not None)
        self.steps: list[_Step] = []
        self.loaded: set[str] | None = set()
        self.expanded: list[tuple[torch.Tensor, torch.Tensor, Box]] = []  # (full, shard, box) kept for the loader
        self._compiled: list[tuple[_Step, int]] = []  # (step, its copies when its replay was made)
        self._shards_pending: list[tuple[_Step, tuple[torch.Tensor, tuple[int, ...], Box]]] = []  # remapped at finish

    def processing(self) -> "_CopyRecorder._Recording":
        """Recording while the reload bracket processes its layers (no source of its own)."""
        return self.recorder.recording(None)

    def load(
        self, name: str, tensor: torch.Tensor, *, shard: tuple[torch.Tensor, tuple[int, ...], Box] | None = None
    ) -> _Step:
        """Load one source through the engine's loader, recording its copies (errors as the loader
        raises them). ``shard``: the source is ``(shard, HF shape, box)`` of a larger tensor, loaded
        from a full-size tensor built around it; its reads are moved into the shard after the load
        (under a reload bracket, at ``finish``: the bracket may hold a layer's tensors until then)."""
        loaded = tensor if shard is None else expand(*shard)
        step = _Step(name=name, source=loaded)
        with torch.no_grad(), self.recorder.recording(step):
            result = self.load_weights([(name, loaded)])
        self.steps.append(step)
        if shard is not None and self.staged is None:
            _read_from_shard(step, shard, self.expanded, self.recorder)
        elif shard is not None:
            self._shards_pending.append((step, shard))
        self.loaded = (
            self.loaded | set(result) if isinstance(result, (set, frozenset)) and self.loaded is not None else None
        )
        return step

    def load_every_step(self, steps: Iterable[_Step], reason: str) -> None:
        """Send ``steps``' sources through the engine's loader on every replay (``reason``: why)."""
        for step in steps:
            if not step.via_loader:
                step.via_loader, step.reason = True, reason

    def replayer(self, steps: list[_Step]) -> Callable[[], None]:
        """``steps`` replayed as one call (``_batched_replay``); their copies must not change after
        this (``finish`` checks)."""
        self._compiled.extend((step, len(step.copies)) for step in steps)
        return _batched_replay(steps, self.load_weights)

    def check(self, steps: list[_Step]) -> Callable[[], None]:
        """``steps``' replay, proven: raises ``ApplyPlanError`` unless it writes what the loader
        writes from their sources as they are now (class docstring)."""
        replay = self.replayer(steps)
        tensors = {name: self.params[name] for name in sorted({t for step in steps for t in step.targets})}
        kept = {name: tensor.clone() for name, tensor in tensors.items()}
        try:
            with torch.no_grad():
                for tensor in tensors.values():
                    _scribble(tensor)
                for step in steps:
                    self.load_weights([(step.name, step.source)])
            expected = named_fingerprints(tensors.items())
            wrong = _replay_differs(tensors, expected, replay)
        finally:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    tensor.copy_(kept[name])
        if wrong:
            raise ApplyPlanError(
                f"replaying the recorded copies does not reproduce the engine's loader for {len(wrong)} "
                f"parameter(s), e.g. {wrong[:5]} (loading {[step.name for step in steps][:5]})"
            )
        return replay

    def finish(self) -> ApplyPlan:
        """The plan of everything loaded (the recorded load itself has written the engine)."""
        recorder, staged, model = self.recorder, self.staged, self.model
        changed = [step.name for step, copies in self._compiled if len(step.copies) != copies]
        if changed:
            raise ApplyPlanError(
                f"the engine's loader wrote from {len(changed)} source(s) after later ones arrived, e.g. {changed[:3]}: "
                "it keeps references to the tensors it is given, whose memory a streamed refit reuses"
            )
        for step, shard in self._shards_pending:
            _read_from_shard(step, shard, self.expanded, recorder)
        self._shards_pending = []
        parameter_names = frozenset(_unique_tensors(model.named_parameters()))  # one name per storage
        unwritten = sorted(name for name in parameter_names if name not in recorder.written)
        processed = sorted(recorder.processed)
        # a layer's processing reads its own parameters only; derived ones read others' (MLA's W_UV reads the
        # processed kv_b_proj): processed first
        recomputations = _recompute(
            model, unwritten if staged is None else processed + sorted(recorder.derived), self.recompute
        )
        _refuse_unprocessed(processed, recomputations)
        if staged is None:
            with torch.no_grad(), recorder.recording(None):  # processing the plain loader left to the engine
                for _, function in recomputations:
                    function()
        plan = ApplyPlan(
            steps=self.steps,
            load_weights=self.load_weights,
            params=self.params,
            written=recorder.written,
            unexpected=sorted(step.name for step in self.steps if not step.wrote),
            parameter_names=parameter_names,
            owners=_owners(model, recorder.written),
            derived=sorted(recorder.derived),
            processed=processed,
            recomputations=recomputations,
            aliases=_aliases(model, self.params, recorder.derived | recorder.processed),
            pointers={name: self.params[name].untyped_storage().data_ptr() for name in recorder.written},
            expanded=self.expanded,
        )
        if staged is not None and plan.via_loader:
            loaded = [f"{step.name} ({step.reason})" for step in self.steps if step.via_loader]
            raise ApplyPlanError(
                f"{len(loaded)} tensor(s) are not loaded by plain copies through the engine's reload, e.g. "
                f"{loaded[:3]}: they cannot be replayed, and loading them alone outside a reload would write "
                "checkpoint-format data into processed parameters"
            )
        return plan


class _CopyRecorder(TorchFunctionMode):
    """Notes copies from a source tensor into a parameter while one source is being loaded."""

    def __init__(
        self, params: dict[str, torch.Tensor], sources: Iterable[torch.Tensor], compose_staged: bool = False
    ) -> None:
        super().__init__()
        self._param_of = {t.untyped_storage().data_ptr(): name for name, t in params.items() if t.numel()}
        self._sources = {t.untyped_storage().data_ptr() for t in sources if t.numel()}
        self.written: dict[str, int] = {}
        self.derived: set[str] = set()  # written outside any source's load, from no staged source
        self._step: _Step | None = None
        self._spans: dict[int, list[tuple[int, int, _Step]]] = {}  # source storage -> (byte span, its step)
        self._compose = compose_staged
        self._staged: dict[
            int, list[tuple[torch.Tensor, torch.Tensor, _Step]]
        ] = {}  # staging storage -> writes from sources
        self._reworked: set[int] = set()  # staging storages whose sources' bytes something else wrote over after
        self._copied_back: set[int] = set()  # staging storages copied into parameters (their memory may be reused)
        self.processed: set[str] = set()  # parameters copied from a reworked staging tensor (the engine's processing)

    class _Recording:
        def __init__(self, recorder: "_CopyRecorder", step: _Step) -> None:
            self.recorder, self.step = recorder, step

        def __enter__(self) -> None:
            self.recorder._step = self.step
            if self.step is not None:
                self.recorder._register(self.step)
            self.recorder.__enter__()

        def __exit__(self, *exc) -> None:
            self.recorder.__exit__(*exc)
            self.recorder._step = None

    def recording(self, step: _Step | None) -> "_CopyRecorder._Recording":
        """Record while ``step``'s source loads (None: the reload's final processing, which loads
        nothing of its own but copies staged layers into the parameters)."""
        return self._Recording(self, step)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "copy_":
            if not _same_view(args[0], args[1]):  # a tensor copied onto itself (vLLM's reload does) is no write
                self._note(args[0], args[1])
        elif name == "__setitem__":
            self._note(args[0][args[1]], args[2])
        elif name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor):
            target = self._target(args[0]) if args[0].numel() else None
            if target is None:
                self._rework(args[0])  # e.g. processing that rescales a staged weight in place
            else:
                # an in-place op other than a copy: replay cannot repeat it (on no element it does nothing)
                self._loader_only(f"in-place {name} on {target}")
                if self._step is not None:
                    self._step.targets.add(target)  # a write the step makes (its loader's, every replay)
        elif name == "__set__" and args and isinstance(args[0], torch.Tensor) and self._target(args[0]):
            self._loader_only(f"swaps the storage of {self._target(args[0])}")  # ``param.data = ...``
        return result

    def _register(self, step: _Step) -> None:
        source = step.source
        if source.numel():
            storage, start, end = byte_span(source)
            self._sources.add(storage)  # also a tensor made for this load
            self._spans.setdefault(storage, []).append((start, end, step))

    def forget(self, step: _Step) -> None:
        """``step``'s source is freed: its memory is no source any more (an allocation reusing it is not)."""
        key = step.source.untyped_storage().data_ptr()
        spans = [span for span in self._spans.get(key, []) if span[2] is not step]
        if spans:
            self._spans[key] = spans
        else:
            self._spans.pop(key, None)
            self._sources.discard(key)

    def _owner(self, source: torch.Tensor) -> _Step | None:
        """The step whose source tensor holds ``source``: a loader that buffers a layer's tensors
        (vLLM's reload does) writes earlier sources while a later one loads."""
        at = source.storage_offset() * source.element_size()
        holders = [
            step for start, stop, step in self._spans.get(source.untyped_storage().data_ptr(), []) if start <= at < stop
        ]
        if self._step in holders or not holders:
            return self._step
        return holders[-1]

    def _loader_only(self, reason: str) -> None:
        if self._step is not None:  # outside a step (a reload's final processing) the check judges the result
            if not self._step.via_loader:
                self._step.reason = reason
            self._step.via_loader = True

    def _target(self, tensor: torch.Tensor) -> str | None:
        if tensor.device.type == "meta":
            return None
        return self._param_of.get(tensor.untyped_storage().data_ptr())

    def _is_source(self, tensor: object) -> bool:
        return (
            isinstance(tensor, torch.Tensor)
            and tensor.device.type != "meta"
            and tensor.untyped_storage().data_ptr() in self._sources
        )

    def _note(self, destination: torch.Tensor, source: object) -> None:
        if not isinstance(destination, torch.Tensor) or destination.device.type == "meta":
            return
        target = self._target(destination)
        from_source = self._is_source(source)
        owner = self._owner(source) if from_source else self._step
        if target is None:
            if self._compose and from_source and owner is not None:
                owner.wrote = True  # into a staging tensor: composed when the staged layer is copied back
                key = destination.untyped_storage().data_ptr()
                if key in self._copied_back:  # memory of a staging tensor copied back earlier: a new one
                    self._copied_back.discard(key)
                    self._reworked.discard(key)
                    self._staged.pop(key, None)
                self._staged.setdefault(key, []).append((destination, source, owner))
            elif not from_source:
                self._rework(destination)
            return
        if self._compose and isinstance(source, torch.Tensor) and self._compose_staged(destination, source, target):
            return
        self.written[target] = self.written.get(target, 0) + _nbytes(destination)
        if owner is None:
            self.derived.add(target)  # the engine's own processing, from elsewhere: recomputed, or the check judges it
            return
        owner.wrote = True
        owner.targets.add(target)
        if from_source:
            owner.copies.append((destination, source))
        else:  # a temporary or a scalar, made by the loader
            self._loader_only(
                f"writes {target} from a {'tensor' if isinstance(source, torch.Tensor) else 'scalar'} "
                "that is not the source"
            )

    def _rework(self, tensor: torch.Tensor) -> None:
        """``tensor`` (no parameter) is written by something other than a source: where that touches
        bytes a source was copied into in a staging tensor not yet copied back, the engine reworked
        the staged bytes after loading them (vLLM's DeepGEMM requantizes a staged FP8 weight and its
        scale in place), so the parameters that staging tensor is copied into are ``processed``."""
        if not self._compose or tensor.device.type == "meta" or not tensor.numel():
            return
        storage, first, end = byte_span(tensor)
        if storage in self._copied_back:
            return  # memory of a staging tensor already copied back, reused by a temporary
        for view, _, _ in self._staged.get(storage, ()):
            _, start, stop = byte_span(view)
            if first < stop and start < end:
                self._reworked.add(storage)
                return

    def _compose_staged(self, destination: torch.Tensor, staging: torch.Tensor, target: str) -> bool:
        """``destination`` (a parameter) takes ``staging`` whole: each earlier source write into
        that staging tensor becomes a write into the same place of the parameter (and the parameter
        is ``processed`` where the staged bytes were reworked after those writes)."""
        key = staging.untyped_storage().data_ptr() if staging.device.type != "meta" else None
        writes = self._staged.get(key) if key is not None else None
        if not writes or (destination.shape, destination.stride(), destination.dtype) != (
            staging.shape,
            staging.stride(),
            staging.dtype,
        ):
            return False
        if any(
            view.storage_offset() < staging.storage_offset() or view.dtype != staging.dtype for view, _, _ in writes
        ):
            return False
        shift = destination.storage_offset() - staging.storage_offset()
        for view, source, step in writes:
            placed = destination.as_strided(view.shape, view.stride(), view.storage_offset() + shift)
            step.copies.append((placed, source))
            step.targets.add(target)
            self.written[target] = self.written.get(target, 0) + _nbytes(placed)
        if key in self._reworked:
            self.processed.add(target)
        self._copied_back.add(key)
        return True


def _replay_schedule(
    steps: Iterable[_Step], load_weights: LoadWeights, recomputations: Iterable[tuple[str, Callable[[], object]]] = ()
) -> CopySchedule:
    """``steps`` in order as a ``CopySchedule`` (``engines.replay.copy_batches``): the recorded copies in
    groups of independent ones, a step's refresh before its copies (the schedule orders a copy that
    reads what an earlier one wrote), a loader step after every earlier copy and before every
    later one, then the recomputations."""
    schedule = CopySchedule()
    for step in steps:
        for destination, source in step.refresh:
            schedule.add(destination, source)
        if step.via_loader:
            schedule.call(functools.partial(load_weights, [(step.name, step.source)]))
        else:
            for destination, source in step.copies:
                schedule.add(destination, source)
    for _, function in recomputations:
        schedule.call(function)
    schedule.barrier()
    logger.debug("replay: %d copies in %d calls", schedule.copies, len(schedule.calls))
    return schedule


def _batched_replay(steps: list[_Step], load_weights: LoadWeights) -> Callable[[], None]:
    """One call that replays ``steps`` in order (``_replay_schedule``) under ``no_grad``."""
    schedule = _replay_schedule(steps, load_weights)

    def replay() -> None:
        with torch.no_grad():
            schedule.run()

    return replay


def _replay_differs(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, int]], replay: Callable[[], None]
) -> list[str]:
    """Names among ``tensors`` whose fingerprints after scribbling them and running ``replay`` are not ``expected``."""
    with torch.no_grad():
        for tensor in tensors.values():
            _scribble(tensor)
    replay()
    return differing(expected, named_fingerprints(tensors.items()))


def _read_from_shard(
    step: _Step,
    shard: tuple[torch.Tensor, tuple[int, ...], Box],
    expanded: list[tuple[torch.Tensor, torch.Tensor, Box]],
    recorder: "_CopyRecorder",
) -> None:
    """``step``'s recorded reads of its full-size tensor moved into its shard (then the full-size
    tensor is forgotten and freed); a step loaded by the loader keeps it, refreshed from the shard
    before each replay (noted in ``expanded`` for the check)."""
    tensor, _, box = shard
    if step.via_loader:
        step.refresh = [(box_view(step.source, box), tensor)]
        expanded.append((step.source, tensor, box))
        return
    step.copies = [(dest, remap(view, step.source, tensor, box, step.name)) for dest, view in step.copies]
    recorder.forget(step)
    step.source = tensor


def _recompute(
    model: torch.nn.Module, derived: list[str], recompute: Recompute | None
) -> list[tuple[str, Callable[[], object]]]:
    """The engine's recomputations of the modules that own ``derived`` parameters, one per module,
    in the order of ``derived``; modules it has none for are left out (their parameters stay missing, or
    fail the check)."""
    if recompute is None:
        return []
    out = []
    for module_name in dict.fromkeys(_module_of(name) for name in derived):
        function = recompute(model.get_submodule(module_name))
        if function is not None:
            out.append((module_name, function))
    return out


def _refuse_unprocessed(processed: list[str], recomputations: list[tuple[str, Callable[[], object]]]) -> None:
    """Refuse by name parameters the engine's processing reworks after loading (``_CopyRecorder._rework``)
    in modules it names no way to process again: a replay would leave the loaded bytes where the engine
    computes with reworked ones, whether or not the plan is checked."""
    recomputed = {name for name, _ in recomputations}
    orphans = [name for name in processed if _module_of(name) not in recomputed]
    if orphans:
        raise ApplyPlanError(
            f"the engine's processing rewrote {len(orphans)} parameter(s) after its loader wrote them, e.g. "
            f"{orphans[:5]} (as vLLM's DeepGEMM requantizes a block-FP8 weight and its scale to power-of-two "
            "scales), and the engine names no way to process them again: replaying the loader's copies would "
            "leave the exported bytes where the engine computes with reworked ones. Start the engine without "
            "that processing (for vLLM: VLLM_USE_DEEP_GEMM=0)"
        )


def _aliases(
    model: torch.nn.Module, params: dict[str, torch.Tensor], derived: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Parameters other than ``params``' that view the memory of a derived parameter (vLLM's MLA
    registers ``W_UV`` and ``W_UK_T`` as views of one dequantized tensor): checked with it."""
    memory = {params[name].untyped_storage().data_ptr() for name in derived}
    return {
        name: tensor.data
        for name, tensor in model.named_parameters()
        if name not in params and tensor.numel() and tensor.untyped_storage().data_ptr() in memory
    }


def _module_of(parameter: str) -> str:
    return parameter.rpartition(".")[0]


def _same_view(a: object, b: object) -> bool:
    """Whether two tensors are the same elements of the same memory (a copy between them changes nothing)."""
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.device.type != "meta"
        and a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def _owners(model: torch.nn.Module, names: Iterable[str]) -> dict[str, tuple[torch.nn.Module, str]]:
    """The module and attribute that hold each named parameter or buffer."""
    out = {}
    for name in names:
        module_name, _, attribute = name.rpartition(".")
        try:
            out[name] = (model.get_submodule(module_name), attribute)
        except AttributeError:
            pass  # not reachable by name: reported as moved, then recorded again
    return out


def _compose(copies: list[Copy], source: torch.Tensor, origin: torch.Tensor, runs: Runs) -> list[Copy] | None:
    """``copies`` from ``source`` rewritten to read ``source``'s rows from ``origin`` (``source``
    row ``r`` of run ``(row, origin_row, count)`` is ``origin`` row ``origin_row + r - row``);
    None unless every copy reads whole rows of ``source`` into a destination of its shape."""
    composed: list[Copy] = []
    for destination, view in copies:
        rows = _rows_within(view, source)
        if rows is None or destination.shape != view.shape:
            return None
        first, count = rows
        pieces = []
        for row, origin_row, length in runs:
            low, high = max(row, first), min(row + length, first + count)
            if low < high:
                pieces.append((low - first, origin_row + low - row, high - low))
        composed.extend(_row_copies(destination, origin, pieces))
    return composed


def _rows_within(view: torch.Tensor, whole: torch.Tensor) -> tuple[int, int] | None:
    """``(first row, rows)`` when ``view`` is whole consecutive rows of ``whole`` (same storage,
    dtype, trailing shape and strides), else None."""
    if view.dim() == 0 or view.dim() != whole.dim() or view.dtype != whole.dtype:
        return None
    if view.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr():
        return None
    if view.shape[1:] != whole.shape[1:] or view.stride()[1:] != whole.stride()[1:]:
        return None
    row = whole.stride(0)
    delta = view.storage_offset() - whole.storage_offset()
    if row <= 0 or delta % row or (view.shape[0] > 1 and view.stride(0) != row):
        return None
    first = delta // row
    return (first, view.shape[0]) if 0 <= first and first + view.shape[0] <= whole.shape[0] else None


def _row_copies(destination: torch.Tensor, origin: torch.Tensor, pieces: Iterable[tuple[int, int, int]]) -> list[Copy]:
    """Copies that write row runs ``(destination row, origin row, rows)`` of ``origin`` into
    ``destination``: one per run of equally long, equally spaced pieces, a strided view on each
    side (q, k, v come as one piece per query group)."""
    copies = []
    for group in _even_groups(list(pieces)):
        first_row, first_origin, count = group[0]
        if len(group) == 1:
            copies.append((destination.narrow(0, first_row, count), origin.narrow(0, first_origin, count)))
            continue
        step, origin_step = group[1][0] - first_row, group[1][1] - first_origin
        copies.append(
            (
                _stacked(destination, first_row, step, count, len(group)),
                _stacked(origin, first_origin, origin_step, count, len(group)),
            )
        )
    return copies


def _even_groups(pieces: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Consecutive pieces of one length whose rows advance by the same positive steps."""
    groups: list[list[tuple[int, int, int]]] = []
    for piece in pieces:
        group = groups[-1] if groups else None
        if group and piece[2] == group[0][2]:
            step = (piece[0] - group[-1][0], piece[1] - group[-1][1])
            first_step = step if len(group) == 1 else (group[1][0] - group[0][0], group[1][1] - group[0][1])
            if step == first_step and min(step) >= piece[2]:
                group.append(piece)
                continue
        groups.append([piece])
    return groups


def _stacked(tensor: torch.Tensor, first: int, step: int, rows: int, count: int) -> torch.Tensor:
    """``count`` blocks of ``rows`` rows of ``tensor``, ``step`` rows apart, as one [count, rows, ...] view."""
    block = tensor.narrow(0, first, rows)
    return tensor.as_strided((count, *block.shape), (step * tensor.stride(0), *block.stride()), block.storage_offset())


def _check_quantizable(name: str, weight: torch.Tensor, scale: torch.Tensor, origin: torch.Tensor, runs: Runs) -> None:
    """Refuse by name a quantized source the engine cannot quantize to the same blocks: not a 2-D
    e4m3 tensor with a ``scale_inv`` of its blocks' shape, or runs that are not whole block rows."""
    if (
        weight.dim() != 2
        or weight.dtype != FP8_DTYPE
        or scale.dtype != SCALE_DTYPE
        or tuple(scale.shape) != scale_shape(tuple(weight.shape))
        or origin.dim() != 2
        or not origin.dtype.is_floating_point
        or not origin.device == weight.device == scale.device
        or not block_row_runs(runs, weight.shape[0])
    ):
        raise ApplyPlanError(
            f"{name}: a {weight.dtype} {tuple(weight.shape)} tensor on {weight.device} with a {scale.dtype} "
            f"{tuple(scale.shape)} scale cannot be quantized here from runs {list(runs)[:4]} of a {origin.dtype} "
            f"{tuple(origin.shape)} source on {origin.device} (blockwise FP8 quantizes whole 128-row blocks of 2-D "
            "tensors, on their own device)"
        )


def _into_sources(steps: dict[str, _Step], name: str, quantized: tuple[torch.Tensor, Runs, str]) -> list:
    """The jobs that quantize ``name``'s rows into its own source and its scale's (``compose_quantized``)."""
    origin, runs, scale_name = quantized
    return block_row_jobs(origin, runs, steps[name].source, steps[scale_name].source)


def _whole_copy_target(
    step: _Step, device: torch.device, shared: set[tuple[int, int, int]], *, contiguous: bool = False
) -> torch.Tensor | None:
    """The destination of ``step``'s one copy when the loader did nothing with its source but copy
    all of it, unchanged in shape and dtype, into a view on ``device`` with contiguous rows
    (``contiguous``: a contiguous view) whose bytes no other write of the replay touches (not in
    ``shared``, ``_shared_writes``); else None."""
    if step.via_loader or step.refresh or step.composed or len(step.copies) != 1:
        return None
    destination, source = step.copies[0]
    if not _same_view(source, step.source) or destination.shape != source.shape or destination.dtype != source.dtype:
        return None
    if destination.device != device or destination.dim() != 2 or destination.stride(1) != 1:
        return None
    if (contiguous and not destination.is_contiguous()) or byte_span(destination) in shared:
        return None
    return destination


def _shared_writes(steps: list[_Step], params: dict[str, torch.Tensor]) -> set[tuple[int, int, int]]:
    """The byte spans (``byte_span``) of the recorded copies' destinations that overlap another write of
    the replay: another copy's destination or a parameter a loader step
    writes (all of its storage: what the loader touches is not recorded, and one storage may hold several
    parameters)."""
    writes = [byte_span(destination) for step in steps for destination, _ in step.copies]  # refreshes write sources
    copied = len(writes)
    writes += [  # all the memory of the parameter: other parameters may view it (``params`` names one per storage)
        (params[name].untyped_storage().data_ptr(), 0, params[name].untyped_storage().nbytes())
        for step in steps
        if step.via_loader
        for name in step.targets
        if name in params
    ]
    by_storage: dict[int, list[tuple[int, int, int]]] = {}
    for index, (storage, first, end) in enumerate(writes):
        by_storage.setdefault(storage, []).append((first, end, index))
    shared = set()
    for spans in by_storage.values():
        spans.sort()
        reach = -1  # the furthest end of the spans before this one (sorted by first byte)
        for position, (first, end, index) in enumerate(spans):
            later = spans[position + 1][0] if position + 1 < len(spans) else end  # the next span's first byte
            if first < reach or later < end:  # overlaps an earlier span, or the next (the earliest later one)
                shared.add(index)
            reach = max(reach, end)
    return {writes[index] for index in shared if index < copied}


def _unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Tensors by name, one name per storage (tied weights appear once), empty ones left out."""
    seen: set[int] = set()
    out = {}
    for name, tensor in named:
        key = tensor.untyped_storage().data_ptr()
        if tensor.numel() and key not in seen:
            seen.add(key)
            out[name] = tensor.data
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _scribble(tensor: torch.Tensor) -> None:
    """Overwrite every element of ``tensor`` with the pattern byte (a strided view through a
    same-dtype copy, which moves bits unchanged)."""
    if tensor.is_contiguous():
        tensor.reshape(-1).view(torch.uint8).fill_(_SCRIBBLE)
        return
    pattern = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    pattern.reshape(-1).view(torch.uint8).fill_(_SCRIBBLE)
    tensor.copy_(pattern)
