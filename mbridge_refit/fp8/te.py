"""Transformer Engine FP8 parameters (``fp8_param=True``) as export sources.

A Megatron model built with TE's ``fp8_param`` keeps its linear weights as TE quantized tensors.
With the blockwise recipe (``Float8BlockScaling``) each weight is a ``Float8BlockwiseQTensor``
whose row-wise data is e4m3 with one fp32 ``scale_inv`` per 128x128 block of the *local shard*
(TE pads the scale's column count to a multiple of 4 for its GEMM; the padding is trimmed here).
That is already the HF blockwise FP8 format, so the export ships those bytes and scales as they
are (no dequantize / re-quantize), provided every shard boundary falls on a block boundary
(``fp8.plan.scale_sharding`` checks that when the plan is built).

This module owns what the export needs of TE's quantized parameters: their FP8 data and trimmed
scales, and the ``ShardSource`` functions that hand them (or, for a BF16 export, their dequantized
values) to ``runtime.exporter.PlanExporter``. Which storage a parameter has is a plan-time fact
(``plan.storage``). TE is imported lazily: models without quantized parameters never touch it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mbridge_refit.fp8.format import BLOCK, FP8_DTYPE, FP8_DTYPE_NAME
from mbridge_refit.plan.entries import PlanEntry
from mbridge_refit.plan.storage import FP8_BLOCKWISE, is_quantized, storage_format
from mbridge_refit.runtime.buffers import ExportBuffers
from mbridge_refit.runtime.exporter import ShardSource

__all__ = [
    "dequantized",
    "dequantized_shards",
    "fp8_data",
    "fp8_data_shards",
    "fp8_scale",
    "fp8_scale_shards",
    "has_quantized_params",
]


def fp8_data(param: torch.Tensor) -> torch.Tensor:
    """The row-wise e4m3 data of a blockwise FP8 parameter, as ``float8_e4m3fn`` (a view)."""
    return param.get_metadata()["rowwise_data"].view(FP8_DTYPE)


def _check_e4m3(name: str, param: torch.Tensor) -> None:
    from transformer_engine.pytorch.constants import TE_DType_To_Torch

    fp8_dtype = TE_DType_To_Torch.get(param.get_metadata().get("fp8_dtype"))
    if fp8_dtype != FP8_DTYPE:
        raise ValueError(
            f"{name}: FP8 parameter data is {fp8_dtype}, not {FP8_DTYPE}: the HF blockwise format stores e4m3"
        )


def fp8_scale(param: torch.Tensor) -> torch.Tensor:
    """The fp32 ``scale_inv`` of a blockwise FP8 parameter, [ceil(rows/128), ceil(cols/128)]
    (TE's GEMM padding of the column count removed; a view, not necessarily contiguous)."""
    scale = param.get_metadata()["rowwise_scale_inv"]
    columns = math.ceil(param.shape[-1] / BLOCK)
    return scale if scale.shape[1] == columns else scale[:, :columns]


def dequantized(param: torch.Tensor) -> torch.Tensor:
    """TE's own dequantization of ``param`` to its high-precision dtype (what stock exports)."""
    return param.dequantize(dtype=param.dtype)


def dequantized_shards(params: dict[str, torch.Tensor]) -> ShardSource:
    """BF16 export of a model with quantized parameters: plain parameters as they are,
    quantized ones dequantized by TE into a buffer per bucket slot (as stock export does)."""

    quantized = {name for name, param in params.items() if is_quantized(param)}  # decided once, not per export

    def source(name: str, entry: PlanEntry, slot: Any, buffers: ExportBuffers) -> torch.Tensor:
        param = params[name]
        if name not in quantized:
            return param
        out = buffers.get("dequantized", slot, tuple(param.shape), param.dtype, param.device)
        return out.copy_(dequantized(param))

    return source


def fp8_data_shards(params: dict[str, torch.Tensor]) -> ShardSource:
    """FP8 export: the e4m3 data of a blockwise FP8 parameter whose plan entry is FP8 (shipped
    without a round trip); everything else as in a BF16 export (a quantized parameter that the
    FP8 config keeps in high precision is dequantized)."""
    bf16 = dequantized_shards(params)
    for name, param in params.items():
        if storage_format(param) == FP8_BLOCKWISE:
            _check_e4m3(name, param)

    def source(name: str, entry: PlanEntry, slot: Any, buffers: ExportBuffers) -> torch.Tensor:
        if entry.dtype == FP8_DTYPE_NAME:
            return fp8_data(params[name])
        return bf16(name, entry, slot, buffers)

    return source


def fp8_scale_shards(params: dict[str, torch.Tensor]) -> ShardSource:
    """FP8 export: the trimmed ``scale_inv`` of each native FP8 parameter (copied into a buffer
    only where TE's padding makes the trimmed view non-contiguous)."""

    def source(name: str, entry: PlanEntry, slot: Any, buffers: ExportBuffers) -> torch.Tensor:
        scale = fp8_scale(params[name])
        if scale.is_contiguous():
            return scale
        return buffers.get("scale", slot, tuple(scale.shape), scale.dtype, scale.device).copy_(scale)

    return source


def has_quantized_params(params: dict[str, torch.Tensor]) -> bool:
    return any(is_quantized(p) for p in params.values())
