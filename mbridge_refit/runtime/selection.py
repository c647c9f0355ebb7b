"""HF tensors described as row runs of one local tensor: ``RowSelection`` and ``LiveRows``.

Without tensor parallelism, q, k and v of grouped-query attention are runs of rows of the fused
QKV parameter. ``PlanExporter.export_buckets(select_rows_lazily=True)`` yields them as selections
so that a transform that reads rows anyway (the FP8 quantizer) reads them from the source and
the copy never happens; everything else calls ``materialize()``.

``LiveRows`` says the same of a tensor for as long as the model lives: where an HF tensor is, on
this rank, rows of one local parameter read as stored (no collective, no transform), a consumer
that keeps a view of the parameter's memory sees every new weight without an export
(``PlanExporter.live_rows``; a colocated engine mapping trainer memory, ``engines.ipc.engine``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["LiveRows", "RowSelection", "Runs", "materialized"]


class RowSelection:
    """Rows of ``source`` that form one HF tensor.

    ``runs``: ``(hf_row, source_row, rows)`` triples, ascending in ``hf_row`` and covering the
    HF tensor. ``materialize()`` copies the rows into the export's buffer for this tensor (once;
    later calls return the same tensor). Valid as long as the bucket that yielded it.
    """

    __slots__ = ("source", "runs", "shape", "_build", "_tensor")

    def __init__(
        self,
        source: torch.Tensor,
        runs: tuple[tuple[int, int, int], ...],
        shape: tuple[int, ...],
        build: Callable[[], torch.Tensor],
    ) -> None:
        self.source, self.runs, self.shape, self._build = source, runs, tuple(shape), build
        self._tensor: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    def materialize(self) -> torch.Tensor:
        if self._tensor is None:
            self._tensor = self._build()
        return self._tensor


def materialized(tensor: "torch.Tensor | RowSelection") -> torch.Tensor:
    """``tensor`` itself, or the copied rows of a selection."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.materialize()


Runs = tuple[tuple[int, int, int], ...]  # (hf_row, source_row, rows), ascending in hf_row, covering the HF tensor


@dataclass(frozen=True, slots=True)
class LiveRows:
    """An HF tensor that is rows ``runs`` of ``parameter`` (a local parameter of the model, read
    along dim 0 as stored), on this rank, at any time: the parameter's current bytes are the
    tensor's current value. ``shape``: the HF tensor's."""

    parameter: torch.Tensor
    runs: Runs
    shape: tuple[int, ...]

    def source(self) -> torch.Tensor:
        """The parameter's current data (a view; follows ``param.data = ...`` swaps)."""
        return self.parameter.detach()

    @property
    def is_view(self) -> bool:
        """One run from row 0 of the HF tensor: the tensor is a view of the parameter."""
        return len(self.runs) == 1 and self.runs[0][0] == 0

    def tensor(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The HF tensor: a view of the parameter when ``is_view``, else its rows copied into
        ``out`` (allocated when None)."""
        source = self.source()
        if self.is_view:
            _, start, rows = self.runs[0]
            return source.narrow(0, start, rows)
        if out is None:
            out = torch.empty(self.shape, dtype=source.dtype, device=source.device)
        for hf_row, source_row, rows in self.runs:
            out.narrow(0, hf_row, rows).copy_(source.narrow(0, source_row, rows))
        return out
