"""CUDA kernels of the blockwise FP8 quantizer (format: ``fp8.format``; bits: ``fp8.reference``).

Imported lazily by ``fp8.quantize`` (an ImportError where Triton is missing means the torch path runs).
Owns the Triton code, the check that it reproduces the reference bits on this device, and the
launches. One block body, two launch shapes:

* ``quantize_single``: one tensor, grid (block rows, block columns);
* grouped (``grouped_launch`` / ``launch_grouped``): many tensors of one dtype in one launch
  (the export launches one per bucket). Each tensor is cut into chunks of whole block rows
  (``LaunchConfig.chunk_blocks``; a chunk has the tensor's blocks, so this changes no bit) and
  each chunk is a row of an int64 table (``DESCRIPTOR_FIELDS`` columns: x, q and scale
  pointers; rows, cols; x and q row strides; block columns). Grid (blocks of the largest chunk,
  chunks); programs past a smaller chunk's last block return at once. Pointers (bytes),
  columns and row strides (elements) must be multiples of ``ALIGNMENT``.

Each program loads one 128x128 block once, takes its amax, and stores the e4m3fn block and its
fp32 ``scale_inv``, with the rounding ``fp8.format`` specifies (IEEE-exact quotients, clamp,
round-to-nearest-even). The per-element quotient is computed with one reciprocal per block and two
FMAs (correctly rounded), blocks of tiny values are rescaled by an exact power of two instead of
taking a division branch, and the clamp is the conversion's saturation (why each is exact:
``_quantize_block``).

A kernel is used only after it reproduced the torch path's bits on probe tensors (``usable``:
once per process, on the current CUDA device, with rounding ties at scale 1 and at scale 3, an
all-zero block, a block of tiny values, quotients one ulp above 448, partial and strided blocks,
a tensor of several chunks).

Launch shapes and kernel variants that were measured and dropped are listed, with their
timings, in ``docs/fp8.md``.
"""

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mbridge_refit.fp8.format import BLOCK, FP8_DTYPE, row_piece, scale_shape
from mbridge_refit.fp8.reference import quantize_reference

__all__ = [
    "ALIGNMENT",
    "DEFAULT_CONFIG",
    "DESCRIPTOR_FIELDS",
    "GroupedLaunch",
    "LaunchConfig",
    "RESCALE_BELOW",
    "TINY_SCALE_FACTOR",
    "grouped_launch",
    "grouped_takes",
    "grouped_writes",
    "launch_grouped",
    "quantize_single",
    "root_cause",
    "usable",
]

logger = logging.getLogger(__name__)

DESCRIPTOR_FIELDS = 8
# Blocks whose scale_inv is below 2^-90 (amax < 448 * 2^-90, ~3.6e-25) are quantized with source
# and scale both multiplied by 2^100 (exact, and the same quotient). With the scale at least
# 2^-90, any quotient >= 2^-11 has an exactly representable Markstein residual (granularity
# >= 2^-147), and smaller quotients round to 0 in e4m3 whatever their last bits.
RESCALE_BELOW = tl.constexpr(2.0**-90)
TINY_SCALE_FACTOR = tl.constexpr(2.0**100)
ALIGNMENT = 16  # the grouped kernel needs x and q pointers, cols and row strides divisible by this


@triton.jit
def _quantize_block(
    x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, block_row, block_col, BLOCK_SIZE: tl.constexpr
):
    """Quantize block (block_row, block_col), read once and held in registers.

    Per element, after the block's amax (taken in the source dtype: abs and max are exact there,
    and only the source tile is live across the reduction): a widening, two multiplies, two FMAs
    and half a conversion. That is all: the kernel is instruction-bound, so a clamp or a division
    branch shows in its time (measured in docs/fp8.md).

    * The quotient x / scale, correctly rounded, by one reciprocal per block and two FMAs: with
      recip = RN(1/scale) and q0 = RN(x * recip) within 1 ulp, the residual x - q0 * scale is
      exact in one FMA and RN(q0 + residual * recip) is the IEEE quotient (Markstein's theorem),
      barring underflow of the residual, which a scale of at least RESCALE_BELOW rules out for
      every quotient that can round to a nonzero e4m3 value.
    * Smaller scales (blocks of values below ~3.6e-25): x and scale are both multiplied by
      TINY_SCALE_FACTOR, a power of two, which is exact for both (the scaled values are normal
      fp32 numbers) and leaves the quotient unchanged, so one code path serves every block (a
      branch to IEEE division per element cost registers and time even when never taken).
    * No clamp to +-448: the conversion is ``cvt.rn.satfinite``, which saturates finite values
      to +-448, and a quotient can exceed 448 only by rounding (by at most one ulp), which rounds
      to 448 anyway; the bits are the format's clamp-then-round (the probe has such quotients).
    """
    r = block_row * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[:, None]
    c = block_col * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    mask = (r < rows) & (c < cols)
    x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)
    scale = tl.math.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32), 448.0)
    scale = tl.where(scale == 0.0, 1.0, scale)
    factor = tl.where(scale < RESCALE_BELOW, TINY_SCALE_FACTOR, 1.0)
    scaled = scale * factor
    y = x.to(tl.float32) * factor
    recip = tl.full(y.shape, tl.math.div_rn(1.0, scaled), tl.float32)  # tl.fma does not broadcast
    q0 = y * recip
    y = tl.fma(tl.fma(-q0, tl.full(y.shape, scaled, tl.float32), y), recip, q0)
    tl.store(q_ptr + r * stride_q + c, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + block_row * n_block_cols + block_col, scale)


