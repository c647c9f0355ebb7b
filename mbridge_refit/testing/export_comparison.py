"""Comparing an export stream with its oracle: names, order, dtype, shape and bytes.

Owns the comparison the conformance checks (``testing.conformance``) decide their cells with: a
stream of ``(name, tensor)`` against the expected list, each tensor compared as it is yielded (an
export's tensor may be valid only until the stream advances), and the FP8 stream the blockwise
format asks for, made from the BF16 oracle's tensors with the reference quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from mbridge_refit.fp8.format import BlockwiseFP8Config, scale_name
from mbridge_refit.fp8.reference import quantize_reference

__all__ = ["Comparison", "compare_stream", "fp8_expected", "same_bytes"]


def same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return False
    return torch.equal(_as_bytes(actual), _as_bytes(expected))


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8).cpu()


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    """A stream against the expected ``(name, tensor)`` list."""

    compared: int
    differing: tuple[str, ...]  # names whose dtype, shape or bytes differ
    missing: tuple[str, ...]  # expected, never yielded
    unexpected: tuple[str, ...]  # yielded, not expected (or yielded twice)
    in_order: bool

    @property
    def exact(self) -> bool:
        return self.in_order and not (self.differing or self.missing or self.unexpected)

    def describe(self, limit: int = 5) -> str:
        parts = [
            f"{label} {list(names[:limit])}{' ...' if len(names) > limit else ''}"
            for label, names in (
                ("differing", self.differing),
                ("missing", self.missing),
                ("unexpected", self.unexpected),
            )
            if names
        ]
        if not self.in_order:
            parts.append("names out of order")
        return "; ".join(parts) or "exact"


def compare_stream(
    expected: Sequence[tuple[str, torch.Tensor]], stream: Iterable[tuple[str, torch.Tensor]]
) -> Comparison:
    """Compare each yielded tensor as it comes (it may be valid only until the stream advances)."""
    wanted = dict(expected)
    seen: dict[str, None] = {}  # yielded expected names, in the order they came
    differing, unexpected = [], []
    for name, tensor in stream:
        if name not in wanted or name in seen:
            unexpected.append(name)
            continue
        seen[name] = None
        if not same_bytes(tensor, wanted[name]):
            differing.append(name)
    order = [name for name, _ in expected]
    return Comparison(
        compared=len(seen),
        differing=tuple(differing),
        missing=tuple(name for name in order if name not in seen),
        unexpected=tuple(unexpected),
        in_order=list(seen) == [name for name in order if name in seen],
    )


def fp8_expected(
    stock: Sequence[tuple[str, torch.Tensor]], config: BlockwiseFP8Config
) -> list[tuple[str, torch.Tensor]]:
    """The FP8 stream the format asks for, made from stock's tensors with the reference quantizer."""
    expected: list[tuple[str, torch.Tensor]] = []
    for name, tensor in stock:
        if config.quantizes(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")):
            data, scale = quantize_reference(tensor)
            expected += [(name, data), (scale_name(name), scale)]
        else:
            expected.append((name, tensor))
    return expected
