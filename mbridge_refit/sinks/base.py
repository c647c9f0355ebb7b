"""The sink contract: what consumes an exported ``(hf_name, tensor)`` stream.

Owns the :class:`WeightSink` protocol (call order, which ranks call it, who owns the tensor
buffer and for how long) and :func:`drain`, the one loop that feeds a stream into a sink and
guarantees exactly one of ``finish`` / ``abort`` runs afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

__all__ = ["DiscardSink", "WeightSink", "drain"]

logger = logging.getLogger(__name__)


@runtime_checkable
class WeightSink(Protocol):
    """A consumer of exported Hugging Face tensors.

    Contract:

    * ``consume(hf_name, tensor)`` is called once per exported tensor, in export order, on
      every rank that iterates the export. All ranks of the job see the same names in the same
      order (so a sink may derive collective decisions, e.g. sharding, from the stream alone).
      The tensor is only valid until the next ``consume`` call: the exporter may reuse its
      buffer. A sink that keeps data past the call must copy it.
    * ``finish()`` is called once after the stream ended normally, on every rank. It may run
      collectives (e.g. a barrier) and must leave the sink's output complete.
    * ``abort()`` is called instead of ``finish`` when the stream (or a ``consume``) raised, and
      also when ``finish`` itself raised. It may run on a subset of ranks, so it must not run
      collectives. It must remove anything half-written by this rank and be safe to call after
      a partial ``finish``.

    No method is called after ``finish`` or ``abort``.
    """

    def consume(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Take one exported tensor; copy it if it must outlive this call."""
        ...

    def finish(self) -> None:
        """Complete the output after the last tensor (every rank; may run collectives)."""
        ...

    def abort(self) -> None:
        """Remove this rank's partial output (no collectives)."""
        ...


class DiscardSink(WeightSink):
    """Consumes and keeps nothing: for ranks that must iterate a collective export (every rank of
    the model's groups does) while another rank's sink keeps the tensors."""

    def consume(self, hf_name: str, tensor: torch.Tensor) -> None:
        pass

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def drain(stream: Iterable[tuple[str, torch.Tensor]], sink: WeightSink) -> int:
    """Feed every ``(hf_name, tensor)`` of ``stream`` into ``sink``, then finish it.

    Calls ``sink.finish()`` after the stream ends normally. If iterating the stream, a
    ``consume`` or ``finish`` raises, calls ``sink.abort()`` and re-raises the original error
    (an error inside ``abort`` is logged, not allowed to hide the original).

    Returns:
        The number of tensors consumed.
    """
    count = 0
    try:
        for hf_name, tensor in stream:
            sink.consume(hf_name, tensor)
            count += 1
        sink.finish()
    except BaseException:
        _abort_quietly(sink)
        raise
    return count


def _abort_quietly(sink: WeightSink) -> None:
    try:
        sink.abort()
    except Exception:
        logger.exception("%s.abort() failed while handling an earlier error", type(sink).__name__)
