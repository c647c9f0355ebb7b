"""An engine rank's loader, recorded against full-size HF tensors, replayed from its shards.

A tensor-parallel engine rank loads its part of each HF tensor: its loader narrows the full
tensor to its rows or columns (vLLM's ``ColumnParallelLinear``, ``QKVParallelLinear``,
``VocabParallelEmbedding`` ...). A sharded refit (``plan.transfer``) delivers only that part, the
*shard* of the box the transfer plan computed (``sharing.ShardBox``), so the loader cannot be run
on what arrives. Instead the loader is recorded once (``engines.replay.apply_plan``) against a full-size
tensor built around the shard (``expand``: the box holds the shard's values, every other element a
pattern byte), and every recorded read, a view of that full tensor, is moved into the shard: the
same elements, shifted by the box's start (``remap``). A read that leaves the box means that the
transfer plan's sharding rule and the engine's loader disagree; it is refused by name
(``ShardRemapError``), never replayed from pattern bytes. Any dtype alike: a blockwise FP8 refit
shares each weight's FP8 data as its box and its ``weight_scale_inv`` as the box of the scale tensor
(in blocks, ``fp8.format.scale_box``), and the loader's reads of both are moved, or refused, the same way.

A tensor the loader does not load by plain copies (a conversion through a temporary) keeps its
full-size tensor and goes through the loader every step, the shard copied into its box first;
``ApplyPlan.check_against_loader`` then also proves that the loader's result does not depend on
the bytes outside the box (``OUTSIDE_PATTERNS``). Imports only torch and the errors.
"""

from __future__ import annotations

import torch

from mbridge_refit.errors import EngineError

__all__ = ["OUTSIDE_PATTERNS", "Box", "ShardRemapError", "box_view", "expand", "fill_outside", "remap"]

Box = tuple[tuple[int, int], ...]
OUTSIDE_PATTERNS = (0xC3, 0x3C)  # the bytes outside a shard's box: at recording, and again in the check


class ShardRemapError(EngineError):
    """The engine's loader reads a shard-backed tensor where the shard does not hold it."""


def box_view(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The ``box`` of ``tensor`` as a view (one narrow per dimension)."""
    for dim, (start, stop) in enumerate(box):
        tensor = tensor.narrow(dim, start, stop - start)
    return tensor


def expand(shard: torch.Tensor, shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` whose ``box`` holds ``shard`` and whose other bytes are
    the first of ``OUTSIDE_PATTERNS``."""
    full = torch.empty(shape, dtype=shard.dtype, device=shard.device)
    fill_outside(full, shard, box, OUTSIDE_PATTERNS[0])
    return full


def fill_outside(full: torch.Tensor, shard: torch.Tensor, box: Box, pattern: int) -> None:
    """Every byte of ``full`` set to ``pattern``, then ``shard`` copied into its ``box``."""
    full.reshape(-1).view(torch.uint8).fill_(pattern)
    box_view(full, box).copy_(shard)


def remap(view: torch.Tensor, full: torch.Tensor, shard: torch.Tensor, box: Box, name: str) -> torch.Tensor:
    """The view of ``shard`` that holds the elements ``view`` reads of ``full`` (``full``'s ``box``
    is ``shard``). ``view`` must read a box of ``full`` (the loader's narrows and selects), inside
    ``box``; otherwise ``ShardRemapError`` names ``name``, what was read and what the shard holds."""
    extents = _read_box(view, full, name)
    if extents is None:
        raise ShardRemapError(
            f"{name}: the engine's loader reads a {tuple(view.shape)} view (stride {view.stride()}) of it that is "
            "not a box of the HF tensor, so it cannot be read from this engine rank's shard"
        )
    dims, read = extents
    outside = [(dim, extent, held) for dim, (extent, held) in enumerate(zip(read, box)) if not _within(extent, held)]
    if outside:
        raise ShardRemapError(
            f"{name}: the engine's loader reads {list(read)} of its {tuple(full.shape)} but this engine rank's shard "
            f"holds {list(box)} (dimension {outside[0][0]}): the transfer plan's sharding rule for this tensor is not "
            "the engine's (plan.engine_layout.ENGINE_RULES), or the engine runs another layout than the plan's"
        )
    offset = shard.storage_offset() + sum(
        (start - held[0]) * shard.stride(d) for d, ((start, _), held) in enumerate(zip(read, box))
    )
    strides = [shard.stride(dim) if dim is not None else 1 for dim in dims]
    return shard.as_strided(view.shape, strides, offset)


def _read_box(view: torch.Tensor, full: torch.Tensor, name: str) -> tuple[list[int | None], Box] | None:
    """(the ``full`` dimension each ``view`` dimension walks, None for size 1; the box of ``full``
    the view reads), or None when the view is not a box of ``full``."""
    if view.untyped_storage().data_ptr() != full.untyped_storage().data_ptr() or view.dtype != full.dtype:
        raise ShardRemapError(f"{name}: a recorded read of it is not a view of the tensor being loaded")
    if not full.is_contiguous():
        return None
    delta = view.storage_offset() - full.storage_offset()
    start = [(delta // stride) % size if size else 0 for size, stride in zip(full.shape, full.stride())]
    if sum(s * stride for s, stride in zip(start, full.stride())) != delta:
        return None
    extent = [1] * full.dim()
    dims: list[int | None] = []
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            dims.append(None)
            continue
        walks = [d for d in range(full.dim()) if full.stride(d) == stride and full.shape[d] > 1 and extent[d] == 1]
        if not walks:
            return None
        dims.append(walks[0])
        extent[walks[0]] = size
    read = tuple((s, s + n) for s, n in zip(start, extent))
    if any(stop > size for (_, stop), size in zip(read, full.shape)):
        return None
    return dims, read


def _within(extent: tuple[int, int], held: tuple[int, int]) -> bool:
    return held[0] <= extent[0] and extent[1] <= held[1]
