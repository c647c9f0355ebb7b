"""Run under TRITON_INTERPRET=1 on CPU (tests/test_bounded_kernels.py): ``sinks.bounded_kernels``' copy and
checksum, on fewer programs than blocks (each program walks several), must give what torch gives: the copy
the source's bytes and nothing beside the destination, the checksum ``broadcast_wire.checksum_into``'s
value (word sums that wrap past 2**63, trailing bytes) for lengths of whole blocks, a partial last block,
fewer words than one block per program, and through ``BoundedKernels`` with its partial sums reused
from one checksum to the next. Exit 0 when everything matches; prints the mismatches otherwise."""

import os

import torch

from mbridge_refit.sinks.bounded_kernels import BLOCK_WORDS, MIN_BYTES, BoundedKernels
from mbridge_refit.sinks.broadcast_wire import checksum_into

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"


def _scalars_index_as_ints() -> None:
    """Triton's interpreter holds a scalar as a one-element array and makes a loop bound of it with ``int()``,
    which NumPy 2.5 refuses for arrays that are not 0-d: read the element instead (the interpreter only)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


_scalars_index_as_ints()

generator = torch.Generator().manual_seed(0)
cpu = torch.device("cpu")
problems = []
for programs in (1, 3, 7):
    kernels = BoundedKernels(cpu, programs, enabled=True)
    for words in (MIN_BYTES // 8, MIN_BYTES // 8 + BLOCK_WORDS // 2 + 5, 3 * BLOCK_WORDS * programs + 17):
        source = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64, generator=generator).view(torch.uint8)
        room = torch.full((source.numel() + 64,), 0xAB, dtype=torch.uint8)
        destination = room[32 : 32 + source.numel()]  # 16-byte aligned inside a larger buffer
        kernels.copy(destination, source)
        if not torch.equal(destination, source):
            problems.append(f"copy, {programs} programs, {words} words: bytes differ")
        if not (torch.all(room[:32] == 0xAB) and torch.all(room[-32:] == 0xAB)):
            problems.append(f"copy, {programs} programs, {words} words: wrote beside the destination")
        for tail in (0, 5):
            data = torch.cat([source, torch.arange(tail, dtype=torch.uint8) + 200])
            ours, expected = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
            kernels.checksum_into(data, ours)
            checksum_into(data, expected)
            if int(ours) != int(expected):
                problems.append(
                    f"checksum, {programs} programs, {words} words + {tail}: {int(ours)} != {int(expected)}"
                )
    small = torch.arange(64, dtype=torch.uint8)  # below MIN_BYTES: torch's kernels, same results
    copied = torch.zeros_like(small)
    kernels.copy(copied, small)
    if not torch.equal(copied, small):
        problems.append("a copy below MIN_BYTES differs")

print("\n".join(problems) if problems else "bounded kernels match torch")
raise SystemExit(1 if problems else 0)
