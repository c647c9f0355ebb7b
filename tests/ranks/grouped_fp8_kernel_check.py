"""Run under TRITON_INTERPRET=1 on CPU (tests/test_fp8.py): the grouped FP8 kernel (many tensors,
one launch, descriptor table), in its default launch, with tensors cut into one-block-row
chunks and with whole tensors, must write exactly what the single-tensor kernel writes for each
tensor: partial edge blocks, an all-zero block, a block of tiny values (which the kernel rescales
by 2^100), a column-narrowed view (row stride > width), a
row slice at an offset, and two dtypes. Both kernels run in Triton's interpreter here, whose
float8 conversion is not the GPU's round-to-nearest-even, so the e4m3 bytes are compared
between the two kernels (the grouping logic) and the scales against the torch path as well.
Exit 0 when everything matches; prints the mismatches otherwise."""

import os
import sys

import torch

from mbridge_refit.fp8 import kernels as fp8_kernels
from mbridge_refit.fp8.format import FP8_DTYPE, scale_shape
from mbridge_refit.fp8.reference import quantize_reference

# The caller sets TRITON_INTERPRET before this process starts (Triton reads it as the kernels are
# decorated, at import); this only checks that it did.
assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"


def job(name: str, x: torch.Tensor) -> tuple:
    """(name, source, q buffer, scale buffer)."""
    return name, x, torch.empty(x.shape, dtype=FP8_DTYPE), torch.empty(scale_shape(tuple(x.shape)))


gen = torch.Generator().manual_seed(1)
base = (torch.randn(300, 528, generator=gen) * 2).to(torch.bfloat16)
base[:128, :128] = 0
base[128:256, 128:256] *= 1e-30  # scale_inv < 2^-90: rescaled by 2^100 in the kernel
jobs = [
    job("partial", base),
    job("narrowed", base[:, 16:400]),
    job("row_slice", base[130:259]),
    job("one_block", torch.randn(64, 128, generator=gen).to(torch.bfloat16)),
    job("fp32", torch.randn(200, 144, generator=gen)),
]
# the default launch, tensors cut into one-block-row chunks (base has 5 block columns), whole tensors
configs = [
    fp8_kernels.DEFAULT_CONFIG,
    fp8_kernels.LaunchConfig(chunk_blocks=1),
    fp8_kernels.LaunchConfig(chunk_blocks=None),
]
problems = []
for config in configs:
    for _, _, q, s in jobs:
        q.view(torch.uint8).fill_(0xFF)
        s.fill_(-1.0)
    for dtype in (torch.bfloat16, torch.float32):
        fp8_kernels.launch_grouped(
            fp8_kernels.grouped_launch([(x, q, s) for _, x, q, s in jobs if x.dtype == dtype], config)
        )
    for name, source, grouped_q, grouped_s in jobs:
        x = source.contiguous()
        q, s = torch.empty_like(grouped_q), torch.empty_like(grouped_s)
        fp8_kernels.quantize_single(x, q, s)
        ref_q, ref_s = torch.empty_like(q), torch.empty_like(s)
        quantize_reference(x, out=ref_q, scale_out=ref_s)
        if not torch.equal(q.view(torch.uint8), grouped_q.view(torch.uint8)):
            problems.append(f"{name} ({config.label}): grouped e4m3 bytes differ from the single-tensor kernel's")
        if not (torch.equal(s, grouped_s) and torch.equal(s, ref_s)):
            problems.append(f"{name} ({config.label}): scales differ (grouped, single, torch)")
print("\n".join(problems) or f"{len(jobs)} tensors, {len(configs)} launch configs: grouped == single kernel")
sys.exit(1 if problems else 0)
