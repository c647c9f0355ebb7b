"""Run under TRITON_INTERPRET=1 on CPU (tests/test_copy_batches.py): ``engines.replay.copy_kernels``'
chunked-copy kernel, one launch over many copies, must write exactly what ``copy_`` writes: copies
shorter than a chunk, longer (a tail), exactly whole chunks, views into one stacked destination
(the gate and up rows of each expert, as an engine's fused MoE parameter takes them), strided views
of equally spaced row runs on both sides (q, k and v of each query group, as the replay composes
them from a fused QKV parameter), two dtypes;
the bytes around every destination stay as they were. Exit 0 when everything matches; prints the
mismatches otherwise."""

import os
import sys

import torch

from mbridge_refit.engines.replay import copy_kernels

# Triton reads TRITON_INTERPRET as the kernels are decorated, at import; the caller sets it.
assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

generator = torch.Generator().manual_seed(0)
chunk_elements = copy_kernels.CHUNK_BYTES // 2  # bf16
experts, rows, cols = 3, 24, 40
stacked = torch.full((experts, 2 * rows, cols), float("nan"), dtype=torch.bfloat16)
pairs = []
for e in range(experts):
    for half in range(2):
        pairs.append(
            (
                stacked[e, half * rows : (half + 1) * rows],
                torch.randn(rows, cols, generator=generator).to(torch.bfloat16),
            )
        )
for numel in (8, chunk_elements, 2 * chunk_elements + 24, 5000):
    pairs.append(
        (
            torch.full((numel,), float("nan"), dtype=torch.bfloat16),
            torch.randn(numel, generator=generator).to(torch.bfloat16),
        )
    )
wide = torch.randn(3, chunk_elements // 2 + 4, generator=generator)  # fp32
pairs.append((torch.full_like(wide, float("nan")), wide))

# q of 4 query groups: rows [g*12, g*12+8) of an interleaved [48, 256] source into rows [g*8, g*8+8) of [32, 256]
interleaved = torch.randn(48, 256, generator=generator).to(torch.bfloat16)
qkv = torch.full((32, 256), float("nan"), dtype=torch.bfloat16)
pairs.append((qkv.view(4, 8, 256), interleaved.view(4, 12, 256)[:, :8]))

guard = torch.full((64,), 7.0, dtype=torch.bfloat16)  # a destination inside a larger buffer: its neighbours untouched
inner = guard[8:40]
pairs.append((inner, torch.randn(32, generator=generator).to(torch.bfloat16)))

problems = [
    f"pair {i} is not 16-byte aligned" for i, (d, s) in enumerate(pairs) if d.data_ptr() % 16 or s.data_ptr() % 16
]
copies = copy_kernels.ChunkedCopies.of([d for d, _ in pairs], [s for _, s in pairs])
for _ in range(2):  # the same launch twice: the table is reused
    copies()
for index, (destination, source) in enumerate(pairs):
    if not torch.equal(destination.view(torch.uint8), source.contiguous().view(torch.uint8)):
        problems.append(f"pair {index} {tuple(source.shape)} {source.dtype}: bytes differ")
if not (torch.all(guard[:8] == 7.0) and torch.all(guard[40:] == 7.0)):
    problems.append("bytes beside a destination were written")
if problems:
    print("\n".join(problems))
    sys.exit(1)
print(f"chunked copies == copy_ ({len(pairs)} copies, {copies.chunks} chunks)")
