"""How long a yielded tensor stays valid, made checkable.

An export writes into buffers it reuses (``ExportBuffers``): a tensor yielded one-by-one is valid
until the generator advances; a tensor of a bucket (``RefitBridge.export_hf_weight_buckets``) until
the next bucket is requested. A consumer that keeps a tensor longer without copying it reads
whatever a later tensor wrote there, which no check of the values can tell from a training bug.

``guard_tensors`` / ``guard_buckets`` are the checking mode for tests: each yielded tensor is a view
of the same memory as a ``GuardedTensor`` that raises ``ExpiredTensorError`` (naming the tensor and
the rule) from every torch operation once its lifetime has ended. An export with ``hold_outputs``
keeps every tensor valid until the next export call: ``HeldOutputs`` guards those until then. Turned on per bridge
(``RefitBridge.check_lifetime``) or for a whole run with the environment variable
``MBRIDGE_REFIT_CHECK_LIFETIME=1`` (``lifetime_checks_from_environment``). Tensors derived from a
guarded one before it expired (``t.view(...)``, ``t[0]``) are plain tensors and are not followed.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch

from mbridge_refit.errors import UsageError

__all__ = [
    "ENVIRONMENT_VARIABLE",
    "ExpiredTensorError",
    "GuardedTensor",
    "HeldOutputs",
    "guard_buckets",
    "guard_tensors",
    "lifetime_checks_from_environment",
]

ENVIRONMENT_VARIABLE = "MBRIDGE_REFIT_CHECK_LIFETIME"


class ExpiredTensorError(UsageError):
    """A yielded tensor was used after the export moved past it (its memory may hold another tensor)."""


def lifetime_checks_from_environment() -> bool:
    """Whether ``MBRIDGE_REFIT_CHECK_LIFETIME`` asks for the checking mode ("1", "true", "yes", "on")."""
    return os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


class GuardedTensor(torch.Tensor):
    """A yielded tensor that refuses every torch operation once ``expire`` was called."""

    _expired_reason: str | None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in _tensors_in(args, kwargs):
            reason = getattr(value, "_expired_reason", None)
            if reason is not None:
                raise ExpiredTensorError(reason)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def expire(self, reason: str) -> None:
        self._expired_reason = reason


def _guard(tensor: torch.Tensor) -> GuardedTensor:
    guarded = tensor.as_subclass(GuardedTensor)
    guarded._expired_reason = None
    return guarded


def _tensors_in(args, kwargs) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def guard_tensors(stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` with each tensor guarded until the generator advances (one-by-one lifetime)."""
    for name, tensor in stream:
        guarded = _guard(tensor)
        yield name, guarded
        guarded.expire(
            f"{name} was used after the export moved on to the next tensor: a yielded tensor is valid until the "
            "generator advances (its buffer is reused). Copy it, or collect tensors with "
            "RefitBridge.export_hf_weight_buckets (valid per bucket) or hold_outputs=True (valid per export)"
        )


def guard_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``buckets`` with each tensor guarded until the next bucket is requested."""
    for bucket in buckets:
        guarded = [(name, _guard(tensor)) for name, tensor in bucket]
        yield guarded
        for name, tensor in guarded:
            tensor.expire(
                f"{name} was used after the export moved on to the next bucket: a bucket's tensors are valid until "
                "the next bucket is requested (their buffers are reused). Copy what you keep longer, or pass hold_outputs=True"
            )


class HeldOutputs:
    """The checking mode of exports whose tensors stay valid until the next export call (``hold_outputs``):
    ``guard`` guards every tensor of one export, ``expire`` ends them all (the bridge calls it when its
    next export begins, held or not)."""

    def __init__(self) -> None:
        self._guarded: list[tuple[str, GuardedTensor]] = []

    def expire(self) -> None:
        for name, tensor in self._guarded:
            tensor.expire(
                f"{name} was used after the next export began: with hold_outputs=True a tensor is valid until the "
                "next export call (the export writes into the same buffers). Copy what you keep longer"
            )
        self._guarded = []

    def guard(self, stream: Iterable, *, in_buckets: bool) -> Iterator:
        """``stream`` (pairs, or lists of pairs ``in_buckets``) with each tensor guarded until ``expire``."""
        for item in stream:
            pairs = item if in_buckets else [item]
            guarded = [(name, _guard(tensor)) for name, tensor in pairs]
            self._guarded += guarded
            yield guarded if in_buckets else guarded[0]
