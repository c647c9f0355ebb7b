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

A cached buffer is the same tensor object every export, so a consumer that rebinds a yielded one
(``t.data = t.data.half()``, ``t.set_(...)``) would change what later exports write into and yield.
Each buffer is kept with a private alias made when it was allocated (which also keeps its storage
alive, so no other tensor can take its address); a request that finds its buffer no longer set to
its alias or of another dtype raises ``ReboundOutputError`` naming it (one ``is_set_to`` per reuse).
"""

from __future__ import annotations

from typing import Any

import torch

from mbridge_refit.errors import UsageError

__all__ = ["ExportBuffers", "ReboundOutputError", "SCRATCH_ROLES", "check_not_rebound"]

SCRATCH_ROLES = frozenset({"pack", "fp8_work", "lora_work"})  # consumed inside their bucket, never yielded


class ReboundOutputError(UsageError):
    """A consumer changed the storage or metadata of a tensor an export yielded from a bridge-owned buffer."""


def check_not_rebound(tensor: torch.Tensor, alias: torch.Tensor | None, dtype: torch.dtype, what: str) -> None:
    """Raise ``ReboundOutputError`` unless ``tensor`` is still set to ``alias`` (made with it: the same
    storage, offset, sizes and strides) with ``dtype``; ``alias`` None (a meta tensor) passes."""
    if alias is None or (tensor.dtype is dtype and tensor.is_set_to(alias)):
        return
    raise ReboundOutputError(
        f"{what}, a tensor the bridge yields from its own buffer every export, was changed by its consumer (it was "
        f"{dtype} {list(alias.shape)} and is {tensor.dtype} {list(tensor.shape)} now, or on other memory: "
        "t.data = ..., set_, resize_ or swap_tensors on a yielded tensor). A consumer must not change a yielded "
        "tensor in place: copy it instead (t.clone(), t.to(...)); bridge.release_export_buffers() drops the cache"
    )


def _alias(tensor: torch.Tensor) -> torch.Tensor | None:
    return None if tensor.is_meta else tensor.detach()


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
        # key -> [buffer, its alias, the name it was last given as]: a buffer is reused for several
        # tensors of one export; a rebound one is named as its consumer got it
        self._pool: dict[tuple, list] = {}
        self.memo: dict[Any, Any] = {}
        self.allocations = 0

    def get(
        self,
        role: str,
        index: Any,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        name: str | None = None,
    ) -> torch.Tensor:
        """The buffer for ``(role, index, shape, dtype, device)`` (and ``bucket``, holding a whole
        export); ``name``: the HF tensor it is yielded as, for the error a rebound one raises
        (naming the tensor the buffer was last given as: the one its consumer changed)."""
        key = (role, index, tuple(shape), dtype, str(device))
        if self.hold_whole_export and role not in SCRATCH_ROLES:
            key += (self.bucket,)
        held = self._pool.get(key) if self.persistent else None
        if held is not None:
            check_not_rebound(held[0], held[1], dtype, held[2] or name or f"the {role} buffer {list(shape)}")
            held[2] = name
            return held[0]
        buffer = torch.empty(shape, dtype=dtype, device=device)
        self.allocations += 1
        if self.persistent:
            self._pool[key] = [buffer, _alias(buffer), name]
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes held by the persistent pool."""
        return sum(b.numel() * b.element_size() for b, _, _ in self._pool.values())

    def __len__(self) -> int:
        return len(self._pool)

    def release(self) -> None:
        self._pool.clear()
        self.memo.clear()
