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
alive, so no other tensor can take its address), and checked against it twice:

* ``check_pool``, before an export's first collective: every pooled buffer but the scratch ones
  (never yielded) still set to its alias with its dtype (one ``is_set_to`` and one dtype per
  buffer, in C-level passes), else ``ReboundOutputError`` naming the tensor the buffer was last
  yielded as. ``RefitBridge._in_place_change`` runs it and the handshake shares the verdict with
  every rank, so a buffer rebound on one rank only is refused on every rank before any collective.
  A rank exporting alone (no collective to enter) skips it: ``get`` refuses the buffer instead.
* every request (``get``) of a buffer the pool already holds: the same check for that buffer (one
  ``is_set_to`` per reuse). A consumer runs between the buckets of an export, so it may rebind a
  tensor yielded by this very export (or one it kept from the last) after ``check_pool`` passed;
  that is found when the buffer is next requested, mid-export, and raised on that rank only: its
  peers wait in their next collective until the process group's timeout.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from mbridge_refit.errors import UsageError

__all__ = ["ExportBuffers", "ReboundOutputError", "SCRATCH_ROLES", "check_not_rebound"]

SCRATCH_ROLES = frozenset({"pack", "fp8_work", "lora_work"})  # consumed inside their bucket, never yielded


class ReboundOutputError(UsageError):
    """A consumer changed the storage or metadata of a tensor an export yielded from a bridge-owned buffer."""


def check_not_rebound(tensor: torch.Tensor, alias: torch.Tensor | None, dtype: torch.dtype, what: str | tuple) -> None:
    """Raise ``ReboundOutputError`` unless ``tensor`` is still set to ``alias`` (made with it: the same
    storage, offset, sizes and strides) with ``dtype``; ``alias`` None (a meta tensor) passes. ``what``
    names the tensor: a name, or the pool key of a buffer never given one (named from it only to raise:
    the check runs on every reuse)."""
    if alias is None or (tensor.dtype is dtype and tensor.is_set_to(alias)):
        return
    what = what if type(what) is str else _unnamed(what)
    raise ReboundOutputError(
        f"{what}, a tensor the bridge yields from its own buffer every export, was changed by its consumer (it was "
        f"{dtype} {list(alias.shape)} and is {tensor.dtype} {list(tensor.shape)} now, or on other memory: "
        "t.data = ..., set_, resize_ or swap_tensors on a yielded tensor). A consumer must not change a yielded "
        "tensor in place: copy it instead (t.clone(), t.to(...)); bridge.release_export_buffers() drops the cache"
    )


def _alias(tensor: torch.Tensor) -> torch.Tensor | None:
    return None if tensor.is_meta else tensor.detach()


def _unnamed(key: tuple) -> str:
    """How an error names a buffer never given a name (its role and shape, from its pool key)."""
    return f"the {key[0]} buffer {list(key[2])}"


_dtype = operator.attrgetter("dtype")


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
        # the pool's buffers a consumer may get (not scratch) that have an alias (not meta), with their
        # aliases and dtypes: what ``check_pool`` checks
        self._checked: list[torch.Tensor] = []
        self._aliases: list[torch.Tensor] = []
        self._dtypes: list[torch.dtype] = []
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
            check_not_rebound(held[0], held[1], dtype, held[2] or name or key)
            held[2] = name
            return held[0]
        buffer = torch.empty(shape, dtype=dtype, device=device)
        self.allocations += 1
        if self.persistent:
            alias = _alias(buffer)
            self._pool[key] = [buffer, alias, name]
            if alias is not None and role not in SCRATCH_ROLES:  # a scratch buffer is never yielded
                self._checked.append(buffer)
                self._aliases.append(alias)
                self._dtypes.append(dtype)
        return buffer

    def check_pool(self) -> None:
        """Raise ``ReboundOutputError`` where a consumer changed a pooled buffer (``t.data = ...``,
        ``set_``, ``resize_``, ``swap_tensors``), naming the tensor it was last yielded as: one
        ``is_set_to`` and one dtype per buffer, in C-level passes (module docstring). Local, no
        collective; run once per export, before any collective."""
        if all(map(torch.Tensor.is_set_to, self._checked, self._aliases)) and (
            list(map(_dtype, self._checked)) == self._dtypes
        ):
            return
        for key, (buffer, alias, name) in self._pool.items():
            if key[0] not in SCRATCH_ROLES:
                check_not_rebound(buffer, alias, key[3], name or key)

    @property
    def nbytes(self) -> int:
        """Bytes held by the persistent pool."""
        return sum(b.numel() * b.element_size() for b, _, _ in self._pool.values())

    def __len__(self) -> int:
        return len(self._pool)

    def release(self) -> None:
        self._pool.clear()
        self._checked.clear()
        self._aliases.clear()
        self._dtypes.clear()
        self.memo.clear()
