"""CUDA kernels of the blockwise FP8 quantizer (the format and its reference path: ``fp8``).

Imported lazily by ``fp8`` (an ImportError where Triton is missing means the torch path runs).
Owns the Triton code, the check that it reproduces the reference bits on this device, and the
launches. One block body, two launch shapes:

* ``quantize_single``: one tensor, grid (block rows, block columns);
* grouped (``grouped_launch`` / ``launch_grouped``): many tensors of one dtype in one launch,
  grid (blocks of the largest tensor, tensors); each tensor is described by a row of an int64
  table (``DESCRIPTOR_FIELDS`` columns: x, q and scale pointers; rows, cols; x and q row
  strides; block columns) and the programs past a smaller tensor's last block return at once.
  Pointers (bytes), columns and row strides (elements) must be multiples of ``ALIGNMENT``.

Each program loads one 128x128 block once, takes its amax, and stores the e4m3fn block and its
fp32 ``scale_inv``, with the rounding ``fp8``'s docstring specifies (IEEE-exact quotients, clamp,
round-to-nearest-even). The per-element quotient is computed with one reciprocal per block and two
FMAs (correctly rounded, see ``_quantize_block``), not a division per element.

A kernel is used only after it reproduced the torch path's bits on probe tensors (``usable``:
once per process, on the current CUDA device, with rounding ties at scale 1 and at scale 3, an
all-zero block, a block of tiny values, partial and strided blocks).
"""

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mbridge_refit import fp8

logger = logging.getLogger(__name__)

DESCRIPTOR_FIELDS = 9
# Blocks whose scale_inv is at least 2^-90 (amax >= 448 * 2^-90, ~3.6e-25) divide by reciprocal
# and two FMAs; smaller ones by IEEE division. For such a scale, any quotient >= 2^-11 has an
# exactly representable residual (granularity >= 2^-147), and smaller quotients round to 0 in e4m3
# whatever their last bits.
MIN_FAST_SCALE = tl.constexpr(2.0**-90)
ALIGNMENT = 16  # the grouped kernel needs x and q pointers, cols and row strides divisible by this


@triton.jit
def _quotient(x, scale):
    """``clamp(x / scale, -448, 448)`` with the IEEE quotient, for an fp32 tile ``x``."""
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
    return tl.minimum(tl.maximum(y, -448.0), 448.0)


@triton.jit
def _scale_of(amax):
    scale = tl.math.div_rn(amax, 448.0)
    return tl.where(scale == 0.0, 1.0, scale)


