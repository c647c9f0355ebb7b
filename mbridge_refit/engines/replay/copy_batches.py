"""Recorded copies replayed as few kernels: groups of independent copies, each group one
``engines.replay.copy_kernels`` launch for its plain byte copies and one ``torch._foreach_copy_`` for the rest.

A replay of recorded copies (``engines.replay.apply_plan``) issued one ``copy_`` per copy: for an engine
that stacks its experts that is thousands of kernel launches a step, each a few microseconds of
host work for a few hundred kilobytes (the Qwen3-30B-A3B shape cut to 4 layers: 1575 tensors in
11.2 ms of replay against 2.95 ms for one memcpy of their bytes, H200). ``CopySchedule`` groups
consecutive copies into lists one ``torch._foreach_copy_`` applies (a multi-tensor kernel per
dtype pair on CUDA; a loop in C++ where its fast path does not apply, still without Python per
copy). On CUDA, where Triton is there and its probe passed, a group's byte copies
(``copy_kernels.byte_segments``: one dtype, contiguous segments, 16-byte aligned) are one launch
of ``copy_kernels.ChunkedCopies`` instead, its chunk table built here once: no per-copy host work
at all, and a kernel that streams bytes.

A group is exact only if its copies are independent, since a multi-tensor kernel runs them in any
order: no two write overlapping bytes, none reads bytes another writes. ``CopySchedule.add``
closes the open group before a copy that would break that (byte spans per storage, conservative
for strided views: first to last byte), and ``barrier`` closes it before work that must see every
earlier copy (an engine loader call). Built once when a plan is opened; running it costs one call
per group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CopySchedule", "byte_span"]


def byte_span(tensor: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, first byte, end byte) a view may touch: from its first element to its last
    (for a strided view, a superset of the bytes it holds)."""
    itemsize = tensor.element_size()
    first = tensor.storage_offset() * itemsize
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()) if size > 0)
    return tensor.untyped_storage().data_ptr(), first, first + (last + 1) * itemsize


def _group_calls(
    destinations: list[torch.Tensor], sources: list[torch.Tensor], chunked: bool
) -> list[Callable[[], object]]:
    """One group of independent copies as calls: its byte copies as one chunked-copy launch
    where ``chunked`` and the kernel runs on their device, the others (or all) as one ``_foreach_copy_``."""
    kernels = _copy_kernels(destinations[0].device) if chunked else None
    calls: list[Callable[[], object]] = []
    if kernels is not None:
        segments = [kernels.byte_segments(d, s) for d, s in zip(destinations, sources)]
        if any(found is not None for found in segments):
            taken = [i for i, found in enumerate(segments) if found is not None]
            calls.append(
                kernels.ChunkedCopies(
                    [segment for i in taken for segment in segments[i]],
                    [t for i in taken for t in (destinations[i], sources[i])],
                )
            )
            destinations = [d for d, found in zip(destinations, segments) if found is None]
            sources = [s for s, found in zip(sources, segments) if found is None]
    if destinations:
        calls.append(lambda d=destinations, s=sources: torch._foreach_copy_(d, s))
    return calls


def _copy_kernels(device: torch.device):
    """``engines.replay.copy_kernels`` where it runs on ``device`` (CUDA, Triton there, its probe passed), else None."""
    if device.type != "cuda":
        return None
    try:
        from mbridge_refit.engines.replay import copy_kernels
    except ImportError:  # no Triton: the foreach path
        return None
    return copy_kernels if copy_kernels.usable(device.index) else None


def _overlaps(spans: list[tuple[int, int]], span: tuple[int, int]) -> bool:
    return any(start < span[1] and span[0] < end for start, end in spans)


@dataclass
class CopySchedule:
    """The replay as a list of calls: groups of independent copies, and the barriers between them."""

    calls: list[Callable[[], object]] = field(default_factory=list)
    copies: int = 0
    chunked: bool = True  # plain byte copies as one ``copy_kernels`` launch where it runs (False: all foreach)
    _open: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=dict)
    _written: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # storage -> spans the group writes
    _read: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # storage -> spans the group reads

    def add(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """``destination.copy_(source)``, after every copy added before it."""
        if not destination.numel():
            return
        into, *write = byte_span(destination)
        out_of, *read = byte_span(source)
        if (
            _overlaps(self._written.get(into, []), write)
            or _overlaps(self._read.get(into, []), write)
            or _overlaps(self._written.get(out_of, []), read)
        ):
            self.barrier()
        key = (destination.dtype, source.dtype, destination.device, source.device)
        destinations, sources = self._open.setdefault(key, ([], []))
        destinations.append(destination)
        sources.append(source)
        self._written.setdefault(into, []).append(tuple(write))
        self._read.setdefault(out_of, []).append(tuple(read))
        self.copies += 1

    def barrier(self) -> None:
        """Close the open group: what is added or called later runs after all of it."""
        for destinations, sources in self._open.values():
            self.calls.extend(_group_calls(destinations, sources, self.chunked))
        self._open, self._written, self._read = {}, {}, {}

    def call(self, function: Callable[[], object]) -> None:
        """Run ``function`` after every copy added before it (and before every later one)."""
        self.barrier()
        self.calls.append(function)

    def run(self) -> None:
        """Apply the schedule (close it first: ``barrier``). No synchronization: the copies run on
        the current stream, in order with the caller's work."""
        for function in self.calls:
            function()
