"""A group of recorded byte copies as one CUDA kernel launch: ``ChunkedCopies``.

An engine's replay (``engines.copy_batches``) copies the same sources into the same parameters
every step. ``torch._foreach_copy_`` issues them as multi-tensor kernels, but builds each launch's
tensor list on the host, launch by launch, every step, and its kernels are written for optimizer
arithmetic, not for streaming bytes. Where a copy moves bytes only (one dtype and
shape on both sides) in contiguous segments (``byte_segments``: a plain contiguous copy is one
segment; a strided view of equally spaced row runs, as the replay composes q, k and v from a fused
QKV parameter, is one segment per run), 16-byte aligned, its segments are cut once into chunks of
``CHUNK_BYTES`` and described by an int64 table on the device (source address, destination
address, 8-byte words in the chunk); each step is then one launch of ``_copy_chunks`` per group,
one program per chunk, whatever the number of copies.

It only moves bytes, so it writes what ``copy_`` writes bit for bit; it is used only after it
reproduced ``copy_`` on probe copies (a tail shorter than a chunk, several chunks, several copies)
on the device (``usable``: once per process and device). The table's addresses stay valid as long
as the tensors do: ``ChunkedCopies`` holds them. Imported lazily (Triton is optional): an
ImportError means the foreach path runs.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math

import torch
import triton
import triton.language as tl

__all__ = ["ALIGN_BYTES", "CHUNK_BYTES", "MIN_SEGMENT_BYTES", "ChunkedCopies", "byte_segments", "chunk_rows", "usable"]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 16  # every copy's start and length: the kernel moves 8-byte words, 16-byte aligned loads
CHUNK_BYTES = 64 << 10  # one program's bytes
WORD_BYTES = 8
MIN_SEGMENT_BYTES = 4096  # a copy cut into more segments than one only where each is at least this long

Segment = tuple[int, int, int]  # (source address, destination address, bytes)


@triton.jit
def _copy_chunks(table, CHUNK_WORDS: tl.constexpr):
    """Program k: ``table[k] = (source, destination, words)``; copies ``words`` 8-byte words."""
    row = table + tl.program_id(0).to(tl.int64) * 3
    source = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int64)), 16)
    destination = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int64)), 16)
    words = tl.load(row + 2)
    offsets = tl.arange(0, CHUNK_WORDS)
    mask = offsets < words
    tl.store(destination + offsets, tl.load(source + offsets, mask=mask), mask=mask)


def byte_segments(destination: torch.Tensor, source: torch.Tensor) -> list[Segment] | None:
    """``destination.copy_(source)`` as contiguous byte segments the kernel copies, or None where it
    is not one: other devices, dtypes or shapes (a conversion, a broadcast), segments shorter than
    ``MIN_SEGMENT_BYTES`` (a transposing copy), or off ``ALIGN_BYTES``. One segment per leading index
    over the trailing dimensions both tensors hold contiguously (a whole contiguous copy: one)."""
    if source.device != destination.device or destination.dtype != source.dtype or destination.shape != source.shape:
        return None
    inner = _contiguous_tail(destination, source)
    outer = destination.shape[: destination.dim() - inner]
    itemsize = destination.element_size()
    length = math.prod(destination.shape[destination.dim() - inner :]) * itemsize
    if length % ALIGN_BYTES or (math.prod(outer) > 1 and length < MIN_SEGMENT_BYTES):
        return None
    segments = []
    for index in itertools.product(*(range(n) for n in outer)):
        into = destination.data_ptr() + sum(i * s for i, s in zip(index, destination.stride())) * itemsize
        out_of = source.data_ptr() + sum(i * s for i, s in zip(index, source.stride())) * itemsize
        if into % ALIGN_BYTES or out_of % ALIGN_BYTES:
            return None
        segments.append((out_of, into, length))
    return segments


def _contiguous_tail(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many trailing dimensions both tensors (of one shape) hold contiguously, as one block."""
    expected, count = 1, 0
    for size, stride_a, stride_b in reversed(list(zip(a.shape, a.stride(), b.stride()))):
        if size != 1 and not stride_a == stride_b == expected:
            break
        expected *= size
        count += 1
    return count


def chunk_rows(segments: list[Segment], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int, int]]:
    """``(source address, destination address, bytes)`` segments cut into ``(source, destination,
    words)`` chunks of at most ``chunk_bytes``, in order, covering each segment's bytes exactly once."""
    rows = []
    for source, destination, nbytes in segments:
        for start in range(0, nbytes, chunk_bytes):
            rows.append((source + start, destination + start, min(chunk_bytes, nbytes - start) // WORD_BYTES))
    return rows


class ChunkedCopies:
    """Byte segments (``byte_segments`` of independent copies: no overlap between what one writes
    and another reads or writes, as ``engines.copy_batches`` groups them) copied in one launch.
    ``tensors``: the copies' tensors, held so the table's addresses stay theirs."""

    def __init__(self, segments: list[Segment], tensors: list[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        rows = chunk_rows(segments)
        self.chunks = len(rows)
        self.nbytes = sum(nbytes for _, _, nbytes in segments)
        device = tensors[0].device if tensors else torch.device("cpu")
        self.table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 3)

    @classmethod
    def of(cls, destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> ChunkedCopies:
        """The copies ``destinations[i].copy_(sources[i])``, each of which must have ``byte_segments``."""
        segments = []
        for destination, source in zip(destinations, sources):
            found = byte_segments(destination, source)
            if found is None:
                raise ValueError(
                    f"not a byte copy the kernel makes: {tuple(source.shape)} {source.dtype} -> {destination.dtype}"
                )
            segments += found
        return cls(segments, [*destinations, *sources])

    def __call__(self) -> None:
        if self.chunks:
            _copy_chunks[(self.chunks,)](self.table, CHUNK_WORDS=CHUNK_BYTES // WORD_BYTES, num_warps=8)


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernel reproduces ``copy_``'s bytes on probe copies on this device (checked once
    per process and device; a failure is logged with its cause)."""
    try:
        device = torch.device("cuda", device_index)
        generator = torch.Generator().manual_seed(0)
        numels = (8, 4096 * 8 + 8, 3 * (CHUNK_BYTES // 2), 24)  # bf16: a tail, chunks and a tail, whole chunks
        sources = [torch.randn(n, generator=generator).to(torch.bfloat16).to(device) for n in numels]
        destinations = [torch.full_like(s, float("nan")) for s in sources]
        ChunkedCopies.of(destinations, sources)()
        if not all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(destinations, sources)):
            logger.warning("the Triton chunked-copy kernel does not reproduce copy_ on this device: not used")
            return False
    except Exception as err:  # a compiler or driver that cannot build it: the foreach path still works
        logger.warning("the Triton chunked-copy kernel failed to run (%s: %s): not used", type(err).__name__, err)
        return False
    return True
