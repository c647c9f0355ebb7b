"""Run under TRITON_INTERPRET=1 on CPU (tests/test_bounded_kernels.py): ``engines.broadcast.bounded_kernels``' copy and
checksum, through ``BoundedKernels`` (each case checked to reach the kernels), must give what torch gives: the
copy the source's bytes and nothing beside the destination, the checksum ``broadcast_wire.checksum_into``'s
value (word sums that wrap past 2**63, trailing bytes) for lengths of whole blocks, a partial last block,
several blocks per program, fewer blocks than programs, checksums in two slots; the fused copy
(``copy_summing``) the copy's bytes and, over two pieces into one slot, the checksum of both; the source's
buffers (``SendBuffers``) packing two refits of a plan whose buckets its copies sum, with pieces too short
for them and a last bucket ending inside a word, and a source they cannot take. Exit 0 when everything matches; prints the mismatches otherwise."""

import functools
import os

import torch

from mbridge_refit.engines.broadcast import buffers as broadcast_buffers
from mbridge_refit.engines.broadcast.bounded_kernels import BLOCK_WORDS, MIN_BYTES, BoundedKernels
from mbridge_refit.engines.broadcast.buffers import SendBuffers
from mbridge_refit.engines.broadcast.wire import PackedBroadcastConfig, checksum_into
from mbridge_refit.testing.plans import replicated_plan

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
        # the fused copy: two pieces of one bucket summed into one slot, after a sum left there before
        second = -(-source.numel() // 16) * 16  # the second piece 16-byte aligned, zero bytes between
        bucket = torch.zeros(second + source.numel(), dtype=torch.uint8)
        kernels.checksum_into(source, torch.zeros((), dtype=torch.int64), 1)  # leaves partials in slot 1
        kernels.start_sum(1)
        for start, piece in ((0, source), (second, source.flip(0))):
            if not kernels.copy_summing(bucket[start : start + piece.numel()], piece, 1):
                problems.append(f"copy_summing, {programs} programs, {words} words: the kernels did not run")
        fused, expected = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        kernels.summed_into(1, fused)
        checksum_into(bucket, expected)
        if not (torch.equal(bucket[: source.numel()], source) and torch.equal(bucket[second:], source.flip(0))):
            problems.append(f"copy_summing, {programs} programs, {words} words: bytes differ")
        if int(fused) != int(expected):
            problems.append(f"copy_summing, {programs} programs, {words} words: {int(fused)} != {int(expected)}")
    small = torch.arange(64, dtype=torch.uint8)  # below MIN_BYTES: torch's kernels, same results
    copied = torch.zeros_like(small)
    kernels.copy(copied, small)
    if not torch.equal(copied, small):
        problems.append("a copy below MIN_BYTES differs")
    if kernels.copy_summing(copied, small, 0) or not torch.equal(copied, small):
        problems.append("a copy_summing below MIN_BYTES claims a sum, or differs")


def _pack_all(memory: SendBuffers, sources: list[torch.Tensor], label: str, unsummed: set[int] = frozenset()) -> None:
    """The source's order (``PackedBroadcastSender``): each bucket started, its pieces packed, its checksum;
    each bucket checked before the next one in its buffer is packed: its bytes against the sources', its
    checksum against ``checksum_into`` of them, and summed by its copies unless in ``unsummed``."""
    stream = torch.zeros(memory.packing.stream_bytes, dtype=torch.uint8)  # the sources, packed by hand
    for slot, source in zip(memory.packing.slots, sources):
        stream[slot.offset : slot.end] = source
    for bucket in range(memory.packing.num_buckets):
        memory.start_bucket(bucket)
        for pieces, source in zip(memory.pieces, sources):
            for piece_bucket, target, start, length in pieces:
                if piece_bucket == bucket:
                    memory.pack(bucket, target, source[start : start + length])
        memory.checksum(bucket)
        data, expected = memory.data[bucket], torch.zeros((), dtype=torch.int64)
        checksum_into(data, expected)
        if int(memory.sums[bucket]) != int(expected):
            problems.append(f"{label}, bucket {bucket}: summed {int(memory.sums[bucket])} != {int(expected)}")
        if memory.summed_by_copies(bucket) == (bucket in unsummed):
            problems.append(f"{label}, bucket {bucket}: summed by its copies: {memory.summed_by_copies(bucket)}")
        first = bucket * memory.config.bucket_bytes
        for slot in memory.packing.slots:  # each tensor's bytes in this bucket (the padding: whatever was there)
            start, stop = max(slot.offset, first), min(slot.end, first + len(data))
            if start < stop and not torch.equal(data[start - first : stop - first], stream[start:stop]):
                problems.append(f"{label}, bucket {bucket}: {slot.entry.hf_name} packed wrong")


# The source's buffers sum a bucket with its copies (SendBuffers.pack / checksum): pieces the summing copy
# takes (whole buckets, a tensor, the first piece of one split across buckets, a bf16 tensor), pieces too
# short or not whole words for it (6 bytes, the split tensor's second piece, 1 MiB + 3), a whole word of
# padding in a buffer an earlier bucket filled, the last bucket ending 5 bytes into a word; oracle:
# broadcast_wire.checksum_into over the bucket's packed bytes.
MiB = 1 << 20
plan = replicated_plan(
    ("filled", (6 * MiB,), "int8"),  # buckets 0 and 1: the two buffers hold its bytes when bucket 2 is packed
    ("a", (MiB,), "int8"),
    ("b", (3,), "bfloat16"),
    ("c", (600_000,), "float32"),
    ("d", (MiB + 3,), "int8"),
    ("e", (MiB // 2,), "bfloat16"),
    ("f", (5,), "int8"),
)
original = broadcast_buffers.BoundedKernels
broadcast_buffers.BoundedKernels = functools.partial(original, enabled=True)  # the kernels, interpreted
memory = SendBuffers(plan, PackedBroadcastConfig(bucket_bytes=3 * MiB), cpu)
memory.allocate()
broadcast_buffers.BoundedKernels = original
slots = memory.packing.slots
padding_words = [  # whole words of padding between two tensors, in a reused buffer
    t.offset // 8 - -(-s.end // 8) for s, t in zip(slots, slots[1:]) if s.offset >= 2 * memory.config.bucket_bytes
]
if memory.packing.num_buckets != 4 or memory.packing.bucket_length(3) % 8 != 5 or max(padding_words) < 1:
    problems.append(f"the plan does not give the cases meant: {memory.packing}, {padding_words}")
if any(rest is None for rest in memory.rest):
    problems.append(f"a bucket's copies do not sum it: {memory.rest} (the full checksum would be tested)")
for refit in range(2):  # the second with other bytes in the same buffers
    sources = [torch.randint(0, 256, (slot.nbytes,), dtype=torch.uint8, generator=generator) for slot in slots]
    _pack_all(memory, sources, f"refit {refit}")
# a source the summing copy cannot take (not 16-byte aligned): torch copies it and the bucket is read instead
unaligned = torch.empty(slots[1].nbytes + 8, dtype=torch.uint8)[8:]
unaligned.copy_(torch.randint(0, 256, (unaligned.numel(),), dtype=torch.uint8, generator=generator))
_pack_all(memory, [sources[0], unaligned, *sources[2:]], "an unaligned source", unsummed={2})

print("\n".join(problems) if problems else "bounded kernels match torch")
raise SystemExit(1 if problems else 0)
