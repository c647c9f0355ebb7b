"""Run under TRITON_INTERPRET=1 on CPU (tests/test_bounded_kernels.py): ``sinks.bounded_kernels``' copy and
checksum, through ``BoundedKernels`` (each case checked to reach the kernels), must give what torch gives: the
copy the source's bytes and nothing beside the destination, the checksum ``broadcast_wire.checksum_into``'s
value (word sums that wrap past 2**63, trailing bytes) for lengths of whole blocks, a partial last block,
several blocks per program, fewer blocks than programs, checksums in two slots. Exit 0 when everything matches; prints the mismatches otherwise."""

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
for programs in (1, 3, 7, 64):
    kernels = BoundedKernels(cpu, programs, slots=2, enabled=True)
    # whole blocks; a partial last block; several blocks per program; fewer blocks than programs (64: 33 blocks)
    sizes = (MIN_BYTES // 8, MIN_BYTES // 8 + BLOCK_WORDS // 2 + 5, MIN_BYTES // 8 + 3 * BLOCK_WORDS * programs + 17)
    for words in sizes if programs < 64 else (MIN_BYTES // 8 + 5,):
        source = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64, generator=generator).view(torch.uint8)
        room = torch.full((source.numel() + 64,), 0xAB, dtype=torch.uint8)
        destination = room[32 : 32 + source.numel()]  # 16-byte aligned inside a larger buffer
        if not kernels._qualifies(destination, source):
            problems.append(f"{words} words: the kernels would not run (torch's copy would be compared with itself)")
        kernels.copy(destination, source)
        if not torch.equal(destination, source):
            problems.append(f"copy, {programs} programs, {words} words: bytes differ")
        if not (torch.all(room[:32] == 0xAB) and torch.all(room[-32:] == 0xAB)):
            problems.append(f"copy, {programs} programs, {words} words: wrote beside the destination")
        for slot, tail in enumerate((0, 5)):
            data = torch.cat([source, torch.arange(tail, dtype=torch.uint8) + 200])
            ours, expected = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
            kernels.checksum_into(data, ours, slot)
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
