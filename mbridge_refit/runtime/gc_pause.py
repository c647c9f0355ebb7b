"""Python's garbage collector held off over a short stretch of host work the device waits on: ``GcPause``.

CPython collects generation 0 at whichever allocation of a container object crosses its threshold,
whoever made the garbage: a trainer's step, an engine client's RPCs and their replies. A collection
that falls due during a refit's host work before the engine's copies start (the export's look at its
parameters, the apply RPC) delays the copies by its whole length. In one run of
``scripts/bench_refit_vllm.py`` (the 24-layer Qwen3-30B-A3B shape in FP8, 2× H200) the steps set off 7
generation-0 and 0.6 generation-1 collections each, 0.86 ms a step; in the next lease hardly any, so
the gain depends on the garbage a trainer's own steps leave. Paused over that stretch, a collection
that falls due runs at the first allocation after ``resume``, while the host waits for the copies.
Nothing is skipped or freed later than one stretch.

Who calls it: the thread that runs the stretch, around it (``with GcPause():``, and ``resume()`` where the
stretch ends early); the collector is process-wide, so other threads' allocations are not collected
meanwhile either, and a ``gc.disable()`` another thread makes meanwhile is undone by the resume (the
collector keeps no count of who disabled it). Where the collector is already disabled (the caller manages
it) it does nothing.
"""

from __future__ import annotations

import gc

__all__ = ["GcPause"]


class GcPause:
    """The collector disabled from entering the ``with`` block until ``resume`` (idempotent) or the
    block's end; ``enabled=False``, or a collector disabled already: nothing is touched."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled, self._paused = enabled, False

    def resume(self) -> None:
        """Enable the collector again (a collection that fell due runs at the next allocation)."""
        if self._paused:
            self._paused = False
            gc.enable()

    def __enter__(self) -> GcPause:
        if self._enabled and gc.isenabled():
            gc.disable()
            self._paused = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.resume()
