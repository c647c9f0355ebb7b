"""Conversions some mappings apply on top of their base class's slices: elementwise ops and relayouts.

A few mappings convert values as well: the exported tensor is the base class's slices followed by
an elementwise op that stock applies in the parameter's dtype (Qwen3-Next's zero-centred RMSNorm:
``+ 1``): ``ELEMENTWISE_OPS``. Others re-lay the whole tensor out: the exported tensor is the base
class's whole tensor transposed (``AutoMapping(permute_dims=(1, 0))``: Gemma 3 VL's projector) or
given a leading dimension of 1 (ERNIE 4.5's expert bias, ``_SqueezeBiasMapping``): ``RELAYOUTS``
describes each (its shape and a view of the tensor either way); the slices describe the tensor
before the re-layout. Which mapping classes apply which is ``plan.placement``'s table
(``elementwise_op_rules``, ``relayout_rules``); ``PlacementKind`` carries the names into the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mbridge_refit.plan.slices import PlacementError

__all__ = ["ELEMENTWISE_OPS", "ElementwiseOp", "RELAYOUTS", "Relayout", "relaid_shape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ElementwiseOp:
    """An elementwise conversion a mapping applies on top of its base class's slices, in the
    parameter's dtype and in place, exactly as the mapping does: ``export`` as its
    ``megatron_to_hf`` does, ``load`` (the inverse) as its ``hf_to_megatron`` does."""

    export: Callable[[torch.Tensor], Any]
    load: Callable[[torch.Tensor], Any]


ELEMENTWISE_OPS: dict[str, ElementwiseOp] = {
    # RMSNorm2ZeroCenteredRMSNormMapping: ``value.data += 1`` on export, ``-= 1`` on import
    "add_one": ElementwiseOp(export=lambda t: t.add_(1), load=lambda t: t.sub_(1)),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Relayout:
    """A re-layout a mapping applies to the whole tensor its base class's conversion makes:
    ``export_shape`` of the base tensor's shape (None where the mapping leaves such a tensor as
    it is), ``base_shape`` the inverse, ``export`` a view of the base tensor laid out as exported
    (the exporter copies it into the output), ``load`` a view of the stored tensor laid out as
    the base (what the CPU loader slices)."""

    export_shape: Callable[[tuple[int, ...]], tuple[int, ...] | None]
    base_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    export: Callable[[torch.Tensor], torch.Tensor]
    load: Callable[[torch.Tensor], torch.Tensor]


RELAYOUTS: dict[str, Relayout] = {
    # AutoMapping(permute_dims=(1, 0)).megatron_to_hf: torch.permute(gathered, (1, 0)).contiguous(), 2-D only
    "transpose": Relayout(
        export_shape=lambda shape: (shape[1], shape[0]) if len(shape) == 2 else None,
        base_shape=lambda shape: (shape[1], shape[0]),
        export=lambda tensor: tensor.t(),
        load=lambda tensor: tensor.t(),
    ),
    # _SqueezeBiasMapping.megatron_to_hf: v.unsqueeze(0) if v.ndim == 1 else v
    "unsqueeze0": Relayout(
        export_shape=lambda shape: (1, *shape) if len(shape) == 1 else None,
        base_shape=lambda shape: tuple(shape[1:]),
        export=lambda tensor: tensor.unsqueeze(0),
        load=lambda tensor: tensor.squeeze(0),
    ),
}


def relaid_shape(relayout: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` is exported in after ``relayout`` (``shape`` itself for
    None); a ``PlacementError`` where the relayout has no description for such a tensor."""
    if relayout is None:
        return tuple(shape)
    relaid = RELAYOUTS[relayout].export_shape(tuple(shape))
    if relaid is None:
        raise PlacementError(f"its {relayout!r} relayout has no description for a tensor of shape {list(shape)}")
    return relaid
