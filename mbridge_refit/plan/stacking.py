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
the output (``ExpertStack.copy_into``), with no temporary.

With expert tensor parallelism (``split`` ranks; Megatron's default at TP > 1) each rank holds a
shard of each expert, cut as the expert's linear layer is: ``"gated"`` (``linear_fc1`` of a
gated MLP: each rank holds its rows of the gate, then its rows of the up projection),
``"rows"`` (column-parallel) or ``"columns"`` (row-parallel ``linear_fc2``). ``join_into``
rebuilds the whole parameter from the shards gathered over the expert-TP group (what the
bridge's own mapping gathers and concatenates), which is then stacked as above; ``shard_of`` is
its inverse for the loader. Only the packed-expert mappings are split so (Megatron builds no
expert biases, hence no GPT-OSS experts, with expert-TP > 1).

``stacking_rules`` is the per-mapping table: the bridge's grouped-export mapping class -> the
stack its conversion produces. A grouped-export mapping without a row (or a subclass that
overrides the conversion) keeps the model on the stock export, named in the plan's error.

Checkpoints that keep experts packed (``experts.gate_up_proj`` [E, 2*ffn, hidden] and
``experts.down_proj`` [E, hidden, ffn]: transformers 5's own layout, Gemma 4, Qwen3-VL-MoE) are
read by ``FusedGatedExpertMapping`` / ``FusedExpertMapping``: slot ``e`` is expert ``e``'s
parameter as it is (Megatron's ``linear_fc1`` already holds gate rows, then up rows). A mapping
with ``transpose_on_export`` (Qwen3-VL-MoE, whose published checkpoints store [E, hidden,
2*ffn]) has stock transpose the stacked tensor's last two dimensions, adaptively: when the
checkpoint holds the tensor, only if its stored shape is the transposed one and not the stacked
one (``transposed_by_stock``); so the stack is decided from the checkpoint's shape, as stock
decides it. The loader reads slot ``e`` back through the same stack (``ExpertStack.read_from``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mbridge_refit.plan.slices import PlacementError, PlacementKind

__all__ = ["ExpertStack", "STACKED_KIND", "split_kind", "stacked_placement", "stacking_rules", "transposed_by_stock"]

STACKED_KIND = "stacked_experts"  # PlanEntry.kind / PlacementKind.kind of a stacked expert tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertStack:
    """How expert ``e``'s local Megatron tensor becomes slot ``e`` of a stacked HF tensor [E, ...]
    (module docstring). ``num_experts``: E, the stack's first dimension (0 until the plan knows it)."""

    interleave: int = 1
    transpose: bool = False
    num_experts: int = 0
    split: int = 1  # ranks of the expert tensor-parallel group each expert is split over
    split_kind: str = ""  # how: "gated", "rows" or "columns" (module docstring); "" when whole

    def whole_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the whole expert parameter, from this rank's shard of it."""
        if self.split == 1:
            return tuple(local_shape)
        dim = 1 if self.split_kind == "columns" else 0
        return tuple(size * self.split if d == dim else size for d, size in enumerate(local_shape))

    def expert_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one HF slot, from the expert's local parameter (shard) shape."""
        whole = self.whole_shape(local_shape)
        self.check(whole)
        return tuple(reversed(whole)) if self.transpose else whole

    def check(self, whole_shape: tuple[int, ...]) -> None:
        if self.transpose and len(whole_shape) != 2:
            raise PlacementError(f"a transposed expert slot needs a 2-D parameter, not shape {whole_shape}")
        if self.interleave < 1 or whole_shape[0] % self.interleave:
            raise PlacementError(
                f"an expert parameter of {whole_shape[0]} rows cannot be interleaved in {self.interleave} blocks"
            )

    def join_into(self, whole: torch.Tensor, shards: torch.Tensor) -> None:
        """``whole`` := the expert parameter the ``split`` shards [split, *shard] make (module docstring)."""
        whole.copy_(self._whole_view(shards))

    def _whole_view(self, shards: torch.Tensor) -> torch.Tensor:
        k = shards.shape[0]
        if self.split_kind == "gated":  # [k, 2n, ...] -> gates of every rank, then ups of every rank
            half = shards.shape[1] // 2
            return shards.unflatten(1, (2, half)).transpose(0, 1).reshape(2 * k * half, *shards.shape[2:])
        if self.split_kind == "columns":  # [k, rows, n] -> [rows, k*n]
            return shards.permute(1, 0, *range(2, shards.dim())).reshape(shards.shape[1], -1, *shards.shape[3:])
        return shards.reshape(k * shards.shape[1], *shards.shape[2:])  # "rows"

    def shard_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of the whole expert parameter (the inverse of ``join_into``; a new tensor)."""
        if self.split == 1:
            return whole
        k = self.split
        if self.split_kind == "gated":
            half = whole.shape[0] // (2 * k)
            return whole.unflatten(0, (2, k, half))[:, rank].reshape(2 * half, *whole.shape[1:]).contiguous()
        if self.split_kind == "columns":
            return whole.unflatten(1, (k, whole.shape[1] // k))[:, rank].contiguous()
        return whole.unflatten(0, (k, whole.shape[0] // k))[rank].contiguous()

    def copy_into(self, slot: torch.Tensor, local: torch.Tensor) -> None:
        """Write ``local`` (one expert's parameter) into ``slot`` (its HF slot, any strides)."""
        target, source = self.slot_views(slot, local)
        target.copy_(source)

    def slot_views(self, slot: torch.Tensor, local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(target, source)``: views of ``slot`` and ``local`` of one shape, so that
        ``target.copy_(source)`` is ``copy_into`` (many experts' pairs can go to one
        ``torch._foreach_copy_``)."""
        target = slot.transpose(0, 1) if self.transpose else slot  # now laid out like ``local``
        k = self.interleave
        rows = local.shape[0] // k
        return target.unflatten(0, (rows, k)), local.unflatten(0, (k, rows)).transpose(0, 1)

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


def split_kind(mapping: Any, partition_dim: int | None) -> str:
    """How an expert's packed-expert mapping is cut over expert-TP ranks (module docstring): the
    gated mapping's halves, else the rows or columns of the parameter's ``partition_dim``."""
    from megatron.bridge.models.conversion import param_mapping as pm

    if type(mapping) is pm.FusedGatedExpertMapping:
        return "gated"
    return "columns" if partition_dim == 1 else "rows"


def _as_it_is(mapping: Any, local_shape: tuple[int, ...]) -> ExpertStack:
    # FusedGatedExpertMapping.megatron_to_hf: the gated mapping's gate and up halves (at expert
    # tensor parallel size 1, the parameter's first and second half of rows) concatenated again;
    # FusedExpertMapping.megatron_to_hf: AutoMapping's, the whole parameter. Either way the parameter.
    return ExpertStack()


@functools.cache
def stacking_rules() -> dict[type, Callable[[Any, tuple[int, ...]], ExpertStack]]:
    """Grouped-export mapping class -> the stack its conversion builds (exact class match)."""
    from megatron.bridge.models.conversion import param_mapping as pm
    from megatron.bridge.models.gpt_oss import gpt_oss_bridge as gpt_oss

    return {
        gpt_oss.GPTOSSMLPGateUpProjMapping: _gpt_oss_gate_up,
        gpt_oss.GPTOSSMLPDownProjMapping: _gpt_oss_down,
        pm.FusedGatedExpertMapping: _as_it_is,
        pm.FusedExpertMapping: _as_it_is,
    }


def transposed_by_stock(
    mapping: Any, slot_shape: tuple[int, ...], num_experts: int, stored_shape: tuple[int, ...] | None
) -> bool:
    """Whether stock's grouped export transposes the stacked tensor [E, *slot_shape] in its last
    two dimensions (``MegatronModelBridge._accumulate_grouped_export``): never without
    ``transpose_on_export``; with it, always when the checkpoint does not hold the tensor
    (``stored_shape`` None), else only when the stored shape is the transposed one and not the
    stacked one (a square slot is therefore never transposed)."""
    if not getattr(mapping, "transpose_on_export", False):
        return False
    stacked = (num_experts, *slot_shape)
    if stored_shape is None:
        return True
    transposed = (*stacked[:-2], stacked[-1], stacked[-2])
    return tuple(stored_shape) != stacked and tuple(stored_shape) == transposed


def stacked_placement(
    mapping: Any,
    local_shape: tuple[int, ...],
    *,
    num_experts: int,
    stored_shape: tuple[int, ...] | None = None,
    partition_dim: int | None = None,
) -> tuple[PlacementKind, ExpertStack] | None:
    """The placement and stack of a grouped-export expert parameter; None for any other mapping.

    ``num_experts``: the model's expert count (E); ``stored_shape``: the shape the checkpoint
    stores the stacked tensor in, None where there is no checkpoint or it lacks the tensor (stock
    decides an adaptive transpose from it: ``transposed_by_stock``); ``partition_dim``: the
    dimension the parameter is split on over its expert-TP group (Megatron's mark), when it is.
    Raises ``PlacementError`` naming the parameter for a grouped-export mapping without a rule, or
    one whose export the rule cannot describe (permuted dims, expert tensor parallelism of a
    mapping other than the packed-expert ones, a transpose of a 1-D slot, a shape the stack does
    not fit).
    """
    if not getattr(mapping, "is_grouped_export", False):
        return None
    rule = stacking_rules().get(type(mapping))
    where = f"parameter {mapping.megatron_param!r} ({type(mapping).__name__}, a grouped-export expert mapping)"
    if rule is None:
        supported = ", ".join(t.__name__ for t in stacking_rules())
        raise PlacementError(f"{where} has no stacking rule (supported: {supported})")
    if getattr(mapping, "permute_dims", None) is not None:
        raise PlacementError(f"{where} permutes its export's dimensions, which no stacking rule describes")
    if not mapping.is_expert:
        raise PlacementError(f"{where} is not an expert mapping")
    stack = rule(mapping, tuple(local_shape))
    if mapping.tp_size != 1:  # an expert mapping's tp group is expert-TP
        if rule is not _as_it_is:
            raise PlacementError(f"{where} needs whole experts on each rank (expert tensor parallel size 1)")
        stack = dataclasses.replace(stack, split=mapping.tp_size, split_kind=split_kind(mapping, partition_dim))
    stack.check(stack.whole_shape(tuple(local_shape)))
    if transposed_by_stock(mapping, stack.expert_shape(tuple(local_shape)), num_experts, stored_shape):
        if len(local_shape) != 2:
            raise PlacementError(
                f"{where}: stock transposes a stack of 1-D slots (the expert dimension with the other)"
            )
        stack = dataclasses.replace(stack, transpose=not stack.transpose)
    return PlacementKind(kind=STACKED_KIND, hf_names=(str(mapping.hf_param),)), dataclasses.replace(
        stack, num_experts=num_experts
    )
