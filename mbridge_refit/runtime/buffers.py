"""``ExportBuffers``: the output buffers an export writes into, owned by the bridge.

With ``persistent=True`` (``reuse_buffer_from_cache=True``) one buffer per (role, index, shape,
dtype, device) is allocated on first use and reused by every later export, so a steady-state
export allocates nothing; buckets of the same layout share buffers because the index is the
position in the bucket. With ``persistent=False`` every request is a fresh tensor the caller may
keep.

``hold_whole_export=True`` keys every output buffer by its bucket as well, so nothing a bucket
yields is overwritten by a later bucket of the same export: every yielded tensor stays valid, in
place, until the next export. A consumer that reads the whole export after it ended (an engine
mapping the trainer's memory by CUDA IPC) needs this; it costs one buffer per non-view output
instead of one per bucket position. Scratch roles (``SCRATCH_ROLES``), consumed inside a bucket,
stay shared.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ExportBuffers", "SCRATCH_ROLES"]

SCRATCH_ROLES = frozenset({"pack", "fp8_work", "lora_work"})  # consumed inside their bucket, never yielded


class ExportBuffers:
    """Output buffers owned by the bridge.

    ``persistent=True``: one buffer per (role, index, shape, dtype, device), allocated on first
    use and reused by every later export; ``release()`` frees them. ``persistent=False``: a
    fresh tensor for every request (the caller may keep what it is given).

    ``hold_whole_export``: output buffers are also keyed by ``bucket`` (which the exporter sets
    before it fills each bucket), so an export's outputs stay valid until the next export.

    ``memo``: records derived from the buffers (e.g. how a bucket is quantized into them), kept
    exactly as long as the buffers are. ``allocations``: tensors allocated so far (a steady-state
    persistent export adds none).
    """

    def __init__(self, *, persistent: bool, hold_whole_export: bool = False) -> None:
        self.persistent = persistent
        self.hold_whole_export = hold_whole_export
        self.bucket = 0
        self._pool: dict[tuple, torch.Tensor] = {}
        self.memo: dict[Any, Any] = {}
        self.allocations = 0

    def get(
        self, role: str, index: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        key = (role, index, tuple(shape), dtype, str(device))
        if self.hold_whole_export and role not in SCRATCH_ROLES:
            key += (self.bucket,)
        buffer = self._pool.get(key) if self.persistent else None
        if buffer is None:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            self.allocations += 1
            if self.persistent:
                self._pool[key] = buffer
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes held by the persistent pool."""
        return sum(b.numel() * b.element_size() for b in self._pool.values())

    def __len__(self) -> int:
        return len(self._pool)

    def release(self) -> None:
        self._pool.clear()
        self.memo.clear()
