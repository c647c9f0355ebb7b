"""In-place update of a live ``transformers`` model from an export stream.

Owns :class:`HFModelUpdateSink`, which does what an inference engine's ``load_weights`` does:
``copy_`` each streamed tensor into the existing parameter or buffer (no re-allocation, so
pointers captured by CUDA graphs or an engine stay valid), and :data:`FUSED_TENSOR_RULES`, the table
of in-memory layouts that differ from checkpoint names (data, not code: one row per fused
layout). Tied weights are handled by storage identity: a model tensor reachable under several
names (``lm_head.weight`` sharing ``model.embed_tokens.weight``) is satisfied by any of them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mbridge_refit.errors import EngineError
from mbridge_refit.sinks.base import WeightSink

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class FusedTensorRule:
    """A checkpoint tensor stored as one part of one expert's slice of a fused model tensor.

    ``source`` is the stream name and ``target`` the model tensor, as templates over the fields
    ``{experts}`` (the experts module path) and ``{expert}`` (the expert number, in ``source``
    only). The tensor lands in ``target[expert]`` split into ``num_parts`` equal chunks along
    ``part_dim`` (of the per-expert slice), chunk ``part``.
    """

    source: str
    target: str
    part: int = 0
    num_parts: int = 1
    part_dim: int = 0

    @property
    def pattern(self) -> re.Pattern[str]:
        text = (
            re.escape(self.source).replace(r"\{experts\}", "(?P<experts>.+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
        )
        return re.compile(text)

    def target_suffix(self) -> str:
        return self.target.removeprefix("{experts}")


# transformers 5.x Qwen2/Qwen3-MoE family (Qwen3MoeExperts): gate_up_proj [E, 2*I, H] holds
# gate rows then up rows (forward: linear(x, gate_up_proj[e]).chunk(2, -1) -> gate, up);
# down_proj [E, H, I] is the per-expert down_proj.weight as is.
FUSED_TENSOR_RULES: tuple[FusedTensorRule, ...] = (
    FusedTensorRule(source="{experts}.{expert}.gate_proj.weight", target="{experts}.gate_up_proj", part=0, num_parts=2),
    FusedTensorRule(source="{experts}.{expert}.up_proj.weight", target="{experts}.gate_up_proj", part=1, num_parts=2),
    FusedTensorRule(source="{experts}.{expert}.down_proj.weight", target="{experts}.down_proj"),
)


class WeightUpdateError(EngineError, ValueError):
    """The stream does not fit the model (names, shapes or dtypes; listed in the message)."""


@dataclass(frozen=True, slots=True)
class _Target:
    """Where a stream name lands: a view of a model tensor, and the model tensor's key."""

    view: torch.Tensor
    key: str  # the model tensor (first of its aliases) this write covers part of
    part: tuple[int, ...]  # (expert, part) for fused targets, () for whole tensors


