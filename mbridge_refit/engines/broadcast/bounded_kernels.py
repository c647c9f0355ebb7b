"""The packed broadcast's own device work on a bounded number of GPU programs: ``BoundedKernels``.

Beside a broadcast, the source packs the next bucket and both ends checksum theirs. ``copy_`` and
``torch.sum`` launch as many programs as the GPU runs and take all of its memory bandwidth while
they run, the bandwidth NCCL reads and writes the bucket with. Measured on 2x H200
(``scripts/bench_broadcast_contention.py``, 16.4 GB in 512 MiB buckets; results in
benchmarks/results/2026-11-26-h200x2-d/): one broadcast 44.5 ms, the buckets alone 45.1 ms; with
both ends' copies beside them 54.0 ms (the source's alone 54.0, the receiver's alone 46.1: the
copies' time added to the broadcast's, as if they ran one after the other), and with the checksums
54.4 ms. The same copies and checksums by kernels of 64 programs, each walking its share of the
bytes: 47.1 ms. Alone they run slower than torch's (copies 10.4 against 7.9 ms, checksums 20.0
against 3.9 ms for the 16.4 GB) but well ahead of the broadcast (0.34 and 0.65 ms a bucket against
its 1.45 ms); copies on 128 programs take the bandwidth again (54.3 ms), checksums on 128 cost
3 ms (50.0 ms).

``BoundedKernels(device, programs)`` does those things: ``copy(destination, source)`` (flat
uint8 tensors of one length) and ``checksum_into(data, out)`` (the value of
``broadcast_wire.checksum_into``: the sum of the 8-byte words modulo 2**64, its trailing bytes
added one by one; integer sums in any order give the same value, so an end using torch's kernels
agrees with one using these). The source need not read a bucket twice: ``copy_summing`` copies
and adds the words it moved to a slot's partial sums in the same launch (alone as fast as the
copy: 13.5 against 13.4 ms for 16.4 GB on an H100), ``sum_ranges`` adds the words of listed
ranges (what no copy took), ``summed_into`` totals them (``broadcast_buffers.SendBuffers``). On
2x H100 the 512 MiB broadcasts beside the source's work took 48.5 ms with its checksum summed so,
49.95 with it read apart and 50.44 with none: the gain is the work's order, not its bytes
(benchmarks/results/2026-11-28-h100x2/). Bytes that do not qualify (not on CUDA, not 16-byte aligned, fewer
than ``MIN_BYTES``, a length that is not whole words or past what int32 indices reach) and devices where Triton is absent, fails to
build or did not reproduce torch's results on probe data (``usable``, once per process and device)
go through torch's kernels, as does everything with ``programs=0``. The kernels only move and add
bytes, so their results are torch's bit for bit; the probe checks that on each device before use.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

__all__ = ["DEFAULT_PROGRAMS", "MIN_BYTES", "BoundedKernels", "usable"]

logger = logging.getLogger(__name__)

DEFAULT_PROGRAMS = 64  # measured above (32: the checksum falls behind the broadcast; 128: the copies contend again)
MIN_BYTES = 1 << 20  # below, a copy's bandwidth is too short to matter and torch's launch is cheaper
BLOCK_WORDS = 4096  # 8-byte words one program moves per iteration
WORD_BYTES = 8
ALIGN_BYTES = 16
MAX_PROGRAMS = 1024
INDEX_LIMIT = 2**31  # the kernels index words in int32: words + programs * BLOCK_WORDS must stay below it


@functools.cache
def _kernels():
    """The Triton kernels, compiled lazily (ImportError where Triton is absent)."""
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(source, destination, words, programs, BLOCK: tl.constexpr):
        """Program p of ``programs`` copies the blocks p, p + programs, ... of ``words`` 8-byte words."""
        program = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        for turn in range(0, tl.cdiv(words, programs * BLOCK)):
            index = (turn * programs + program) * BLOCK + offsets
            mask = index < words
            tl.store(destination + index, tl.load(source + index, mask=mask), mask=mask)

    @triton.jit
    def sum_words(source, partials, words, programs, BLOCK: tl.constexpr):
        """Program p of ``programs`` writes the wrapping sum of its blocks' words into ``partials[p]``."""
        program = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.int64)
        for turn in range(0, tl.cdiv(words, programs * BLOCK)):
            index = (turn * programs + program) * BLOCK + offsets
            total += tl.load(source + index, mask=index < words, other=0)
        tl.store(partials + program, tl.sum(total, axis=0))

    @triton.jit
    def copy_sum_words(source, destination, partials, words, programs, BLOCK: tl.constexpr):
        """``copy_words`` that also adds the wrapping sum of the words it moved to ``partials[p]``."""
        program = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.int64)
        for turn in range(0, tl.cdiv(words, programs * BLOCK)):
            index = (turn * programs + program) * BLOCK + offsets
            mask = index < words
            values = tl.load(source + index, mask=mask, other=0)
            tl.store(destination + index, values, mask=mask)
            total += values
        tl.store(partials + program, tl.load(partials + program) + tl.sum(total, axis=0))

    @triton.jit
    def sum_ranges(source, ranges, count, partials, programs, BLOCK: tl.constexpr):
        """Program p adds the wrapping sum of the words of ranges p, p + programs, ... (``ranges``: int64
        pairs, first word and words) to ``partials[p]``."""
        program = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], dtype=tl.int64)
        for turn in range(0, tl.cdiv(count - program, programs)):
            entry = turn * programs + program
            first = tl.load(ranges + 2 * entry)
            words = tl.load(ranges + 2 * entry + 1)
            for block in range(0, tl.cdiv(words, BLOCK)):
                index = block * BLOCK + offsets
                total += tl.load(source + first + index, mask=index < words, other=0)
        tl.store(partials + program, tl.load(partials + program) + tl.sum(total, axis=0))

    return copy_words, sum_words, copy_sum_words, sum_ranges


