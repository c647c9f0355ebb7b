"""The reference blockwise FP8 quantizer in torch ops (CPU and CUDA): it defines the bits.

``quantize_reference`` implements the format of ``fp8.format`` exactly: amax per 128x128 block
of the HF tensor, ``scale_inv = amax / 448`` by IEEE division (by a device tensor: PyTorch's CUDA
division by a Python scalar multiplies by the reciprocal), 1.0 for all-zero blocks, then
``e4m3fn(clamp(x / scale_inv, -448, 448))`` with round-to-nearest-even. The Triton kernels
(``fp8.kernels``) are used only where they reproduce these bits; tests compare every FP8 output
with this function.
"""

from __future__ import annotations

import math

import torch

from mbridge_refit.fp8.format import (
    BLOCK,
    E4M3_MAX,
    FP8_DTYPE,
    SCALE_DTYPE,
    FP8FormatError,
    FP8Pair,
    Scratch,
    scale_shape,
)

__all__ = ["dequantize_blockwise", "padded_shape", "quantize_reference"]


def quantize_reference(
    x: torch.Tensor, *, out: Scratch = None, scale_out: Scratch = None, work: Scratch = None
) -> FP8Pair:
    """Quantize a 2-D tensor to (e4m3fn data, fp32 ``scale_inv``) with torch ops.

    ``out`` [rows, cols] float8_e4m3fn, ``scale_out`` ``scale_shape(x.shape)`` float32 and ``work``
    (fp32, ``padded_shape(x.shape)``) are written in place when given (cached buffers); otherwise
    allocated.
    """
    if x.dim() != 2:
        raise FP8FormatError(f"blockwise FP8 needs a 2-D tensor, got shape {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if out is None else out
    scale_out = (
        torch.empty(scale_shape(tuple(x.shape)), dtype=SCALE_DTYPE, device=x.device) if scale_out is None else scale_out
    )
    work = torch.empty(padded_shape(tuple(x.shape)), dtype=torch.float32, device=x.device) if work is None else work
    _quantize_into(x, out, scale_out, work)
    return out, scale_out


def padded_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    rows, cols = scale_shape(shape)
    return (rows * BLOCK, cols * BLOCK)


def _quantize_into(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, work: torch.Tensor) -> None:
    rows, cols = x.shape
    block_rows, block_cols = scale_out.shape
    padded = work.view(block_rows * BLOCK, block_cols * BLOCK)
    if (rows, cols) != padded.shape:
        padded.zero_()  # zeros never raise a block's amax
    region = padded[:rows, :cols]
    region.copy_(x)
    blocks = padded.view(block_rows, BLOCK, block_cols, BLOCK)
    torch.linalg.vector_norm(blocks, ord=math.inf, dim=(1, 3), out=scale_out)
    scale_out.div_(_e4m3_max_on(scale_out.device))  # a tensor, not a Python scalar: see _e4m3_max_on
    scale_out.masked_fill_(scale_out == 0, 1.0)
    blocks.div_(scale_out.view(block_rows, 1, block_cols, 1)).clamp_(-E4M3_MAX, E4M3_MAX)
    out.copy_(region)


_E4M3_MAX_TENSORS: dict[str, torch.Tensor] = {}


def _e4m3_max_on(device: torch.device) -> torch.Tensor:
    """448 as a 0-dim fp32 tensor on ``device``, made once per device.

    Dividing by it is an IEEE division everywhere; dividing a CUDA tensor by a Python scalar is
    not (PyTorch multiplies by the scalar's reciprocal there, which can differ by one ulp).
    """
    key = str(device)
    if key not in _E4M3_MAX_TENSORS:
        _E4M3_MAX_TENSORS[key] = torch.full((), E4M3_MAX, dtype=torch.float32, device=device)
    return _E4M3_MAX_TENSORS[key]


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale_inv`` with the scale broadcast over its block (for checks and tests)."""
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * expanded
