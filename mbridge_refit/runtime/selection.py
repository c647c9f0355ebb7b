"""``RowSelection``: an HF tensor made of row runs of one local tensor, not copied out yet.

Without tensor parallelism, q, k and v of grouped-query attention are runs of rows of the fused
QKV parameter. ``PlanExporter.export_buckets(select_rows_lazily=True)`` yields them as selections
so that a transform that reads rows anyway (the FP8 quantizer) reads them from the source and
the copy never happens; everything else calls ``materialize()``.
"""

from __future__ import annotations

from typing import Callable

import torch


class RowSelection:
    """Rows of ``source`` that form one HF tensor.

    ``runs``: ``(hf_row, source_row, rows)`` triples, ascending in ``hf_row`` and covering the
    HF tensor. ``materialize()`` copies the rows into the export's buffer for this tensor (once;
    later calls return the same tensor). Valid as long as the bucket that yielded it.
    """

    __slots__ = ("source", "runs", "shape", "_build", "_tensor")

    def __init__(self, source: torch.Tensor, runs: tuple[tuple[int, int, int], ...], shape: tuple[int, ...],
                 build: Callable[[], torch.Tensor]) -> None:
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