class HFModelUpdateSink(WeightSink):
    """A :class:`WeightSink` that copies each streamed tensor into ``model`` in place.

    Args:
        model: a ``transformers`` model (any ``torch.nn.Module``); its parameters and persistent
            buffers are the targets, by their ``state_dict`` names.
        strict: at ``finish``, raise :class:`WeightUpdateError` listing missing names (model
            tensors never written, in stream naming) and unexpected names (stream names with no
            target); with ``strict=False`` log them as a warning instead.
        fused_layouts: rows mapping checkpoint names onto fused in-memory tensors
            (default :data:`FUSED_TENSOR_RULES`); a row applies only where its target exists.

    A shape or dtype mismatch, or a name written twice, raises at once, naming the tensor. The
    names of one tied tensor (e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) may both
    appear: the second is checked to carry the same bytes and not copied again.
    Copies run under ``torch.no_grad()`` and keep every tensor's storage (``data_ptr``).
    Single-process: no collectives (call it on each inference rank with that rank's stream).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        strict: bool = True,
        fused_layouts: Iterable[FusedTensorRule] = FUSED_TENSOR_RULES,
    ) -> None:
        self.model = model
        self.strict = strict
        self._layouts = tuple(fused_layouts)
        self._patterns = [(layout, layout.pattern) for layout in self._layouts]
        self._tensors, self._aliases = _model_tensors(model)
        self._expected = self._expected_names()
        self._written: set[str] = set()
        self._writers: dict[str, str] = {}
        self._unexpected: list[str] = []
        self._closed = False

    # -- WeightSink ------------------------------------------------------------------------

    def consume(self, hf_name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("HFModelUpdateSink.consume() after finish() or abort(); create a new sink")
        target = self._resolve(hf_name)
        if target is None:
            self._unexpected.append(hf_name)
            return
        write = self._write_key(hf_name, target)
        if write in self._written:
            if self._is_tied_copy(hf_name, write, target, tensor):
                return
            raise WeightUpdateError(
                f"{hf_name} was written twice (as {write}); every tensor must appear once in the stream"
            )
        if tuple(tensor.shape) != tuple(target.view.shape) or tensor.dtype != target.view.dtype:
            raise WeightUpdateError(
                f"{hf_name}: stream tensor {list(tensor.shape)} {tensor.dtype} does not fit model tensor "
                f"{target.key}{_part_text(target)} {list(target.view.shape)} {target.view.dtype}"
            )
        with torch.no_grad():
            target.view.copy_(tensor)
        self._written.add(write)
        self._writers[write] = hf_name

    def finish(self) -> None:
        if self._closed:
            raise RuntimeError("HFModelUpdateSink.finish() called twice or after abort()")
        self._closed = True
        missing = sorted(name for name, write in self._expected.items() if write not in self._written)
        unexpected = sorted(self._unexpected)
        if not missing and not unexpected:
            return
        message = (
            f"the weight stream does not match the model: {len(missing)} missing {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}, {len(unexpected)} unexpected {unexpected[:20]}"
            f"{' ...' if len(unexpected) > 20 else ''}. Missing tensors keep their old values."
        )
        if self.strict:
            raise WeightUpdateError(message)
        logger.warning(message)

    def abort(self) -> None:
        self._closed = True

    def _is_tied_copy(self, hf_name: str, write: str, target: _Target, tensor: torch.Tensor) -> bool:
        """A second name of one tied tensor (``lm_head.weight`` after ``model.embed_tokens.weight``
        in a tied model): accepted without a copy when its bytes equal what was written."""
        first = self._writers[write]
        if first == hf_name or target.part or self._aliases.get(first) != self._aliases.get(hf_name):
            return False
        if not torch.equal(target.view, tensor.to(target.view.device)):
            raise WeightUpdateError(
                f"{hf_name} and {first} are one tied tensor in the model, but the stream gives them different "
                "values: untie them in the model or export tied weights"
            )
        return True

    # -- name resolution -------------------------------------------------------------------

    def target_view(self, hf_name: str) -> torch.Tensor | None:
        """The model tensor (or the slice of a fused one) that ``hf_name`` is written into, or None."""
        target = self._resolve(hf_name)
        return None if target is None else target.view

    def _resolve(self, hf_name: str) -> _Target | None:
        key = self._aliases.get(hf_name)
        if key is not None:
            return _Target(self._tensors[key], key, ())
        for layout, pattern in self._patterns:
            match = pattern.fullmatch(hf_name)
            if match is None:
                continue
            key = self._aliases.get(layout.target.format(experts=match["experts"]))
            if key is None:
                continue
            fused = self._tensors[key]
            expert = int(match["expert"])
            if expert >= fused.shape[0]:
                return None
            view = fused[expert].chunk(layout.num_parts, dim=layout.part_dim)[layout.part]
            return _Target(view, key, (expert, layout.part))
        return None

    @staticmethod
    def _write_key(hf_name: str, target: _Target) -> str:
        return target.key if not target.part else f"{target.key}[{target.part[0]}]#{target.part[1]}"

    def _expected_names(self) -> dict[str, str]:
        """Stream names that must be written (one per model tensor or fused part) -> write key."""
        expected: dict[str, str] = {}
        for key, tensor in self._tensors.items():
            rows = [row for row in self._layouts if key.endswith(row.target_suffix())]
            if not rows or tensor.dim() == 0:
                expected[key] = key
                continue
            experts = key.removesuffix(rows[0].target_suffix())
            for expert in range(tensor.shape[0]):
                for row in rows:
                    expected[row.source.format(experts=experts, expert=expert)] = f"{key}[{expert}]#{row.part}"
        return expected


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(key -> tensor, every state_dict name -> key) where aliases of one storage share a key."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        key = seen.get(identity) if tensor.numel() else None
        if key is None:
            key = seen.setdefault(identity, name)
            tensors[key] = tensor
        aliases[name] = key
    return tensors, aliases


def _part_text(target: _Target) -> str:
    return f"[expert {target.part[0]}, part {target.part[1]}]" if target.part else ""


__all__ = ["FUSED_TENSOR_RULES", "FusedTensorRule", "HFModelUpdateSink", "WeightUpdateError"]
