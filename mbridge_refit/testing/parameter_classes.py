"""Engine parameter classes as engines write them, for the tests and benchmarks of what an engine's
parameters cost the refit's host work (test support).

``DispatchingParameter`` is vLLM's ``BasevLLMParameter`` as far as that goes: a ``torch.nn.Parameter``
subclass that overrides ``__torch_function__`` and passes every call on, so each tensor method called on
one runs a Python method first. ``calls`` counts them (reset it before counting).
"""

from __future__ import annotations

import torch

__all__ = ["DispatchingParameter"]


class DispatchingParameter(torch.nn.Parameter):
    """A parameter whose class overrides ``__torch_function__`` (module docstring)."""

    calls = 0

    def __new__(cls, data: torch.Tensor):
        return super().__new__(cls, data=data, requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        DispatchingParameter.calls += 1
        return super().__torch_function__(func, types, args, {} if kwargs is None else kwargs)