@triton.jit
def _single_kernel(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, BLOCK_SIZE: tl.constexpr):
    _quantize_block(
        x_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        stride_x,
        stride_q,
        n_block_cols,
        tl.program_id(0),
        tl.program_id(1),
        BLOCK_SIZE,
    )


@triton.jit
def _grouped_kernel(desc_ptr, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
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
            rows,
            tl.multiple_of(tl.load(d + 4), 16),
            tl.multiple_of(tl.load(d + 5), 16),
            tl.multiple_of(tl.load(d + 6), 16),
            n_block_cols,
            block // n_block_cols,
            block % n_block_cols,
            BLOCK_SIZE,
        )


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# --- launches -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """How grouped launches are shaped (every config writes the same bits).

    ``chunk_blocks``: each tensor is described as chunks of whole block rows of about this many
    blocks (None: whole tensors), so that few programs of the rectangular grid (blocks of the
    largest chunk x chunks) fall past a chunk's end; ``num_warps`` per block program.
    """

    chunk_blocks: int | None = 128
    num_warps: int = 4

    @property
    def label(self) -> str:
        chunks = f"chunks of {self.chunk_blocks} blocks" if self.chunk_blocks else "whole tensors"
        return f"{chunks}, {self.num_warps} warps"


# The fastest of the configs scripts/bench_fp8_kernels.py times (docs/fp8.md lists the configs
# and kernel shapes measured).
DEFAULT_CONFIG = LaunchConfig()


def quantize_single(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """Quantize one 2-D CUDA tensor into ``out`` / ``scale_out`` (``fp8.quantize.quantize_blockwise``'s contract)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    block_rows, block_cols = scale_out.shape
    _single_kernel[(block_rows, block_cols)](
        x,
        out,
        scale_out,
        rows,
        cols,
        x.stride(0),
        out.stride(0),
        block_cols,
        BLOCK_SIZE=BLOCK,
        num_warps=DEFAULT_CONFIG.num_warps,
    )


def grouped_takes(x: torch.Tensor) -> bool:
    """Whether the grouped kernel reads ``x`` in place: a CUDA 2-D tensor of a float dtype it
    knows, rows contiguous, pointer, width and row stride aligned to ``ALIGNMENT``."""
    return (
        x.is_cuda
        and x.dim() == 2
        and x.stride(1) == 1
        and x.dtype in _TRITON_DTYPES
        and not (x.data_ptr() % ALIGNMENT or x.stride(0) % ALIGNMENT or x.shape[1] % ALIGNMENT)
    )


def grouped_writes(q: torch.Tensor) -> bool:
    """Whether the grouped kernel writes e4m3 data into ``q`` in place: a 2-D tensor with contiguous
    rows whose pointer and row stride are aligned to ``ALIGNMENT`` (its stores are vectorized on those
    hints; a destination in an engine's parameter need not be)."""
    return q.is_cuda and q.dim() == 2 and q.stride(1) == 1 and not (q.data_ptr() % ALIGNMENT or q.stride(0) % ALIGNMENT)


@dataclass(frozen=True, slots=True)
class GroupedLaunch:
    """One grouped launch, ready to repeat: the descriptor table (on the device) and the grid.
    Valid while the tensors it was built from keep their storage."""

    table: torch.Tensor
    count: int
    max_blocks: int
    dtype: torch.dtype
    num_warps: int


def grouped_launch(
    jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], config: LaunchConfig | None = None
) -> GroupedLaunch:
    """The launch for ``(source, q, scale)`` triples of one dtype and device that ``grouped_takes``
    (builds the descriptor table: one host-to-device copy); ``DEFAULT_CONFIG`` unless given."""
    config = config or DEFAULT_CONFIG
    pieces = [piece for job in jobs for piece in _chunks(*job, config.chunk_blocks)]
    rows = [
        (x.data_ptr(), q.data_ptr(), s.data_ptr(), x.shape[0], x.shape[1], x.stride(0), q.stride(0), s.shape[1])
        for x, q, s in pieces
    ]
    table = torch.tensor(rows, dtype=torch.int64, device=jobs[0][0].device)
    return GroupedLaunch(
        table=table,
        count=len(rows),
        max_blocks=max(s.numel() for _, _, s in pieces),
        dtype=jobs[0][0].dtype,
        num_warps=config.num_warps,
    )


