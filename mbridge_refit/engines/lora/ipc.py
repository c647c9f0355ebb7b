"""A LoRA adapter's factors shared with a colocated engine, engine-agnostic: both sides.

The trainer exports the factors into buffers it holds across steps
(``export_adapter_weights(..., cpu=False, reuse_buffer_from_cache=True)``: views of the adapter
parameters or held gather buffers), so their layout (``engines.ipc.sharing``) is the same every step.
``AdapterShare`` (trainer) names each factor as a PEFT checkpoint does (``engines.lora.adapter.PEFT_PREFIX``)
and shares the storages through a transport (CUDA IPC, or in-process) only when the layout moved;
``AdapterReceiver`` (engine) maps them once and hands the engine views of this step's factors, refusing
a step whose layout it did not open. What the engine does with the views (build its adapter, fill its
slot) is its adapter's business (for vLLM ``engines.vllm.lora``).

Protocol, each a worker RPC: ``open(wire, payload, transport)`` when the layout is new or moved;
``tensors(fingerprint)`` every step, inside the RPC that loads them; ``close()``. Lifetimes as for the
weight refit (``engines.ipc.engine``): the trainer keeps the storages alive and unchanged from its export until
the engine's load returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mbridge_refit.engines.ipc.sharing import TRANSPORTS, LayoutRecorder, SharedLayout, SharingError, Transport, views
from mbridge_refit.engines.lora.adapter import PEFT_PREFIX
from mbridge_refit.errors import EngineError

__all__ = ["AdapterReceiver", "AdapterShare", "AdapterShareError"]


class AdapterShareError(EngineError):
    """The engine was asked to load an adapter layout it has not mapped."""


class AdapterShare:
    """Trainer side: the factors of each export as a shared layout, shared anew only when they moved."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.layout: SharedLayout | None = None
        self._key: tuple | None = None
        self._held: list = []  # the storages the engine maps: alive while it may read them
        self._payload: bytes | None = None

    def record(self, factors: Iterable[tuple[str, torch.Tensor]]) -> bytes | None:
        """Note where this export's factors live; the transport's payload when the engine must map them
        (first step, or the factors moved), else None (the engine's mapping still holds)."""
        recorder = LayoutRecorder()
        for name, tensor in factors:
            recorder.add(PEFT_PREFIX + name, tensor)
        if self.layout is not None and recorder.key == self._key:
            return None
        layout, storages = recorder.layout()
        payload = self.transport.share(storages)
        self.release()
        self.layout, self._key, self._held, self._payload = layout, recorder.key, storages, payload
        return payload

    def release(self) -> None:
        """Forget the shared layout (the in-process transport keeps its storages until told)."""
        release = getattr(self.transport, "release", None)
        if release is not None and self._payload is not None:
            release(self._payload)
        self.layout, self._key, self._held, self._payload = None, None, [], None


class AdapterReceiver:
    """Engine side: the trainer's factors mapped once, as views by PEFT name for each step's load."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._fingerprint: str | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._storages: list = []

    def open(self, wire: dict[str, Any], payload: bytes, transport: str) -> dict[str, Any]:
        """Map the storages of ``wire``'s layout; returns ``{fingerprint, tensors, bytes}``."""
        self.close()
        if transport not in TRANSPORTS:
            raise AdapterShareError(f"unknown transport {transport!r}; known: {sorted(TRANSPORTS)}")
        layout = SharedLayout.from_wire(wire)
        try:
            storages = TRANSPORTS[transport]().open(payload, self.device)
            mapped = views(layout, storages, self.device)
        except SharingError as err:
            raise AdapterShareError(f"cannot map the trainer's adapter factors: {err}") from err
        self._fingerprint, self._views, self._storages = layout.fingerprint, dict(mapped), storages
        return {"fingerprint": layout.fingerprint, "tensors": len(mapped), "bytes": layout.nbytes}

    def tensors(self, fingerprint: str) -> dict[str, torch.Tensor]:
        """This step's factors (views of the trainer's memory, valid while the load RPC runs)."""
        if self._fingerprint is None:
            raise AdapterShareError("no adapter layout is open on this engine: the trainer's session opens one first")
        if fingerprint != self._fingerprint:
            raise AdapterShareError(
                f"adapter layout mismatch: the trainer's step has {fingerprint}, this engine opened "
                f"{self._fingerprint}; the trainer must open its new layout"
            )
        return dict(self._views)

    def close(self) -> None:
        self._fingerprint, self._views, self._storages = None, {}, []
