"""Writing a stacked expert tensor [E, ...] from E separate expert parameters, on every export.

A stacked tensor (``plan.stacking``: GPT-OSS's experts, a checkpoint's packed experts) is no
slice of one parameter, so the export writes all of it each time. ``fill_stack`` picks the
fastest way that gives the same bytes as ``ExpertStack.copy_into`` per expert
(``scripts/bench_stacked_experts.py`` times each; docs/benchmarks/history/2026-11-22-to-27-export-numbers.md has the numbers):

* a plain stack (no re-layout: transformers' packed layout): one ``torch.stack`` into the output,
  at the copy floor, where a copy per expert pays a launch per expert;
* a transposed stack (Qwen3-VL-MoE's published layout; GPT-OSS's, its gate/up rows interleaved
  too): one launch of ``stack_kernels``' tiled transpose where Triton is there and its probe
  passed (a copy per expert, a ``_foreach_copy_`` or a staged stack plus one transposing copy
  are several times slower: PyTorch does not tile transposes);
* anything else (1-D interleaved biases, CPU tensors, other strides): a copy per expert.
"""

from __future__ import annotations

from typing import Any

import torch

from mbridge_refit.plan.stacking import ExpertStack

__all__ = ["fill_stack"]


def fill_stack(stack: ExpertStack, out: torch.Tensor, experts: list[torch.Tensor], memo: dict[Any, Any]) -> None:
    """``out[e]`` := expert ``e`` laid out as ``stack`` says, for every expert. ``memo``: where a
    transposed stack keeps, per output layout and experts' addresses, the kernel's address table (or None
    where the kernel does not take them) between exports (``ExportBuffers.memo``: it lives as long
    as the buffers), so the checks run once, not on every export."""
    if stack.interleave == 1 and not stack.transpose and out.is_contiguous():
        torch.stack(experts, out=out)
        return
    if stack.transpose and out.is_cuda:
        key = (
            "expert_addresses",
            stack,
            out.dtype,
            tuple(out.shape),
            out.is_contiguous(),
            tuple(x.data_ptr() for x in experts),
        )
        if key not in memo:
            memo[key] = _kernel_address_table(stack, out, experts)
        table = memo[key]
        if table is not None:
            from mbridge_refit.runtime import stack_kernels

            stack_kernels.transpose_experts(out, table, tuple(experts[0].shape), stack.interleave)
            return
    for slot, expert in zip(out, experts):
        stack.copy_into(slot, expert)


def _kernel_address_table(stack: ExpertStack, out: torch.Tensor, experts: list[torch.Tensor]) -> torch.Tensor | None:
    """The experts' address table where the transposing kernel writes this stack on this device
    (Triton there, its probe passed, the tensors of the layout it takes); None otherwise."""
    try:
        from mbridge_refit.runtime import stack_kernels
    except ImportError:  # no Triton: the torch path
        return None
    takes = stack.interleave in stack_kernels.INTERLEAVES and stack_kernels.takes(out, experts)
    return stack_kernels.address_table(experts) if takes and stack_kernels.usable(out.device.index) else None