def _chunks(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, chunk_blocks: int | None) -> list[tuple]:
    """One job cut into runs of whole block rows of about ``chunk_blocks`` blocks each (None: not
    cut): each run is a job of its own with the same blocks."""
    rows, block_cols = x.shape[0], s.shape[1]
    step = rows if chunk_blocks is None else max(1, chunk_blocks // block_cols) * BLOCK
    return [
        row_piece(x, q, s, x_row=start, q_row=start, rows=min(step, rows - start)) for start in range(0, rows, step)
    ]


def launch_grouped(launch: GroupedLaunch) -> None:
    _grouped_kernel[(launch.max_blocks, launch.count)](
        launch.table, X_DTYPE=_TRITON_DTYPES[launch.dtype], BLOCK_SIZE=BLOCK, num_warps=launch.num_warps
    )


# --- the check before use -----------------------------------------------------------------------


@functools.cache
def usable(kind: str) -> bool:
    """Whether the ``"single"`` or ``"grouped"`` kernel reproduces the torch path's bits on the
    probe tensors on this device (checked once per process; a failure is logged with its cause)."""
    try:
        probes = [x for x in _probe_tensors() if kind == "single" or grouped_takes(x)]
        outputs = [
            (
                x,
                torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
                torch.empty(scale_shape(tuple(x.shape)), device=x.device),
            )
            for x in probes
        ]
        if kind == "single":
            for x, q, s in outputs:
                quantize_single(x, q, s)
        else:
            launch_grouped(grouped_launch(outputs))
        matches = all(_same_bits(q, s, x) for x, q, s in outputs)
    except Exception as err:  # a compiler or driver that cannot build it: the torch path still works
        logger.warning("the Triton FP8 %s kernel failed to run (%s): not used", kind, root_cause(err))
        return False
    if not matches:
        logger.warning("the Triton FP8 %s kernel does not match the reference bits on this device: not used", kind)
    return matches


def _probe_tensors() -> list[torch.Tensor]:
    """bf16 CUDA tensors with exact e4m3 rounding ties (at scale 1 and at scale 3), an all-zero
    block, a block of tiny values, blocks whose largest quotient is one ulp above 448, partial
    edge blocks, column-narrowed views (row stride larger than the width): one aligned, one not;
    and a tensor the grouped launch cuts into two chunks."""
    gen = torch.Generator().manual_seed(0)
    tie = (torch.randn(300, 272, generator=gen) * 0.05).to(torch.bfloat16)
    tie[:128, :128] = 0
    tie[128, 128] = 448.0  # scale 1: exact ties of e4m3 rounding below
    tie[129, 129:140] = torch.tensor([168.0, -168.0, 0.5625, 17.0, 9.5, -9.5, 208.0, 0.0, 3.0, 1e-3, -448.0])
    # blocks whose amax / scale_inv is one ulp above 448 (scale_inv = amax / 448 rounded down):
    # the kernel relies on the conversion's saturation where the format clamps
    tie[256:, :16] = torch.tensor([1.0234375, -1.078125, 1.1328125, 1.7734375]).repeat(4)
    tie[256:, 128:144] = -1.9375
    wide = (torch.randn(129, 528, generator=gen) * 3).to(torch.bfloat16)
    # scale 3 (its reciprocal is inexact) with exact e4m3 ties, and a block of values so small
    # (scale < 2^-90) that the kernel rescales it by 2^100
    odd = (torch.randn(256, 256, generator=gen) * 0.05).to(torch.bfloat16)
    odd[0, :12] = 3 * torch.tensor(
        [448.0, 168.0, -168.0, 0.5625, 17.0, 9.5, -9.5, 208.0, 13.0, 26.0, 416.0, 0.02734375]
    )
    odd[128:, 128:] = (torch.randn(128, 128, generator=gen) * 1e-27).to(torch.bfloat16)
    tall = (torch.randn(129 * 128 + 5, 32, generator=gen) * 2).to(
        torch.bfloat16
    )  # 2 chunks of 128 blocks, the last partial
    return [tie.cuda(), wide.cuda(), wide.cuda()[:, 16:400], wide.cuda()[:, 7:400], odd.cuda(), tall.cuda()]


def _same_bits(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> bool:
    ref_q, ref_s = quantize_reference(x, out=torch.empty_like(q), scale_out=torch.empty_like(scale))
    return torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)


def root_cause(err: BaseException) -> str:
    """The innermost error of a chain (Triton wraps the real compile error in outer ones that
    only point at the call site)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"
