"""A group of recorded byte copies as one CUDA kernel launch: ``ChunkedCopies``.

An engine's replay (``engines.replay.copy_batches``) copies the same sources into the same parameters
every step. ``torch._foreach_copy_`` issues them as multi-tensor kernels, but builds each launch's
tensor list on the host, launch by launch, every step, and its kernels are written for optimizer
arithmetic, not for streaming bytes. Where a copy moves bytes only (one dtype and
shape on both sides) in contiguous segments (``byte_segments``: a plain contiguous copy is one
segment; a strided view of equally spaced row runs, as the replay composes q, k and v from a fused
QKV parameter, is one segment per run), 16-byte aligned, its segments are cut once into chunks of
``CHUNK_BYTES`` and described by an int64 table on the device (source address, destination
address, 8-byte words in the chunk); each step is then one launch of ``_copy_chunks`` per group,
one program per chunk, whatever the number of copies. A whole chunk is copied without a mask, so
its loads and stores are 16-byte vectors; only a copy's last, shorter chunk is masked (8-byte
accesses: the mask's bound is a number read from the table). With 128 KiB chunks and 16 warps a
program the replay runs at 1.02-1.03x one memcpy of its bytes on an H200, against 1.06-1.07x with
every chunk masked at 64 KiB and 8 warps (``scripts/bench_copy_kernel_variants.py``).

It only moves bytes, so it writes what ``copy_`` writes bit for bit; it is used only after it
reproduced ``copy_`` on probe copies (a tail shorter than a chunk, several chunks, several copies)
on the device (``usable``: once per process and device). The table's addresses stay valid as long
as the tensors do: ``ChunkedCopies`` holds them. Imported lazily (Triton is optional): an
ImportError means the foreach path runs.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["ALIGN_BYTES", "CHUNK_BYTES", "MIN_SEGMENT_BYTES", "ChunkedCopies", "byte_segments", "chunk_rows", "usable"]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 16  # every copy's start and length: the kernel moves 8-byte words, 16-byte aligned loads
CHUNK_BYTES = 128 << 10  # one program's bytes
NUM_WARPS = 16  # a program's warps: 32 8-byte words a thread, as 16-byte vectors
WORD_BYTES = 8
MIN_SEGMENT_BYTES = 4096  # a copy cut into more segments than one only where each is at least this long

Segment = tuple[int, int, int]  # (source address, destination address, bytes)


@triton.jit
def _copy_chunks(table, CHUNK_WORDS: tl.constexpr):
    """Program k: ``table[k] = (source, destination, words)``; copies ``words`` 8-byte words (a
    whole chunk unmasked, for vector accesses; a shorter one masked)."""
    row = table + tl.program_id(0).to(tl.int64) * 3
    source = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int64)), 16)
    destination = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int64)), 16)
    words = tl.load(row + 2)
    offsets = tl.arange(0, CHUNK_WORDS)
    if words == CHUNK_WORDS:
        tl.store(destination + offsets, tl.load(source + offsets))
    else:
        mask = offsets < words
        tl.store(destination + offsets, tl.load(source + offsets, mask=mask), mask=mask)


def byte_segments(destination: torch.Tensor, source: torch.Tensor) -> list[Segment] | None:
    """``destination.copy_(source)`` as contiguous byte segments the kernel copies, or None where it
    is not one: other devices, dtypes or shapes (a conversion, a broadcast), anything but plain
    strided tensors (a tensor subclass, a conjugate or negative view: their bytes are not their
    values), a destination whose elements overlap, segments shorter than ``MIN_SEGMENT_BYTES`` (a
    transposing copy), or off ``ALIGN_BYTES``. One segment per leading index over the trailing
    dimensions both tensors hold contiguously (a whole contiguous copy: one)."""
    if source.device != destination.device or destination.dtype != source.dtype or destination.shape != source.shape:
        return None
    if not (_plain(destination) and _plain(source)):
        return None
    inner = _contiguous_tail(destination, source)
    outer = destination.shape[: destination.dim() - inner]
    itemsize = destination.element_size()
    block = math.prod(destination.shape[destination.dim() - inner :])
    length = block * itemsize
    if length % ALIGN_BYTES or (math.prod(outer) > 1 and length < MIN_SEGMENT_BYTES):
        return None
    if not _disjoint(outer, destination.stride()[: len(outer)], block):
        return None
    segments = []
    for index in itertools.product(*(range(n) for n in outer)):
        into = destination.data_ptr() + sum(i * s for i, s in zip(index, destination.stride())) * itemsize
        out_of = source.data_ptr() + sum(i * s for i, s in zip(index, source.stride())) * itemsize
        if into % ALIGN_BYTES or out_of % ALIGN_BYTES:
            return None
        segments.append((out_of, into, length))
    return segments


def _plain(tensor: torch.Tensor) -> bool:
    """A strided tensor whose bytes are its values, inside its own storage (not a wrapper subclass:
    those report no data pointer; a ``Parameter`` subclass such as an engine's is plain)."""
    if is_traceable_wrapper_subclass(tensor) or tensor.layout != torch.strided:
        return False
    if tensor.is_conj() or tensor.is_neg() or not tensor.data_ptr():
        return False
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if n > 0)
    end = (tensor.storage_offset() + last + 1) * tensor.element_size()
    return end <= tensor.untyped_storage().nbytes()


