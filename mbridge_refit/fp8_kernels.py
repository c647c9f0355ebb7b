"""Triton kernels of the blockwise FP8 quantizer (the format and its reference path: ``fp8``).

Imported lazily by ``fp8`` on CUDA machines (an ImportError where Triton is missing means the
torch path runs). One block body, two launch shapes:

* ``quantize_single``: one tensor, grid (block rows, block columns);
* ``quantize_grouped``: many tensors of one dtype in one launch, grid (blocks of the largest
  tensor, tensors); each tensor is described by a row of an int64 table (``DESCRIPTOR_FIELDS``
  columns: x, q and scale pointers; rows, cols; x and q row strides; block columns) and the
  programs past a smaller tensor's last block return at once. Pointers (bytes), columns and row
  strides (elements) must be multiples of ``ALIGNMENT``.

Each program loads one 128x128 block once, takes its amax, and stores the e4m3fn block and its
fp32 ``scale_inv``, with the rounding ``fp8``'s docstring specifies (IEEE-exact quotients, clamp,
round-to-nearest-even). The per-element quotient is computed with one reciprocal per block and two
FMAs (correctly rounded, see ``_quantize_block``), not a division per element.
"""

import triton
import triton.language as tl

DESCRIPTOR_FIELDS = 8
# Blocks whose scale_inv is at least 2^-90 (amax >= 448 * 2^-90, ~3.6e-25) divide by reciprocal
# and two FMAs; smaller ones by IEEE division. For such a scale, any quotient >= 2^-11 has an
# exactly representable residual (granularity >= 2^-147), and smaller quotients round to 0 in e4m3
# whatever their last bits.
MIN_FAST_SCALE = tl.constexpr(2.0**-90)
ALIGNMENT = 16  # the grouped kernel needs x and q pointers, cols and row strides divisible by this


@triton.jit
def _quantize_block(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, block_row, block_col, BLOCK_SIZE: tl.constexpr):
    r = block_row * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[:, None]
    c = block_col * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    mask = (r < rows) & (c < cols)
    x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.math.div_rn(amax, 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    if scale >= MIN_FAST_SCALE:
        # x / scale, correctly rounded, without a division per element (div.rn costs ~20
        # instructions and made the kernel compute-bound): with recip = RN(1/scale) and
        # q0 = RN(x * recip) within 1 ulp, the residual x - q0 * scale is exact in one FMA and
        # RN(q0 + residual * recip) is the IEEE quotient (Markstein's theorem), barring underflow
        # of the residual, which MIN_FAST_SCALE rules out for every quotient that can round to
        # a nonzero e4m3 value.
        zeros = tl.zeros_like(x)  # tl.fma does not broadcast its operands
        recip = zeros + tl.math.div_rn(1.0, scale)
        q0 = x * recip
        y = tl.fma(tl.fma(-q0, zeros + scale, x), recip, q0)
    else:
        y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(q_ptr + r * stride_q + c, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + block_row * n_block_cols + block_col, scale)


@triton.jit
def quantize_single(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, BLOCK_SIZE: tl.constexpr):
    _quantize_block(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, tl.program_id(0), tl.program_id(1), BLOCK_SIZE)


@triton.jit
def quantize_grouped(desc_ptr, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    block = tl.program_id(0)  # this program's block of its tensor, in row-major block order
    d = desc_ptr + tl.program_id(1) * 8  # DESCRIPTOR_FIELDS
    rows = tl.load(d + 3)
    n_block_cols = tl.load(d + 7)
    if block < tl.cdiv(rows, BLOCK_SIZE) * n_block_cols:
        # Alignment hints (the caller guarantees them: ALIGNMENT): without them the compiler
        # cannot vectorize loads and stores through pointers read from memory.
        _quantize_block(
            tl.multiple_of(tl.load(d).to(tl.pointer_type(X_DTYPE)), 16),
            tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.float8e4nv)), 16),
            tl.load(d + 2).to(tl.pointer_type(tl.float32)),
            rows, tl.multiple_of(tl.load(d + 4), 16), tl.multiple_of(tl.load(d + 5), 16), tl.multiple_of(tl.load(d + 6), 16),
            n_block_cols, block // n_block_cols, block % n_block_cols, BLOCK_SIZE,
        )


def triton_dtype(torch_dtype):
    """The Triton element type for a torch float dtype the grouped kernel reads, else None."""
    import torch

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}.get(torch_dtype)
