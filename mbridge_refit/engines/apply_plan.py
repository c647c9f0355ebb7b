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
when processing kept those bytes as they were; the check below proves that it did.

``check_against_loader`` proves a plan before it is trusted: after the recorded load, it
fingerprints every written parameter, overwrites those parameters with a pattern, replays, and
requires the same fingerprints bit for bit. Engine-agnostic: needs a module and its loader.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from mbridge_refit.engines.fingerprint import differing, named_fingerprints

logger = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


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


class ApplyPlanError(RuntimeError):
    """The engine's loader cannot be recorded, or a replay does not reproduce it."""


@dataclass
class _Step:
    """What one source tensor does to the engine: plain copies, or a call of the loader."""

    name: str
    source: torch.Tensor
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (destination, source view)
    via_loader: bool = False
    wrote: bool = False  # some engine tensor took bytes of this source (perhaps while a later source loaded)


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
        cls, model: torch.nn.Module, sources: list[tuple[str, torch.Tensor]], load_weights: LoadWeights | None = None,
        staged: StagedLoad | None = None,
    ) -> "ApplyPlan":
        """Run ``load_weights`` (default ``model.load_weights``) once per source tensor, recording
        its copies. This is the first refit's load: the model holds the sources afterwards.
        ``staged``: record through the engine's reload bracket (module docstring); every tensor
        must then be plain copies, or the plan is refused."""
        load_weights = load_weights or model.load_weights
        params = _unique_tensors([*model.named_parameters(), *model.named_buffers()])
        recorder = _CopyRecorder(params, sources, compose_staged=staged is not None)
        steps = []
        bracket = staged.around(lambda: recorder.recording(None)) if staged is not None else contextlib.nullcontext()
        with torch.no_grad(), bracket:
            for name, tensor in sources:
                step = _Step(name=name, source=tensor)
                try:
                    with recorder.recording(step):
                        load_weights([(name, tensor)])
                except Exception as err:
                    raise ApplyPlanError(
                        f"the engine's load_weights failed on {name} {tuple(tensor.shape)} {tensor.dtype}: "
                        f"{type(err).__name__}: {err}. An engine that replaces its parameters after loading "
                        "(vLLM's FP8 linear layers do) is recorded through its reload bracket (StagedLoad)"
                    ) from err
                steps.append(step)
        plan = cls(steps=steps, load_weights=load_weights, params=params, written=recorder.written,
                   unexpected=sorted(step.name for step in steps if not step.wrote),
                   parameter_names=frozenset(_unique_tensors(model.named_parameters())))
        if staged is not None and plan.via_loader:
            raise ApplyPlanError(
                f"{len(plan.via_loader)} tensor(s) are not loaded by plain copies through the engine's reload, e.g. "
                f"{plan.via_loader[:3]}: they cannot be replayed, and loading them alone outside a reload would fail"
            )
        return plan

    def targets_moved(self, model: torch.nn.Module) -> list[str]:
        """Written parameters whose storage ``model`` no longer uses (the engine replaced them,
        e.g. a weight reload or quantization post-processing): a replay would miss them."""
        current = {name: t.untyped_storage().data_ptr() for name, t in [*model.named_parameters(), *model.named_buffers()]}
        return sorted(name for name in self.written if current.get(name) != self.params[name].untyped_storage().data_ptr())

    def replay(self) -> None:
        """Apply the sources' current bytes (same stream as the engine's compute: no sync here)."""
        with torch.no_grad():
            for step in self.steps:
                if step.via_loader:
                    self.load_weights([(step.name, step.source)])
                else:
                    for destination, source in step.copies:
                        destination.copy_(source)

    def check_against_loader(self) -> None:
        """Raise ``ApplyPlanError`` unless a replay rewrites every written parameter exactly as the
        loader did (call right after ``record``; the parameters keep the loaded values)."""
        written = {name: self.params[name] for name in self.written}
        expected = named_fingerprints(written.items())
        with torch.no_grad():
            for tensor in written.values():
                _bytes_of(tensor).fill_(_SCRIBBLE)
        self.replay()
        wrong = differing(expected, named_fingerprints(written.items()))
        if wrong:
            raise ApplyPlanError(
                f"replaying the recorded copies does not reproduce the engine's loader for {len(wrong)} "
                f"parameter(s), e.g. {wrong[:5]}"
            )