def _disjoint(outer: tuple[int, ...], strides: tuple[int, ...], block: int) -> bool:
    """Whether blocks of ``block`` elements at every outer index (``outer`` sizes, ``strides``) never
    share an element: the outer dimensions, by increasing stride, each step past all before them."""
    span = block
    for size, stride in sorted(((n, s) for n, s in zip(outer, strides) if n > 1), key=lambda d: d[1]):
        if stride < span:
            return False
        span = stride * (size - 1) + span
    return True


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
    and another reads or writes, as ``engines.replay.copy_batches`` groups them) copied in one launch.
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
        if (
            self.chunks
        ):  # the tensors' device's current stream (Triton launches on the current device; CPU: its interpreter)
            with torch.cuda.device(self.table.device) if self.table.is_cuda else contextlib.nullcontext():
                _copy_chunks[(self.chunks,)](self.table, CHUNK_WORDS=CHUNK_BYTES // WORD_BYTES, num_warps=NUM_WARPS)


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernel reproduces ``copy_``'s bytes on probe copies on this device (checked once
    per process and device; a failure is logged with its cause): a tail, chunks and a tail, whole
    chunks, addresses only 16-byte aligned, and row runs of a strided view on both sides."""
    try:
        device = torch.device("cuda", device_index)
        generator = torch.Generator().manual_seed(0)

        def bf16(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(torch.bfloat16).to(device)

        sources = [bf16(n) for n in (8, CHUNK_BYTES + 8, 3 * (CHUNK_BYTES // 2), 24)]
        sources.append(bf16(CHUNK_BYTES // 2 + 16)[8:])  # starts 16 bytes into its storage
        sources.append(bf16(4, 12, 1024)[:, :8])  # row runs, as q of each query group
        destinations = [torch.full_like(s, float("nan")) for s in sources[:-2]]
        destinations.append(
            torch.full((CHUNK_BYTES // 2 + 24,), float("nan"), dtype=torch.bfloat16, device=device)[16:]
        )
        destinations.append(torch.full((4, 10, 1024), float("nan"), dtype=torch.bfloat16, device=device)[:, 1:9])
        ChunkedCopies.of(destinations, sources)()
        if not all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(destinations, sources)):
            logger.warning("the Triton chunked-copy kernel does not reproduce copy_ on this device: not used")
            return False
    except Exception as err:  # a compiler or driver that cannot build it: the foreach path still works
        logger.warning("the Triton chunked-copy kernel failed to run (%s: %s): not used", type(err).__name__, err)
        return False
    return True
