"""Exact fingerprints of tensors: equal bytes give equal fingerprints on any device.

Used to prove that two engines hold bitwise-equal parameters without moving them: each side
computes per-parameter fingerprints where the parameters live and only the numbers travel. A
fingerprint is two 64-bit integers over the tensor's bytes read as 32-bit words: their plain sum
and a position-weighted sum (weights 1..65521 cycling), so a permutation of words is caught as
well as a changed word. Integer sums wrap modulo 2**64 in any order, so the result does not
depend on the reduction order of the device.

An engine's fingerprints travel to the trainer as ``fingerprints_to_wire``'s reply, which carries
``FINGERPRINT_VERSION`` (the algorithm and the reply's layout); ``fingerprints_from_wire`` refuses a
reply of another version (or none) by name before it reads a number, so fingerprints computed
another way are never compared as if they were wrong weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mbridge_refit.errors import EngineError, wire_version_mismatch

__all__ = [
    "FINGERPRINT_VERSION",
    "differing",
    "fingerprints_from_wire",
    "fingerprints_to_wire",
    "named_fingerprints",
    "tensor_fingerprint",
]

FINGERPRINT_VERSION = 1  # tensor_fingerprint's words and the reply's layout (fingerprints_to_wire)
_WIRE_FORMAT = "fingerprints reply"

_CHUNK_WORDS = 1 << 24  # bounds the temporaries: 64 Mi words in int64 per step
_WEIGHT_PERIOD = 65521


def tensor_fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """``(sum, weighted_sum)`` of ``tensor``'s bytes as little-endian 32-bit words (a trailing
    partial word is zero-padded); the tensor is read as stored, so ``-0.0 != 0.0`` and NaN
    payloads count."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start : start + _CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=words.device, dtype=torch.int64)
        weights = weights % _WEIGHT_PERIOD + 1
        plain += chunk.sum()
        weighted += (chunk * weights).sum()
    return int(plain), int(weighted)


def named_fingerprints(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, int]]:
    """``{name: tensor_fingerprint(tensor)}`` for every pair (e.g. ``module.named_parameters()``)."""
    return {name: tensor_fingerprint(tensor) for name, tensor in named}


def fingerprints_to_wire(fingerprints: dict[str, tuple[int, int]]) -> dict:
    """An engine's fingerprints as plain data for an RPC's reply, with ``FINGERPRINT_VERSION``."""
    return {"version": FINGERPRINT_VERSION, "fingerprints": {name: list(fp) for name, fp in fingerprints.items()}}


def fingerprints_from_wire(reply: object) -> dict[str, tuple[int, int]]:
    """``fingerprints_to_wire``'s fingerprints back; raises ``EngineError`` naming both versions for a reply
    of another ``FINGERPRINT_VERSION`` (a bare ``{name: [sum, weighted]}``: an engine from before it)."""
    version = reply.get("version") if isinstance(reply, dict) and isinstance(reply.get("fingerprints"), dict) else None
    if version != FINGERPRINT_VERSION:
        raise EngineError(wire_version_mismatch(_WIRE_FORMAT, FINGERPRINT_VERSION, version, "the engine"))
    return {name: tuple(fp) for name, fp in reply["fingerprints"].items()}


def differing(left: dict[str, tuple[int, int]], right: dict[str, tuple[int, int]]) -> list[str]:
    """Names whose fingerprints differ or that only one side has, sorted."""
    names = set(left) | set(right)
    return sorted(n for n in names if left.get(n) != right.get(n))
