"""Stacked expert tensors: one HF tensor [E, ...] holding every expert, each a re-laid-out shard.

Some checkpoints keep all experts of a layer in one tensor (GPT-OSS: ``mlp.experts.gate_up_proj``
[E, hidden, 2*ffn], ``gate_up_proj_bias`` [E, 2*ffn], ``down_proj`` [E, ffn, hidden],
``down_proj_bias`` [E, hidden]). The bridge exports them with "grouped export" mappings: each
expert's Megatron tensor is converted alone, then the E results are stacked in global expert
order. Slot ``e`` of such a tensor is not a slice of the expert's parameter but a fixed
re-layout of all of it, which ``ExpertStack`` describes:

* ``interleave`` k: the parameter's rows are k consecutive blocks of n/k rows (Megatron's
  ``linear_fc1``: gate rows, then up rows); the HF rows take one row of each block in turn
  (HF row ``i*k + b`` is parameter row ``b*(n/k) + i``: gate, up, gate, up, ...);
* ``transpose``: the HF slot is the transpose of the (interleaved) 2-D parameter.

Both are views, so building a slot is one strided ``copy_`` from the parameter into a view of
the output (``ExpertStack.copy_into``), with no temporary. Expert tensor parallelism must be 1
(each rank holds whole experts, as ``plan.layout`` requires).

``STACKING_RULES`` is the per-mapping table: the bridge's grouped-export mapping class -> the
stack its conversion produces. A grouped-export mapping without a row (or a subclass that
overrides the conversion) keeps the model on the stock export, named in the plan's error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mbridge_refit.plan.placement import PlacementError, PlacementKind

STACKED_KIND = "stacked_experts"  # PlanEntry.kind / PlacementKind.kind of a stacked expert tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertStack:
    """How expert ``e``'s local Megatron tensor becomes slot ``e`` of a stacked HF tensor [E, ...]
    (module docstring). ``num_experts``: E, the stack's first dimension (0 until the plan knows it)."""

    interleave: int = 1
    transpose: bool = False
    num_experts: int = 0

    def expert_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one HF slot, from the expert's local parameter shape."""
        self.check(local_shape)
        return tuple(reversed(local_shape)) if self.transpose else tuple(local_shape)

    def check(self, local_shape: tuple[int, ...]) -> None:
        if self.transpose and len(local_shape) != 2:
            raise PlacementError(f"a transposed expert slot needs a 2-D parameter, not shape {local_shape}")
        if self.interleave < 1 or local_shape[0] % self.interleave:
            raise PlacementError(
                f"an expert parameter of {local_shape[0]} rows cannot be interleaved in {self.interleave} blocks"
            )

    def copy_into(self, slot: torch.Tensor, local: torch.Tensor) -> None:
        """Write ``local`` (one expert's parameter) into ``slot`` (its HF slot, any strides)."""
        target = slot.transpose(0, 1) if self.transpose else slot  # now laid out like ``local``
        k = self.interleave
        rows = local.shape[0] // k
        target.unflatten(0, (rows, k)).copy_(local.unflatten(0, (k, rows)).transpose(0, 1))

    def read_from(self, slot: torch.Tensor) -> torch.Tensor:
        """The expert's parameter from its HF slot (the inverse of ``copy_into``; a new tensor)."""
        source = slot.transpose(0, 1) if self.transpose else slot
        k = self.interleave
        rows = source.shape[0] // k
        return source.unflatten(0, (rows, k)).transpose(0, 1).reshape(source.shape).contiguous()


def _gpt_oss_gate_up(mapping: Any, local_shape: tuple[int, ...]) -> ExpertStack:
    # GPTOSSMLPGateUpProjMapping.megatron_to_hf: un-interleave (gate/up rows alternate), then
    # transpose 2-D weights; the bias is un-interleaved only.
    return ExpertStack(interleave=2, transpose=len(local_shape) == 2)


def _gpt_oss_down(mapping: Any, local_shape: tuple[int, ...]) -> ExpertStack:
    # GPTOSSMLPDownProjMapping.megatron_to_hf: weights transposed, "_bias" tensors as they are.
    return ExpertStack(transpose=len(local_shape) >= 2 and not str(mapping.hf_param).endswith("_bias"))


@functools.cache
def stacking_rules() -> dict[type, Callable[[Any, tuple[int, ...]], ExpertStack]]:
    """Grouped-export mapping class -> the stack its conversion builds (exact class match)."""
    from megatron.bridge.models.gpt_oss import gpt_oss_bridge as gpt_oss

    return {
        gpt_oss.GPTOSSMLPGateUpProjMapping: _gpt_oss_gate_up,
        gpt_oss.GPTOSSMLPDownProjMapping: _gpt_oss_down,
    }


def stacked_placement(mapping: Any, local_shape: tuple[int, ...]) -> tuple[PlacementKind, ExpertStack] | None:
    """The placement and stack of a grouped-export expert parameter; None for any other mapping.

    Raises ``PlacementError`` naming the parameter for a grouped-export mapping without a rule, or
    one whose export the rule cannot describe (permuted dims, an adaptive transpose, expert tensor
    parallelism, a shape the stack does not fit).
    """
    if not getattr(mapping, "is_grouped_export", False):
        return None
    rule = stacking_rules().get(type(mapping))
    where = f"parameter {mapping.megatron_param!r} ({type(mapping).__name__}, a grouped-export expert mapping)"
    if rule is None:
        supported = ", ".join(t.__name__ for t in stacking_rules())
        raise PlacementError(f"{where} has no stacking rule (supported: {supported})")
    if getattr(mapping, "permute_dims", None) is not None or getattr(mapping, "transpose_on_export", False):
        raise PlacementError(f"{where} permutes or adaptively transposes its export, which no stacking rule describes")
    if not mapping.is_expert or mapping.tp_size != 1:  # an expert mapping's tp group is expert-TP
        raise PlacementError(f"{where} needs whole experts on each rank (expert tensor parallel size 1)")
    stack = rule(mapping, tuple(local_shape))
    stack.check(tuple(local_shape))
    return PlacementKind(kind=STACKED_KIND, hf_names=(str(mapping.hf_param),)), stack
