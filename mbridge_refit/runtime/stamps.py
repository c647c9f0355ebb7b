"""Stamped buckets: how a steady export tells its consumer, once per bucket instead of once per
tensor, that a bucket holds the very tensors it held before, where they were.

A ``StampedBucket`` is a list of ``(hf_name, tensor)`` pairs with a ``stamp``: an int that one
producer issued (``new_stamp``) for one bucket content and that nothing else ever gets. Every
bucket stamped ``s`` holds the same pair objects, in the same order, and its producer checked,
in the export that yielded it, that each tensor still reads the memory (the addresses) it read
when ``s`` was issued:

* ``PlanExporter`` stamps a bucket whose tensors are all views of parameters (``_kept_record``)
  while those views are intact: each parameter set to the storage, offset, sizes and strides its
  views were made from, and each view as it was made (``runtime.exporter``);
* the FP8 quantizer (``fp8.quantize``) stamps its output for a stamped input: the same input
  pairs, quantized into buffers it holds, with the same launches.

A consumer that saw stamp ``s`` before may therefore reuse what it derived from those tensors'
places (``IpcSession``: the layout it shared with an engine) without reading each one again. A stamp
speaks of places, not of how long the values last: without ``hold_outputs`` a later bucket of the
same export may write into the buffers a stamped bucket yielded, as for any bucket. A parameter
whose storage is emptied in place (``resize_(0)``) and filled again keeps its views and its stamp,
which then read the storage's new memory (a consumer that mapped the old memory must look at the
addresses too). The list itself is the consumer's (a new list every export): changing it changes no later bucket. A
bucket without a stamp (any plain list) promises nothing; a transform that builds new pairs
yields plain lists unless it stamps them under the same rule.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable

__all__ = ["StampedBucket", "new_stamp", "stamp_of"]

_STAMPS = itertools.count(1)


def new_stamp() -> int:
    """A stamp no bucket has had (process-wide)."""
    return next(_STAMPS)


class StampedBucket(list):
    """A bucket's ``(hf_name, tensor)`` pairs with the ``stamp`` of their content (module docstring)."""

    __slots__ = ("stamp",)

    def __init__(self, pairs: Iterable[tuple[str, Any]], stamp: int) -> None:
        super().__init__(pairs)
        self.stamp = stamp


def stamp_of(bucket: list) -> int | None:
    """``bucket``'s stamp, or None for a bucket that promises nothing."""
    return bucket.stamp if type(bucket) is StampedBucket else None