class BoundedKernels:
    """Copies and checksums of one device on at most ``programs`` GPU programs (module docstring);
    torch's kernels where they do not apply. Holds an int64[slots, programs] scratch for the checksums'
    partial sums, a row per checksum slot (a bucket), so checksums of different slots never share one,
    on whatever streams they run."""

    def __init__(self, device: torch.device, programs: int, *, slots: int = 1, enabled: bool | None = None) -> None:
        """``slots``: the checksum slots (``checksum_into``'s ``slot``: 0 .. slots - 1). ``enabled``: None decides
        by the device and the probe; True forces the kernels (tests run them on CPU in Triton's interpreter)."""
        if not 0 <= programs <= MAX_PROGRAMS:
            raise ValueError(f"programs must be 0 .. {MAX_PROGRAMS}, got {programs}")
        if device.type == "cuda" and device.index is None:  # "cuda" is the current device: name it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.programs = programs
        on = programs > 0 and (enabled if enabled is not None else device.type == "cuda" and usable(device.index))
        self.enabled = on
        self._partials = torch.zeros(max(slots, 1), programs, dtype=torch.int64, device=device) if on else None

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination.copy_(source)`` for flat uint8 tensors of one length, queued on the current stream."""
        if not (self.enabled and source.numel() >= MIN_BYTES and self._qualifies(destination, source)):
            destination.copy_(source)  # the test above in line: this runs per tensor on the source's host
            return
        words = source.numel() // WORD_BYTES
        grid = self._grid(words)
        with self._on_device():
            _kernels()[0][grid](
                source.view(torch.int64), destination.view(torch.int64), words, grid[0], BLOCK=BLOCK_WORDS
            )

    def start_sum(self, slot: int) -> None:
        """Zero ``slot``'s partial sums before the ``copy_summing`` calls that add to them (current stream)."""
        if self._partials is not None:
            self._partials[slot].zero_()

    def copy_summing(self, destination: torch.Tensor, source: torch.Tensor, slot: int) -> bool:
        """``copy(destination, source)``; where the kernels apply (``fusable`` bytes, both ends flat and
        aligned on this device), the same launch also adds the
        word sum of the bytes moved to ``slot``'s partial sums (``summed_into`` reads them). False where
        torch's copy ran instead: those bytes are in no sum."""
        if not self._qualifies(destination, source):
            destination.copy_(source)
            return False
        words = source.numel() // WORD_BYTES
        grid = self._grid(words)
        with self._on_device():
            _kernels()[2][grid](
                source.view(torch.int64),
                destination.view(torch.int64),
                self._partials[slot],
                words,
                grid[0],
                BLOCK=BLOCK_WORDS,
            )
        return True

    def sum_ranges(self, data: torch.Tensor, ranges: torch.Tensor, slot: int) -> None:
        """Add the wrapping sum of ``data``'s 8-byte words in ``ranges`` (int64[k, 2]: first word, words; on
        ``data``'s device) to ``slot``'s partial sums, on the current stream. ``data``: flat uint8, 16-byte
        aligned, whole words, on this device; only where ``enabled``."""
        if not (self.enabled and ranges.numel() and _flat_aligned(data, data.numel(), self.device)):
            raise ValueError("sum_ranges needs the kernels enabled, ranges and flat, aligned bytes on their device")
        grid = (max(1, min(self.programs, ranges.shape[0])),)
        with self._on_device():
            _kernels()[3][grid](
                data.view(torch.int64), ranges, ranges.shape[0], self._partials[slot], grid[0], BLOCK=BLOCK_WORDS
            )

    def fusable(self, nbytes: int) -> bool:
        """Whether ``copy_summing`` of ``nbytes`` bytes sums as it copies where both ends are flat and aligned."""
        return (
            self.enabled
            and nbytes >= MIN_BYTES
            and not nbytes % WORD_BYTES
            and nbytes // WORD_BYTES + self.programs * BLOCK_WORDS < INDEX_LIMIT
        )

    def summed_into(self, slot: int, out: torch.Tensor) -> None:
        """``out`` = the wrapping sum of every word ``copy_summing`` and ``sum_ranges`` added to ``slot``
        since ``start_sum``."""
        torch.sum(self._partials[slot], dim=0, out=out)

    def checksum_into(self, data: torch.Tensor, out: torch.Tensor, slot: int = 0) -> None:
        """``broadcast_wire.checksum_into(data, out)``'s value, queued on the current stream; ``slot``: this
        checksum's row of partial sums (one per bucket)."""
        words = data.numel() // WORD_BYTES
        if not self._qualifies(data[: words * WORD_BYTES]):
            torch.sum(data[: words * WORD_BYTES].view(torch.int64), dim=0, out=out)
        else:
            grid = self._grid(words)
            with self._on_device():
                _kernels()[1][grid](
                    data[: words * WORD_BYTES].view(torch.int64),
                    self._partials[slot],
                    words,
                    grid[0],
                    BLOCK=BLOCK_WORDS,
                )
            torch.sum(self._partials[slot, : grid[0]], dim=0, out=out)
        if words * WORD_BYTES < data.numel():
            out.add_(data[words * WORD_BYTES :].sum(dtype=torch.int64))

    def _qualifies(self, *tensors: torch.Tensor) -> bool:
        nbytes = tensors[0].numel()
        return self.fusable(nbytes) and all(_flat_aligned(t, nbytes, self.device) for t in tensors)

    def _grid(self, words: int) -> tuple[int]:
        return (max(1, min(self.programs, -(-words // BLOCK_WORDS))),)

    def _on_device(self):
        """Triton launches on the current device: the tensors' where that is another."""
        if self.device.type != "cuda" or torch.cuda.current_device() == self.device.index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)


def _flat_aligned(tensor: torch.Tensor, nbytes: int, device: torch.device) -> bool:
    return (
        tensor.device == device
        and tensor.dtype == torch.uint8
        and tensor.numel() == nbytes
        and tensor.is_contiguous()
        and not tensor.data_ptr() % ALIGN_BYTES
    )


@functools.cache
def usable(device_index: int) -> bool:
    """Whether the kernels reproduce torch's copy and word sum on probe data on this device (once per
    process and device; a failure is logged with its cause and torch's kernels are used instead)."""
    try:
        device = torch.device("cuda", device_index)
        generator = torch.Generator().manual_seed(0)
        copy_words, sum_words, copy_sum_words, sum_ranges = _kernels()
        # several blocks per program with a partial last block (5 programs: the compiled variant of odd
        # arguments), and a bucket-like length with the default programs (arguments divisible by 16)
        for words, programs in ((3 * BLOCK_WORDS * 5 + 7, 5), (MIN_BYTES // WORD_BYTES * 3, DEFAULT_PROGRAMS)):
            source = torch.randint(-(2**62), 2**62, (words,), dtype=torch.int64, generator=generator).to(device)
            destination = torch.zeros_like(source)
            partials = torch.zeros(programs, dtype=torch.int64, device=device)
            with torch.cuda.device(device):
                copy_words[(programs,)](source, destination, words, programs, BLOCK=BLOCK_WORDS)
                sum_words[(programs,)](source, partials, words, programs, BLOCK=BLOCK_WORDS)
            fused, fused_partials = torch.zeros_like(source), torch.ones_like(partials)  # adds to what is there
            with torch.cuda.device(device):
                copy_sum_words[(programs,)](source, fused, fused_partials, words, programs, BLOCK=BLOCK_WORDS)
            ranges = torch.tensor([[3, BLOCK_WORDS + 9], [2 * BLOCK_WORDS, 1], [words - 5, 5]], device=device)
            ranged, one_range = torch.ones_like(partials), torch.ones_like(partials)  # adds to what is there
            with torch.cuda.device(device):
                sum_ranges[(2,)](source, ranges, 3, ranged, 2, BLOCK=BLOCK_WORDS)
                sum_ranges[(1,)](source, ranges[2:], 1, one_range, 1, BLOCK=BLOCK_WORDS)  # the common launch
            in_ranges = int(source[3 : BLOCK_WORDS + 12].sum() + source[2 * BLOCK_WORDS] + source[words - 5 :].sum())
            expected = int(source.sum())
            if (
                not torch.equal(destination, source)
                or int(partials.sum()) != expected
                or not torch.equal(fused, source)
                or int((fused_partials - 1).sum()) != expected
                or int((ranged - 1).sum()) != in_ranges
                or int((one_range - 1).sum()) != int(source[words - 5 :].sum())
            ):
                logger.warning("the bounded broadcast kernels do not reproduce torch's on this device: not used")
                return False
    except Exception as err:  # no Triton, a compiler or driver that cannot build them: torch's kernels
        logger.warning("the bounded broadcast kernels failed to run (%s: %s): not used", type(err).__name__, err)
        return False
    return True
