"""A group of recorded byte copies as one CUDA kernel launch: ``ChunkedCopies``.

An engine's replay (``engines.copy_batches``) copies the same sources into the same parameters
every step. ``torch._foreach_copy_`` issues them as multi-tensor kernels, but builds each launch's
tensor list on the host, launch by launch, every step, and its kernels are written for optimizer
arithmetic, not for streaming bytes. Where every copy of a group is a plain byte copy (both
tensors contiguous, one dtype, 16-byte aligned start and length), the copies are cut once into
chunks of ``CHUNK_BYTES`` and described by an int64 table on the device (source address,
destination address, 8-byte words in the chunk); each step is then one launch of
``_copy_chunks``, one program per chunk, whatever the number of copies.

It only moves bytes, so it writes what ``copy_`` writes bit for bit; it is used only after it
reproduced ``copy_`` on probe copies (a tail shorter than a chunk, several chunks, several copies)
on the device (``usable``: once per process and device). The table's addresses stay valid as long
as the tensors do: ``ChunkedCopies`` holds them. Imported lazily (Triton is optional): an
ImportError means the foreach path runs.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

__all__ = ["ALIGN_BYTES", "CHUNK_BYTES", "ChunkedCopies", "chunk_rows", "takes", "usable"]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 16  # every copy's start and length: the kernel moves 8-byte words, 16-byte aligned loads
CHUNK_BYTES = 64 << 10  # one program's bytes
WORD_BYTES = 8


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


def takes(destination: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``destination.copy_(source)`` is a plain byte copy the kernel makes: both contiguous
    on one CUDA device, one dtype and shape, start and length on ``ALIGN_BYTES``."""
    nbytes = destination.numel() * destination.element_size()
    return (
        destination.is_cuda
        and source.device == destination.device
        and destination.dtype == source.dtype
        and destination.shape == source.shape
        and destination.is_contiguous()
        and source.is_contiguous()
        and nbytes % ALIGN_BYTES == 0
        and destination.data_ptr() % ALIGN_BYTES == 0
        and source.data_ptr() % ALIGN_BYTES == 0
    )


def chunk_rows(copies: list[tuple[int, int, int]], chunk_bytes: int = CHUNK_BYTES) -> list[tuple[int, int, int]]:
    """``(source address, destination address, bytes)`` copies cut into ``(source, destination,
    words)`` chunks of at most ``chunk_bytes``, in order, covering each copy's bytes exactly once."""
    rows = []
    for source, destination, nbytes in copies:
        for start in range(0, nbytes, chunk_bytes):
            rows.append((source + start, destination + start, min(chunk_bytes, nbytes - start) // WORD_BYTES))
    return rows


class ChunkedCopies:
    """``destinations[i].copy_(sources[i])`` for every i as one launch (every pair must pass
    ``takes``; the copies must be independent: no overlap between what one writes and another
    reads or writes, as ``engines.copy_batches`` groups them). Holds the tensors, so the table's
    addresses stay theirs."""

    def __init__(self, destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        self.tensors = list(destinations) + list(sources)  # kept alive: the table points into them
        copies = [(s.data_ptr(), d.data_ptr(), d.numel() * d.element_size()) for d, s in zip(destinations, sources)]
        rows = chunk_rows(copies)
        self.chunks = len(rows)
        self.nbytes = sum(nbytes for _, _, nbytes in copies)
        device = destinations[0].device if destinations else torch.device("cpu")
        self.table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 3)

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
        ChunkedCopies(destinations, sources)()
        if not all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(destinations, sources)):
            logger.warning("the Triton chunked-copy kernel does not reproduce copy_ on this device: not used")
            return False
    except Exception as err:  # a compiler or driver that cannot build it: the foreach path still works
        logger.warning("the Triton chunked-copy kernel failed to run (%s: %s): not used", type(err).__name__, err)
        return False
    return True
