"""Where a packed broadcast's time goes, bucket by bucket: device marks read once per refit (benchmarks).

An end of the packed broadcast (``engines.broadcast.packed``) given a ``BucketTimeline`` marks, per
bucket, when each of its phases ended on the device, and when the host issued the bucket's
broadcast. Off unless asked (the ends take ``timeline=None``): a benchmark turns it on for a few
steps (``scripts/bench_refit_vllm_broadcast.py``).

Marks, per bucket ``b`` (``n`` buffers per end):

* source, on the stream that packs: ``free`` (buffer ``b % n`` free: the broadcast of bucket
  ``b - n`` ended), ``packed`` (its last tensor copied in; its broadcast is issued here),
  ``summed`` (its checksum); on a stream of its own that only waits for the broadcast: ``sent``.
* receiver, on the consumer's stream: ``landed`` (the stream may go on: bucket ``b`` arrived and
  the stream's earlier work is done), ``consumed`` (the consumer's work on it, e.g. the engine's
  replay, and the split tensors' copies); ``summed`` (its checksum: on CUDA on a stream beside the
  consumer's, ``ReceiveBuffers.side``); buffer ``b % n`` may be posted for bucket ``b + n`` once
  both are done; on a stream of its own: ``received`` (the broadcast ended).
* host, both ends: ``issued`` (the broadcast of ``b`` issued), and per refit ``handshake`` (its
  verdict in: on the source after bucket 0's copies are issued) and ``status`` (when they returned).

On CUDA a mark is an event recorded on the stream (no host wait); ``summary`` synchronizes the
device once, after the protocol ended. On CPU (gloo) device marks are the host's clock when the
host issued the work (CPU work runs as issued; gloo's collectives do not, so ``sent`` and
``received`` are absent there). ``summary`` returns every mark in milliseconds from ``start``
and the phases each end's marks bound (``source_phases`` / ``receiver_phases``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

__all__ = ["BucketTimeline", "receiver_phases", "source_phases"]


class BucketTimeline:
    """Marks of one end of one refit (module docstring). ``start`` first, ``summary`` once at the end."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._origin: Any = None
        self._host_origin = 0.0
        self._device: dict[str, dict[int, Any]] = {}
        self._host: dict[str, dict[int, float]] = {}
        if self.cuda and self.device.index is None:  # "cuda" is the current device: name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._watcher = _watcher(self.device) if self.cuda else None

    def start(self) -> None:
        """The origin of every mark: now, on the host and on the current stream."""
        self._host_origin = time.perf_counter()
        self._origin = self._now()
        self._device.clear()
        self._host.clear()

    def mark(self, phase: str, bucket: int) -> None:
        """``phase`` of ``bucket`` ends here on the current stream."""
        self._device.setdefault(phase, {})[bucket] = self._now()

    def completion(self, phase: str, bucket: int, work: Any) -> None:
        """``phase`` of ``bucket`` ends when the collective ``work`` does (CUDA only: a stream of the
        timeline's own waits for it and records; the caller's streams are not touched)."""
        if not self.cuda:
            return
        with torch.cuda.stream(self._watcher):
            work.wait()
            self._device.setdefault(phase, {})[bucket] = self._now()

    def host(self, phase: str, bucket: int = -1) -> None:
        """The host reached ``phase`` (of ``bucket``) now."""
        self._host.setdefault(phase, {})[bucket] = time.perf_counter()

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def summary(self) -> dict[str, Any]:
        """Every mark in ms from ``start``: ``{"device": {phase: [ms per bucket]}, "host": {...}}``
        (a bucket without the mark: None). Synchronizes the device once."""
        if self._origin is None:
            return {"device": {}, "host": {}}
        if self.cuda:
            torch.cuda.synchronize(self.device)
        device = {phase: _in_order(marks, self._elapsed) for phase, marks in self._device.items()}
        host = {
            phase: _in_order(marks, lambda t: round((t - self._host_origin) * 1e3, 3))
            for phase, marks in self._host.items()
        }
        return {"device": device, "host": host}

    def _elapsed(self, mark: Any) -> float:
        if self.cuda:
            return round(self._origin.elapsed_time(mark), 3)
        return round((mark - self._host_origin) * 1e3, 3)


@functools.cache
def _watcher(device: torch.device) -> torch.cuda.Stream:
    """The one stream per device the timelines wait on collectives with: made once, so timed refits do not
    walk torch's pool of streams until one is a stream of the refit's own (a receiver's ``side``)."""
    return torch.cuda.Stream(device=device)


def _in_order(marks: dict[int, Any], value) -> list[float | None] | float:
    """Per bucket 0..max, or the one value of a per-refit mark (bucket -1)."""
    if set(marks) == {-1}:
        return value(marks[-1])
    return [value(marks[b]) if b in marks else None for b in range(max(marks) + 1)]


def source_phases(marks: dict[str, Any]) -> dict[str, list[float]]:
    """The source's phases per bucket, in ms, from its ``summary``: ``pack`` (free to packed: the
    copies into the buffer, and the exporter's own kernels where they share its stream),
    ``checksum`` (packed to summed), ``buffer_wait`` (the packing stream waiting for a broadcast to
    free the buffer: summed of the bucket before to free; 0 for bucket 0, whose ``free`` mark says
    when the first tensor came: the export's start; its ``pack`` phase holds the wait for the handshake's
    verdict, taken once it is packed), and on CUDA ``broadcast`` (from when its broadcast could start, packed and the broadcast
    before it ended, to sent: the transfer and any wait for the receivers)."""
    device = marks["device"]
    free, packed, summed, sent = (device.get(k, []) for k in ("free", "packed", "summed", "sent"))
    phases = {
        "pack": _spans(free, packed),
        "checksum": _spans(packed, summed) if summed else [],
        "buffer_wait": _spans([*free[:1], *(summed or packed)[:-1]], free),  # bucket 0's buffer is free at once
    }
    if sent:
        phases["broadcast"] = _spans([_latest(p, s) for p, s in zip(packed, [0.0, *sent[:-1]])], sent)
    return phases


def receiver_phases(marks: dict[str, Any], buffers: int) -> dict[str, list[float]]:
    """A receiver's phases per bucket, in ms, from its ``summary``: ``checksum`` (landed to summed),
    ``consume`` (landed to consumed: the consumer's work and the split tensors' copies; on CUDA the
    checksum runs beside them, on a stream of its own, elsewhere before them), ``data_wait`` (the
    consumer's stream waiting for the bucket: the bucket before consumed and summed, to landed), and on CUDA
    ``broadcast`` (from when its broadcast could start, its buffer consumed and summed and the broadcast
    before it ended, to received)."""
    device = marks["device"]
    landed, summed, consumed, received = (device.get(k, []) for k in ("landed", "summed", "consumed", "received"))
    done = [_latest(c, s) for c, s in zip(consumed, summed)] if summed else consumed  # the buffer free again
    phases = {
        "checksum": _spans(landed, summed) if summed else [],
        "consume": _spans(landed, consumed),
        "data_wait": _spans([0.0, *done[:-1]], landed),
    }
    if received:
        ready = [done[b - buffers] if b >= buffers else 0.0 for b in range(len(received))]
        phases["broadcast"] = _spans([_latest(r, s) for r, s in zip(ready, [0.0, *received[:-1]])], received)
    return phases


def _latest(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a, b)


def _spans(begins: list, ends: list) -> list[float | None]:
    return [None if b is None or e is None else round(max(e - b, 0.0), 3) for b, e in zip(begins, ends)]
