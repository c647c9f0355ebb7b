"""Exporting LoRA adapters: the factors as PEFT tensors, and base weights merged with them.

``AdapterExport`` runs a ``plan.lora.LoraPlan``: its factor entries go through a
``PlanExporter`` of their own (gathers, pipeline broadcasts, views at TP1) into buffers it holds
for a whole export (``ExportBuffers(hold_whole_export=True)``: small, r·(in + out) per adapter,
allocated on the first export and reused), so every factor is valid at once. Then:

* ``stream`` yields ``(lora_A, A)`` and ``(lora_B, B)`` per adapted HF weight, in stock's
  adapter-export order (the whole A repeated for each projection of a fused layer);
* ``merged`` rewrites a stream of base-weight buckets: each adapted weight W becomes
  ``bf16(float(W) + scale · (float(B) @ float(A)))`` in an output buffer of its own. These are
  stock's operations in stock's order (``LoRAMerge.merge`` on float32 copies of the same
  factors, one matmul of the same shapes), so the bits are stock's. A float32 delta of W's shape
  is the one full-size temporary: a scratch buffer reused for every weight of that shape
  (fusing it into the matmul, ``addmm``, would round differently from stock).

Both are collective (the factor export is), on every rank of the model's groups, in step.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from mbridge_refit.plan.lora import AdapterTarget, LoraPlan
from mbridge_refit.runtime.buffers import ExportBuffers
from mbridge_refit.runtime.exporter import PlanExporter
from mbridge_refit.runtime.selection import RowSelection

__all__ = ["AdapterExport", "merge_adapter"]

MERGED_ROLE = "lora_merged"  # output buffers of merged weights (one per bucket position)
WORK_ROLE = "lora_work"  # float32 scratch, consumed inside one merge (``buffers.SCRATCH_ROLES``)


class AdapterExport:
    """The factor export of one model's adapters (module docstring); built once per model."""

    def __init__(self, lora: LoraPlan, params: dict[str, torch.Tensor], device: torch.device) -> None:
        self.lora = lora
        self.exporter = PlanExporter(plan=lora.plan, params=params, device=device)
        self.held = ExportBuffers(persistent=True, hold_whole_export=True)
        self._targets = lora.by_base()

    @property
    def targets(self) -> dict[str, AdapterTarget]:
        """Adapted HF weight name -> its target."""
        return self._targets

    def factors(self) -> dict[str, torch.Tensor]:
        """Every factor entry's tensor, valid together until the next export (collective)."""
        return dict(self.exporter.export(self.held))

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(PEFT name, tensor)`` of every factor, A then B per adapted weight (collective)."""
        factors = self.factors()
        for target in self.lora.targets:
            yield target.lora_a, factors[target.a_entry]
            yield target.lora_b, factors[target.lora_b]

    def merged(
        self, buckets: Iterable[list[tuple[str, Any]]], buffers: ExportBuffers
    ) -> Iterator[list[tuple[str, Any]]]:
        """``buckets`` with every adapted weight merged with its adapter, into ``buffers``
        (collective: the factors are exported before the first bucket)."""
        factors = None
        for bucket in buckets:
            if factors is None:
                factors = self.factors()
            yield [self._merged_item(i, item, factors, buffers) for i, item in enumerate(bucket)]
        if factors is None:  # an export that yields nothing still takes part in the factor export
            self.factors()

    def _merged_item(
        self, index: int, item: tuple[str, Any], factors: dict[str, torch.Tensor], buffers: ExportBuffers
    ) -> tuple[str, Any]:
        name, tensor = item
        target = self._targets.get(name)
        if target is None:
            return item
        if isinstance(tensor, RowSelection):
            tensor = tensor.materialize()
        out = buffers.get(MERGED_ROLE, index, tuple(tensor.shape), tensor.dtype, tensor.device, name)
        merge_adapter(out, tensor, factors[target.a_entry], factors[target.lora_b], target.scale, buffers)
        return name, out


def merge_adapter(
    out: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, buffers: ExportBuffers
) -> torch.Tensor:
    """``out = base + scale · (B @ A)`` as Megatron-Bridge's merge computes it: float32 copies of
    the factors, ``scale * (B @ A)``, added to the float32 base, rounded once to ``out``'s dtype."""
    device = base.device
    a32 = buffers.get(WORK_ROLE, "a", tuple(a.shape), torch.float32, device)
    b32 = buffers.get(WORK_ROLE, "b", tuple(b.shape), torch.float32, device)
    delta = buffers.get(WORK_ROLE, "delta", tuple(base.shape), torch.float32, device)
    a32.copy_(a)
    b32.copy_(b)
    torch.matmul(b32, a32, out=delta)
    delta.mul_(scale)
    delta.add_(base)
    return out.copy_(delta)