@triton.jit
def _quantize_block(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, block_row, block_col,
                    BLOCK_SIZE: tl.constexpr, SUB_ROWS: tl.constexpr):
    """Quantize block (block_row, block_col): read once and held in registers (SUB_ROWS ==
    BLOCK_SIZE), or in two passes of SUB_ROWS rows (amax, then reread, mostly from L2, and
    quantize). The amax is taken in the source dtype (abs and max are exact there), so only the
    source tile is live across the reduction."""
    c = block_col * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    if SUB_ROWS == BLOCK_SIZE:
        r = block_row * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[:, None]
        mask = (r < rows) & (c < cols)
        x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)
        scale = _scale_of(tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32))
        y = _quotient(x.to(tl.float32), scale)
        tl.store(q_ptr + r * stride_q + c, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    else:
        r = block_row * BLOCK_SIZE + tl.arange(0, SUB_ROWS)[:, None]
        x = tl.load(x_ptr + r * stride_x + c, mask=(r < rows) & (c < cols), other=0.0)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32)
        for i in tl.range(SUB_ROWS, BLOCK_SIZE, SUB_ROWS):
            r = block_row * BLOCK_SIZE + i + tl.arange(0, SUB_ROWS)[:, None]
            x = tl.load(x_ptr + r * stride_x + c, mask=(r < rows) & (c < cols), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.max(tl.abs(x), axis=1), axis=0).to(tl.float32))
        scale = _scale_of(amax)
        for i in tl.range(0, BLOCK_SIZE, SUB_ROWS):
            r = block_row * BLOCK_SIZE + i + tl.arange(0, SUB_ROWS)[:, None]
            mask = (r < rows) & (c < cols)
            x = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0)
            y = _quotient(x.to(tl.float32), scale)
            tl.store(q_ptr + r * stride_q + c, y.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(s_ptr + block_row * n_block_cols + block_col, scale)


@triton.jit
def _single_kernel(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols,
                   BLOCK_SIZE: tl.constexpr, SUB_ROWS: tl.constexpr):
    _quantize_block(x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, n_block_cols, tl.program_id(0), tl.program_id(1),
                    BLOCK_SIZE, SUB_ROWS)


@triton.jit
def _described_block(d, block, X_DTYPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, SUB_ROWS: tl.constexpr):
    """Quantize ``block`` (row-major block order) of the tensor described at ``d``."""
    n_block_cols = tl.load(d + 7)
    # Alignment hints (the caller guarantees them: ALIGNMENT): without them the compiler
    # cannot vectorize loads and stores through pointers read from memory.
    _quantize_block(
        tl.multiple_of(tl.load(d).to(tl.pointer_type(X_DTYPE)), 16),
        tl.multiple_of(tl.load(d + 1).to(tl.pointer_type(tl.float8e4nv)), 16),
        tl.load(d + 2).to(tl.pointer_type(tl.float32)),
        tl.load(d + 3), tl.multiple_of(tl.load(d + 4), 16), tl.multiple_of(tl.load(d + 5), 16), tl.multiple_of(tl.load(d + 6), 16),
        n_block_cols, block // n_block_cols, block % n_block_cols, BLOCK_SIZE, SUB_ROWS,
    )


@triton.jit
def _grouped_2d_kernel(desc_ptr, X_DTYPE: tl.constexpr, FIELDS: tl.constexpr, BLOCK_SIZE: tl.constexpr, SUB_ROWS: tl.constexpr):
    """Grid (blocks of the largest tensor, tensors): programs past a tensor's last block return."""
    block = tl.program_id(0)
    d = desc_ptr + tl.program_id(1) * FIELDS
    if block < tl.cdiv(tl.load(d + 3), BLOCK_SIZE) * tl.load(d + 7):
        _described_block(d, block, X_DTYPE, BLOCK_SIZE, SUB_ROWS)


@triton.jit
def _grouped_flat_kernel(desc_ptr, count, total_blocks, X_DTYPE: tl.constexpr, FIELDS: tl.constexpr,
                         MAX_TENSORS: tl.constexpr, PERSISTENT: tl.constexpr, BLOCK_SIZE: tl.constexpr, SUB_ROWS: tl.constexpr):
    """One program per block of the launch (the blocks of all tensors, numbered tensor by tensor;
    column 8 of the table is a tensor's first block number), or with ``PERSISTENT`` a fixed grid
    whose programs step through the blocks."""
    if PERSISTENT:
        for pid in tl.range(tl.program_id(0), total_blocks, tl.num_programs(0)):
            _flat_block(desc_ptr, count, pid, X_DTYPE, FIELDS, MAX_TENSORS, BLOCK_SIZE, SUB_ROWS)
    else:
        _flat_block(desc_ptr, count, tl.program_id(0), X_DTYPE, FIELDS, MAX_TENSORS, BLOCK_SIZE, SUB_ROWS)


@triton.jit
def _flat_block(desc_ptr, count, pid, X_DTYPE: tl.constexpr, FIELDS: tl.constexpr, MAX_TENSORS: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, SUB_ROWS: tl.constexpr):
    index = tl.arange(0, MAX_TENSORS)
    exists = index < count
    starts = tl.load(desc_ptr + index * FIELDS + 8, mask=exists, other=0)
    tensor = tl.sum((exists & (starts <= pid)).to(tl.int32), axis=0) - 1
    d = desc_ptr + tensor * FIELDS
    _described_block(d, pid - tl.load(d + 8), X_DTYPE, BLOCK_SIZE, SUB_ROWS)


_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# --- launches -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    """How the kernel is launched (all variants write the same bits).

    ``grid``: "2d" (blocks x described tensors: each tensor is cut into chunks of whole block
    rows of about ``chunk_blocks`` blocks, so that few programs of the rectangular grid fall
    past a chunk's end; None: whole tensors), "1d" (one program per block of the launch, found
    by a search of the table) or "persistent" (``programs_per_sm`` programs per SM stepping
    through the blocks); ``sub_rows``: rows read per pass (``fp8.BLOCK``: each block is read once
    and held in registers; fewer: two passes); warps per program.
    """

    grid: str = "2d"
    chunk_blocks: int | None = 128
    sub_rows: int = 128
    num_warps: int = 4
    programs_per_sm: int = 4

    @property
    def label(self) -> str:
        grid = {"2d": f"2d, chunks of {self.chunk_blocks} blocks" if self.chunk_blocks else "2d, whole tensors",
                "persistent": f"persistent x{self.programs_per_sm}"}.get(self.grid, self.grid)
        passes = "one pass" if self.sub_rows >= fp8.BLOCK else f"two passes of {self.sub_rows} rows"
        return f"{grid}, {passes}, {self.num_warps} warps"


# The fastest on H200 of the candidates below for the Qwen3-8B shape (scripts/bench_fp8_kernels.py).
DEFAULT_VARIANT = Variant()


def candidate_variants() -> list[Variant]:
    """The variants ``scripts/bench_fp8_kernels.py`` times."""
    variants = [Variant(chunk_blocks=chunk) for chunk in (None, 64, 128, 256, 512, 1024)]
    variants += [Variant(chunk_blocks=128, num_warps=8), Variant(chunk_blocks=128, sub_rows=64, num_warps=2)]
    variants += [Variant(grid="1d"), Variant(grid="persistent")]
    return variants


def quantize_single(x: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, variant: Variant = DEFAULT_VARIANT) -> None:
    """Quantize one 2-D CUDA tensor into ``out`` / ``scale_out`` (``fp8.quantize_blockwise``'s contract)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    block_rows, block_cols = scale_out.shape
    _single_kernel[(block_rows, block_cols)](
        x, out, scale_out, rows, cols, x.stride(0), out.stride(0), block_cols,
        BLOCK_SIZE=fp8.BLOCK, SUB_ROWS=min(variant.sub_rows, fp8.BLOCK), num_warps=variant.num_warps,
    )


def grouped_takes(x: torch.Tensor) -> bool:
    """Whether the grouped kernel reads ``x`` in place: a CUDA 2-D tensor of a float dtype it
    knows, rows contiguous, pointer, width and row stride aligned to ``ALIGNMENT``."""
    return (
        x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and x.dtype in _TRITON_DTYPES
        and not (x.data_ptr() % ALIGNMENT or x.stride(0) % ALIGNMENT or x.shape[1] % ALIGNMENT)
    )


@dataclass(frozen=True, slots=True)
class GroupedLaunch:
    """One grouped launch, ready to repeat: the descriptor table (on the device) and the grid.
    Valid while the tensors it was built from keep their storage."""

    table: torch.Tensor
    count: int
    total_blocks: int
    max_blocks: int
    dtype: torch.dtype
    variant: Variant


def grouped_launch(jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], variant: Variant = DEFAULT_VARIANT) -> GroupedLaunch:
    """The launch for ``(source, q, scale)`` triples of one dtype and device that ``grouped_takes``
    (builds the descriptor table: one host-to-device copy)."""
    rows, first_block = [], 0
    for x, q, s in jobs:
        for row in _chunks(x, q, s, variant.chunk_blocks if variant.grid == "2d" else None):
            rows.append((*row, first_block))
            first_block += -(-row[3] // fp8.BLOCK) * row[7]
    table = torch.tensor(rows, dtype=torch.int64, device=jobs[0][0].device)
    max_blocks = max(-(-row[3] // fp8.BLOCK) * row[7] for row in rows)
    return GroupedLaunch(table=table, count=len(rows), total_blocks=first_block, max_blocks=max_blocks,
                         dtype=jobs[0][0].dtype, variant=variant)


def _chunks(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, chunk_blocks: int | None) -> list[tuple[int, ...]]:
    """Descriptor rows (without the first-block column) for runs of whole block rows of one
    tensor, about ``chunk_blocks`` blocks each (None: the whole tensor in one row)."""
    rows, cols = x.shape
    block_rows, block_cols = s.shape
    step = block_rows if chunk_blocks is None else max(1, chunk_blocks // block_cols)
    return [
        (x.data_ptr() + start * fp8.BLOCK * x.stride(0) * x.element_size(), q.data_ptr() + start * fp8.BLOCK * q.stride(0),
         s.data_ptr() + start * block_cols * s.element_size(), min(rows - start * fp8.BLOCK, step * fp8.BLOCK), cols,
         x.stride(0), q.stride(0), block_cols)
        for start in range(0, block_rows, step)
    ]


def launch_grouped(launch: GroupedLaunch) -> None:
    variant = launch.variant
    common = dict(X_DTYPE=_TRITON_DTYPES[launch.dtype], FIELDS=DESCRIPTOR_FIELDS, BLOCK_SIZE=fp8.BLOCK,
                  SUB_ROWS=min(variant.sub_rows, fp8.BLOCK), num_warps=variant.num_warps)
    if variant.grid == "2d":
        _grouped_2d_kernel[(launch.max_blocks, launch.count)](launch.table, **common)
        return
    persistent = variant.grid == "persistent"
    grid = min(launch.total_blocks, _sm_count(launch.table.device) * variant.programs_per_sm) if persistent else launch.total_blocks
    _grouped_flat_kernel[(grid,)](
        launch.table, launch.count, launch.total_blocks, MAX_TENSORS=triton.next_power_of_2(launch.count),
        PERSISTENT=persistent, **common,
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# --- the check before use -----------------------------------------------------------------------


@functools.cache
def usable(kind: str) -> bool:
    """Whether the ``"single"`` or ``"grouped"`` kernel reproduces the torch path's bits on the
    probe tensors on this device (checked once per process; a failure is logged with its cause)."""
    try:
        probes = [x for x in _probe_tensors() if kind == "single" or grouped_takes(x)]
        outputs = [(x, torch.empty(x.shape, dtype=fp8.FP8_DTYPE, device=x.device),
                    torch.empty(fp8.scale_shape(tuple(x.shape)), device=x.device)) for x in probes]
        if kind == "single":
            for x, q, s in outputs:
                quantize_single(x, q, s)
        else:
            launch_grouped(grouped_launch(outputs))
        matches = all(_same_bits(q, s, x) for x, q, s in outputs)
    except Exception as err:  # a compiler or driver that cannot build it: the torch path still works
        logger.warning("the Triton FP8 %s kernel failed to run (%s): not used", kind, _root_cause(err))
        return False
    if not matches:
        logger.warning("the Triton FP8 %s kernel does not match the reference bits on this device: not used", kind)
    return matches


def _probe_tensors() -> list[torch.Tensor]:
    """bf16 CUDA tensors with exact e4m3 rounding ties (at scale 1 and at scale 3), an all-zero
    block, a block of tiny values, partial edge blocks, and column-narrowed views (row stride
    larger than the width): one aligned, one not."""
    gen = torch.Generator().manual_seed(0)
    tie = (torch.randn(300, 272, generator=gen) * 0.05).to(torch.bfloat16)
    tie[:128, :128] = 0
    tie[128, 128] = 448.0  # scale 1: exact ties of e4m3 rounding below
    tie[129, 129:140] = torch.tensor([168.0, -168.0, 0.5625, 17.0, 9.5, -9.5, 208.0, 0.0, 3.0, 1e-3, -448.0])
    wide = (torch.randn(129, 528, generator=gen) * 3).to(torch.bfloat16)
    # scale 3 (its reciprocal is inexact) with exact e4m3 ties, and a block of values so small
    # (scale < 2^-90) that the kernel takes its IEEE-division branch
    odd = (torch.randn(256, 256, generator=gen) * 0.05).to(torch.bfloat16)
    odd[0, :12] = 3 * torch.tensor([448.0, 168.0, -168.0, 0.5625, 17.0, 9.5, -9.5, 208.0, 13.0, 26.0, 416.0, 0.02734375])
    odd[128:, 128:] = (torch.randn(128, 128, generator=gen) * 1e-27).to(torch.bfloat16)
    return [tie.cuda(), wide.cuda(), wide.cuda()[:, 16:400], wide.cuda()[:, 7:400], odd.cuda()]


def _same_bits(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> bool:
    ref_q, ref_s = torch.empty_like(q), torch.empty_like(scale)
    fp8._quantize_torch(x, ref_q, ref_s, torch.empty(fp8.padded_shape(tuple(x.shape)), device=x.device))
    return torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_s)


def _root_cause(err: BaseException) -> str:
    """The innermost error of a chain (Triton wraps the real compile error in outer ones that
    only point at the call site)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"
