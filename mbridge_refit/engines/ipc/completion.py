"""When the engine's replay is done, told without a waiting RPC: ``ReplayDone`` (engine side) and
``DoneSignal`` (trainer side), a CUDA event shared by IPC.

After the engine's copies a colocated step needs the engine's follow-up (vLLM's prefix-cache reset,
an engine-core call of its own). Were the worker to synchronize its device before its apply RPC
returned, the RPC's way back, the reset's round trip and the copies would run one after the other.
With a shared event the worker records the event on its stream right after it launched the replay
and returns at once; the trainer makes the follow-up call while the copies run and then waits on
the event, so the step costs the longer of the two, not their sum. The reset may run while the
copies do: both concern an idle engine (a refit runs between generations; the reset refuses
otherwise), and the trainer waits before its refit returns, so nothing reads the new weights, and
the trainer changes none of the tensors the engine reads, before the copies are done.

Contract: the engine creates one ``ReplayDone`` per open layout (``ReplayDone.for_device``: None
where the device is not CUDA), hands ``handle`` to the trainer in its open report, and calls
``record()`` after every replay it was asked to signal. The trainer opens the handle once
(``DoneSignal.open``, on the GPU of the shared tensors: CUDA IPC events do not cross devices) and
calls ``wait(timeout_s)`` after every signalled apply RPC returned, before it lets anything touch
the shared tensors. The handle is hex text (plain data for any RPC and for JSON reports). Lower
layer of ``engines``: imports torch and ``sharing``'s error.
"""

from __future__ import annotations

import time

import torch

from mbridge_refit.engines.ipc.sharing import SharingError

__all__ = ["DoneSignal", "ReplayDone"]

_HANDLE_BYTES = 64  # cudaIpcEventHandle_t


class ReplayDone:
    """Engine side: the event its replays record, shared with the trainer by CUDA IPC."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self._event = torch.cuda.Event(interprocess=True)  # blocking off, timing off: what IPC events need
            self._event.record(torch.cuda.current_stream(device))  # an IPC handle needs a recorded event
        self.handle = bytes(self._event.ipc_handle()).hex()

    @classmethod
    def for_device(cls, device: torch.device) -> ReplayDone | None:
        """The event for a CUDA device, or None (a CPU engine's replay is done when it returns)."""
        return cls(device) if device.type == "cuda" else None

    def record(self) -> None:
        """Mark the end of the work just launched on the device's current stream (the replay)."""
        self._event.record(torch.cuda.current_stream(self.device))


class DoneSignal:
    """Trainer side: the engine's ``ReplayDone`` opened in this process."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    @classmethod
    def open(cls, handle: object, device: torch.device) -> DoneSignal:
        """Open the engine's hex ``handle`` on ``device`` (the GPU the engine shares); refused by name
        when it is not one."""
        try:
            raw = bytes.fromhex(handle) if isinstance(handle, str) else None
        except ValueError:
            raw = None
        if raw is None or len(raw) != _HANDLE_BYTES:
            raise SharingError(f"the engine's replay event handle is not {_HANDLE_BYTES} bytes of hex: {handle!r:.80}")
        return cls(torch.cuda.Event.from_ipc_handle(device, raw))

    def wait(self, timeout_s: float) -> None:
        """Return once the engine's last recorded replay has finished on the device; ``TimeoutError`` after
        ``timeout_s`` (an engine that died mid-copy must not hold the trainer for ever)."""
        deadline = time.monotonic() + timeout_s
        while not self._event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine's copies did not finish within {timeout_s:.0f} s")
            time.sleep(0)  # yield: copies take milliseconds, a sleep's granularity would add to each step