class _CopyRecorder(TorchFunctionMode):
    """Notes copies from a source tensor into a parameter while one source is being loaded."""

    def __init__(self, params: dict[str, torch.Tensor], sources: list[tuple[str, torch.Tensor]], compose_staged: bool = False) -> None:
        super().__init__()
        self._param_of = {t.untyped_storage().data_ptr(): name for name, t in params.items() if t.numel()}
        self._sources = {t.untyped_storage().data_ptr() for _, t in sources if t.numel()}
        self.written: dict[str, int] = {}
        self._step: _Step | None = None
        self._spans: dict[int, list[tuple[int, int, _Step]]] = {}  # source storage -> (byte span, its step)
        self._compose = compose_staged
        self._staged: dict[int, list[tuple[torch.Tensor, torch.Tensor, _Step]]] = {}  # staging storage -> writes from sources

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
            self._note(args[0], args[1])
        elif name == "__setitem__":
            self._note(args[0][args[1]], args[2])
        elif name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor) and self._target(args[0]):
            self._loader_only()  # an in-place op other than a copy: replay cannot repeat it
        elif name == "__set__" and args and isinstance(args[0], torch.Tensor) and self._target(args[0]):
            self._loader_only()  # ``param.data = ...`` swaps the storage
        return result

    def _register(self, step: _Step) -> None:
        source = step.source
        if source.numel():
            start = source.storage_offset() * source.element_size()
            self._spans.setdefault(source.untyped_storage().data_ptr(), []).append((start, start + _span_bytes(source), step))

    def _owner(self, source: torch.Tensor) -> _Step | None:
        """The step whose source tensor holds ``source``: a loader that buffers a layer's tensors
        (vLLM's reload does) writes earlier sources while a later one loads."""
        at = source.storage_offset() * source.element_size()
        holders = [step for start, stop, step in self._spans.get(source.untyped_storage().data_ptr(), []) if start <= at < stop]
        if self._step in holders or not holders:
            return self._step
        return holders[-1]

    def _loader_only(self) -> None:
        if self._step is not None:  # outside a step (a reload's final processing) the check judges the result
            self._step.via_loader = True

    def _target(self, tensor: torch.Tensor) -> str | None:
        if tensor.device.type == "meta":
            return None
        return self._param_of.get(tensor.untyped_storage().data_ptr())

    def _is_source(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" and tensor.untyped_storage().data_ptr() in self._sources

    def _note(self, destination: torch.Tensor, source: object) -> None:
        if not isinstance(destination, torch.Tensor) or destination.device.type == "meta":
            return
        target = self._target(destination)
        from_source = self._is_source(source)
        owner = self._owner(source) if from_source else self._step
        if target is None:
            if self._compose and from_source and owner is not None:
                owner.wrote = True  # into a staging tensor: composed when the staged layer is copied back
                self._staged.setdefault(destination.untyped_storage().data_ptr(), []).append((destination, source, owner))
            return
        if self._compose and isinstance(source, torch.Tensor) and self._compose_staged(destination, source, target):
            return
        self.written[target] = self.written.get(target, 0) + _nbytes(destination)
        if owner is None:
            return  # the reload's own processing writing a parameter from elsewhere: the check judges it
        owner.wrote = True
        if from_source:
            owner.copies.append((destination, source))
        else:
            self._loader_only()  # a temporary or a scalar, made by the loader

    def _compose_staged(self, destination: torch.Tensor, staging: torch.Tensor, target: str) -> bool:
        """``destination`` (a parameter) takes ``staging`` whole: each earlier source write into
        that staging tensor becomes a write into the same place of the parameter."""
        writes = self._staged.get(staging.untyped_storage().data_ptr()) if staging.device.type != "meta" else None
        if not writes or (destination.shape, destination.stride(), destination.dtype) != (staging.shape, staging.stride(), staging.dtype):
            return False
        if any(view.storage_offset() < staging.storage_offset() or view.dtype != staging.dtype for view, _, _ in writes):
            return False
        shift = destination.storage_offset() - staging.storage_offset()
        for view, source, step in writes:
            placed = destination.as_strided(view.shape, view.stride(), view.storage_offset() + shift)
            step.copies.append((placed, source))
            self.written[target] = self.written.get(target, 0) + _nbytes(placed)
        return True


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


def _span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to its last, whatever its strides."""
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ApplyPlanError("a written parameter is not contiguous: cannot check it byte for byte")
    return tensor.reshape(-1).view(torch.uint8)
