"""Writing a stacked expert tensor [E, ...] from E separate expert parameters, on every export.

A stacked tensor (``plan.stacking``: GPT-OSS's experts, a checkpoint's packed experts) is no
slice of one parameter, so the export writes all of it each time. ``fill_stack`` picks the
fastest way that gives the same bytes as ``ExpertStack.copy_into`` per expert, measured on an
H100 for 128 experts of Qwen3-VL-30B-A3B's sizes (``scripts/bench_stacked_experts.py``, 768 MiB):

* a plain stack (no re-layout: transformers' packed layout): one ``torch.stack`` into the output,
  at the copy floor (0.57-0.59 ms; 1.9-4.7 ms for a copy per expert, over four calls);
* a transposed stack (Qwen3-VL-MoE's published layout; GPT-OSS's, its gate/up rows interleaved
  too): one launch of ``stack_kernels``' tiled transpose where Triton is there and its probe
  passed, 0.76-0.84 ms (a copy per expert, a ``_foreach_copy_`` or a staged stack plus one
  transposing copy all take 3.5 ms: PyTorch does not tile transposes);
* anything else (1-D interleaved biases, CPU tensors, other strides): a copy per expert.
"""

from __future__ import annotations

from typing import Any

import torch

from mbridge_refit.plan.stacking import ExpertStack


def fill_stack(stack: ExpertStack, out: torch.Tensor, experts: list[torch.Tensor], memo: dict[Any, Any]) -> None:
    """``out[e]`` := expert ``e`` laid out as ``stack`` says, for every expert. ``memo``: where the
    transposing kernel keeps the experts' address table between exports (``ExportBuffers.memo``:
    it lives as long as the buffers)."""
    if stack.interleave == 1 and not stack.transpose and out.is_contiguous():
        torch.stack(experts, out=out)
        return
    if stack.transpose and _transposes_on_device(stack, out, experts):
        from mbridge_refit.runtime import stack_kernels

        key = ("expert_addresses", tuple(x.data_ptr() for x in experts))
        table = memo.get(key)
        if table is None:
            table = memo[key] = stack_kernels.address_table(experts)
        stack_kernels.transpose_experts(out, table, tuple(experts[0].shape), stack.interleave)
        return
    for slot, expert in zip(out, experts):
        stack.copy_into(slot, expert)


def _transposes_on_device(stack: ExpertStack, out: torch.Tensor, experts: list[torch.Tensor]) -> bool:
    if not out.is_cuda:
        return False
    try:
        from mbridge_refit.runtime import stack_kernels
    except ImportError:  # no Triton: the torch path
        return False
    return stack.interleave in stack_kernels.INTERLEAVES and stack_kernels.takes(out, experts) and stack_kernels.usable(out.device.index)
