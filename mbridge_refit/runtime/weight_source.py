"""What a consumer that drives an export asks of the bridge: the ``ExportsWeights`` protocol.

Refit sessions, verifiers and writers take "a bridge" and call a few of its methods; typing them
against this protocol instead of ``Any`` says which, and lets a test pass a small stand-in.
``RefitBridge`` implements it (its methods take more options; those named here are the ones
consumers pass). It lives in the runtime layer because it names the plan's ``ExportPlan`` and the
runtime's ``LiveRows``, so every layer above may use it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from mbridge_refit.plan.entries import ExportPlan
from mbridge_refit.runtime.selection import LiveRows

__all__ = ["ExportsWeights", "Model"]

Model = list[torch.nn.Module] | torch.nn.Module  # Megatron model chunks, or one module


@runtime_checkable
class ExportsWeights(Protocol):
    """A bridge whose export a consumer drives (``RefitBridge``'s methods of the same names).

    ``hf_pretrained``: the HF side (a config, or an object with ``.config``). ``export_plan``:
    the tensors ``export_hf_weights`` yields, in order (collective on its first call for a model).
    ``live_rows``: the exported names that are rows of a local parameter read as stored (empty
    where the plan cannot describe the model). ``quantized_live_rows``: the weights an FP8 export
    quantizes that are such rows in whole blocks, with their scales' names (a consumer may quantize
    them itself). ``export_hf_weights``: the collective stream of
    ``(hf_name, tensor)``; every rank of the model's groups iterates it to the end.
    ``export_hf_weight_buckets``: the same export in lists, some stamped (``runtime.stamps``).
    """

    hf_pretrained: Any

    def export_plan(self, model: Model, *, fp8: Any = None) -> ExportPlan: ...

    def live_rows(self, model: Model, *, fp8: Any = None) -> dict[str, LiveRows]: ...

    def quantized_live_rows(self, model: Model, *, fp8: Any) -> dict[str, tuple[LiveRows, str]]: ...

    def export_hf_weights(
        self,
        model: Model,
        *,
        show_progress: bool = True,
        reuse_buffer_from_cache: bool = False,
        hold_outputs: bool = False,
        fp8: Any = None,
        only: Collection[str] | None = None,
    ) -> Iterable[tuple[str, torch.Tensor]]: ...

    def export_hf_weight_buckets(
        self,
        model: Model,
        *,
        show_progress: bool = True,
        reuse_buffer_from_cache: bool = False,
        hold_outputs: bool = False,
        fp8: Any = None,
        only: Collection[str] | None = None,
    ) -> Iterable[list[tuple[str, torch.Tensor]]]: ...
