"""How the trainer stores a parameter: the facts the plan records per parameter.

``PLAIN`` is a high-precision tensor (bf16/fp16/fp32). ``FP8_BLOCKWISE`` is Transformer Engine's
``Float8BlockwiseQTensor`` with 128x128 blocks and row-wise data, which is already the HF
blockwise FP8 format. Any other TE quantized storage is named by its class (e.g.
``"Float8Tensor"``) so that an FP8 export can refuse it by name. TE is imported lazily: models
without quantized parameters never touch it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FP8_BLOCKWISE", "PLAIN", "QUANTIZABLE", "is_quantized", "quantized_tensor_class", "storage_format"]

PLAIN = "plain"  # a high-precision tensor: quantized on an FP8 export
FP8_BLOCKWISE = "fp8_blockwise"  # TE 128x128 blockwise e4m3, row-wise data: shipped as stored
QUANTIZABLE = (PLAIN, FP8_BLOCKWISE)  # what the blockwise FP8 export accepts


def storage_format(param: torch.Tensor) -> str:
    """``PLAIN``, ``FP8_BLOCKWISE``, or a description of another TE quantized storage
    (e.g. ``"Float8Tensor"`` for delayed/current scaling, ``"MXFP8Tensor"``)."""
    quantized = quantized_tensor_class()
    if quantized is None or not isinstance(param, quantized):
        return PLAIN
    name = type(param).__name__
    if name != "Float8BlockwiseQTensor":
        return name
    metadata = param.get_metadata()
    if not metadata.get("is_2D_scaled"):
        return "Float8BlockwiseQTensor (1x128 blocks)"
    if metadata.get("rowwise_data") is None or metadata.get("rowwise_scale_inv") is None:
        return "Float8BlockwiseQTensor (column-wise data only)"
    return FP8_BLOCKWISE


def is_quantized(param: torch.Tensor) -> bool:
    return storage_format(param) != PLAIN


@functools.cache
def quantized_tensor_class():
    """TE's ``QuantizedTensor`` base class, or None where Transformer Engine is not installed."""
    try:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor
    except ImportError:
        return None
    return QuantizedTensor
