"""CUDA kernels that write a transposed stack of experts in one launch: ``out[e] = experts[e].T``,
its columns optionally interleaved in pairs (GPT-OSS's gate/up rows).

Imported lazily by ``runtime.stack_fill`` (an ImportError where Triton is missing means the
torch path runs). A stacked expert tensor in a checkpoint's transposed layout (Qwen3-VL-MoE's
published ``gate_up_proj`` [E, hidden, 2*ffn]: ``plan.stacking``) is written from E separate
expert parameters on every export. PyTorch's copy into a transposed view does not tile the
transpose: it runs at a fraction of a plain copy's bandwidth, whether issued per expert, as one
``_foreach_copy_`` or as one copy of a staged stack (``scripts/bench_stacked_experts.py``;
docs/benchmarks/history/2026-11-22-to-27-export-numbers.md). This kernel moves one tile of one expert per program:
a coalesced load of a ``BLOCK`` x ``BLOCK`` tile of the expert, transposed in registers
(``tl.trans``), a coalesced store into the output; the experts' addresses come from an int64
table (they are separate tensors). Interleaved in pairs (``ExpertStack(interleave=2)``:
parameter row ``b*(n/2) + i`` lands in output column ``2*i + b``), a program loads the tile of
gate rows and the tile of up rows beside it and stores them joined (``tl.join``), so the store
stays contiguous (a tile stored at a column stride of 2 is slower than a copy per expert).

It only moves bytes, so its output is the torch path's bit for bit; it is used only after it
reproduced the torch path on probe shapes (partial tiles in both dimensions, one expert, several,
interleaved in pairs) on this device (``usable``: once per process).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from mbridge_refit.plan.stacking import ExpertStack

__all__ = ["BLOCK", "INTERLEAVES", "address_table", "takes", "transpose_experts", "usable"]

logger = logging.getLogger(__name__)

BLOCK = 64


@triton.jit
def _transpose_experts(table, out_ptr, rows, cols, BLOCK_SIZE: tl.constexpr):
    """Program (tile row, tile column, expert e): rows [r, r+B) x columns [c, c+B) of expert e
    ([rows, cols], contiguous, at address ``table[e]``) into out[e] ([cols, rows], contiguous)."""
    expert = tl.program_id(2).to(tl.int64)
    source = tl.load(table + expert).to(tl.pointer_type(out_ptr.dtype.element_ty))
    r = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    c = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(source + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask)
    target = out_ptr + expert * rows * cols
    tl.store(target + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(tile), mask=tl.trans(mask))


@triton.jit
def _transpose_expert_pairs(table, out_ptr, rows, cols, BLOCK_SIZE: tl.constexpr):
    """Program (tile row, tile column, expert e): gate rows [i, i+B) and up rows [h+i, h+i+B)
    (h = rows / 2) x columns [c, c+B) of expert e into out[e] columns [2i, 2i+2B), gate and up
    alternating: out[e][c, 2*i + b] = expert[b*h + i, c]."""
    expert = tl.program_id(2).to(tl.int64)
    source = tl.load(table + expert).to(tl.pointer_type(out_ptr.dtype.element_ty))
    half = rows // 2
    i = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    c = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = (i[:, None] < half) & (c[None, :] < cols)
    offsets = i[:, None].to(tl.int64) * cols + c[None, :]
    gate = tl.load(source + offsets, mask=mask)
    up = tl.load(source + offsets + half.to(tl.int64) * cols, mask=mask)
    pairs = tl.reshape(tl.permute(tl.join(gate, up), (1, 0, 2)), (BLOCK_SIZE, 2 * BLOCK_SIZE))  # [c, 2i + b]
    column = tl.program_id(0) * 2 * BLOCK_SIZE + tl.arange(0, 2 * BLOCK_SIZE)
    target = out_ptr + expert * rows * cols
    store_mask = (c[:, None] < cols) & (column[None, :] < rows)
    tl.store(target + c[:, None].to(tl.int64) * rows + column[None, :], pairs, mask=store_mask)


def takes(out: torch.Tensor, experts: list[torch.Tensor]) -> bool:
    """Whether the kernel can write ``out`` [E, cols, rows] from ``experts`` (E tensors [rows, cols]):
    all on one CUDA device, contiguous, of one dtype and shape."""
    first = experts[0]
    return (
        out.is_cuda
        and out.is_contiguous()
        and first.dim() == 2
        and out.shape == (len(experts), first.shape[1], first.shape[0])
        and all(
            x.is_cuda
            and x.is_contiguous()
            and x.dtype == out.dtype
            and x.shape == first.shape
            and x.device == out.device
            for x in experts
        )
    )


def address_table(experts: list[torch.Tensor]) -> torch.Tensor:
    """The experts' addresses as the int64 device table the kernel reads (build once, reuse while
    the experts' storage is the same)."""
    return torch.tensor([x.data_ptr() for x in experts], dtype=torch.int64, device=experts[0].device)


INTERLEAVES = (1, 2)  # the ``ExpertStack.interleave`` values a kernel here writes


def transpose_experts(
    out: torch.Tensor, table: torch.Tensor, expert_shape: tuple[int, int], interleave: int = 1
) -> None:
    """``out[e] = expert_e.T`` for every expert of ``table`` (``address_table``), its columns
    interleaved in pairs with ``interleave=2`` (the rows must be even), one launch."""
    rows, cols = expert_shape
    if interleave not in INTERLEAVES or rows % interleave:
        raise ValueError(f"no kernel interleaves {rows} rows in {interleave} blocks (kernels: {INTERLEAVES})")
    grid = (triton.cdiv(rows // interleave, BLOCK), triton.cdiv(cols, BLOCK), table.numel())
    kernel = _transpose_experts if interleave == 1 else _transpose_expert_pairs
    kernel[grid](table, out, rows, cols, BLOCK_SIZE=BLOCK)


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernel reproduces the torch path's bytes on probe shapes on this device
    (checked once per process and device; a failure is logged with its cause)."""
    try:
        device = torch.device("cuda", device_index)
        generator = torch.Generator().manual_seed(0)
        for experts_count, shape, interleave in (
            (3, (130, 70), 1),
            (1, (64, 64), 1),
            (5, (1, 200), 1),
            (2, (257, 3), 1),
            (3, (130, 70), 2),
            (2, (256, 40), 2),
            (1, (2, 5), 2),
        ):
            experts = [
                torch.randn(shape, generator=generator).to(torch.bfloat16).to(device) for _ in range(experts_count)
            ]
            out = torch.full((experts_count, shape[1], shape[0]), float("nan"), dtype=torch.bfloat16, device=device)
            transpose_experts(out, address_table(experts), shape, interleave)
            expected = torch.empty_like(out)
            for slot, expert in zip(expected, experts):
                ExpertStack(interleave=interleave, transpose=True).copy_into(slot, expert)
            if not torch.equal(out.view(torch.int16), expected.view(torch.int16)):
                logger.warning(
                    "the Triton expert-transpose kernel does not match torch's copy on this device: not used"
                )
                return False
    except Exception as err:  # a compiler or driver that cannot build it: the torch path still works
        logger.warning("the Triton expert-transpose kernel failed to run (%s: %s): not used", type(err).__name__, err)
        return False
    return True
