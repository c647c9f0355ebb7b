"""The derived numerics tolerance of a refit check: how far two correct forwards may differ.

``numerics_tolerance`` derives it from the dtype both forwards compute in and the engine's own
spread between two attention implementations; ``tolerance_from_reference`` from a reference run
(an engine loaded from a checkpoint of the same weights). ``convert.refit_verifier`` checks its
numerics against them, and ``convert.verify_refit``'s ``--tolerance`` help names the factors: this
module imports no torch at import time, so that the CLI's ``--help`` does not wait for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["EPS_FACTOR", "NOISE_FACTOR", "Spread", "numerics_tolerance", "tolerance_from_reference"]


class Spread(Protocol):
    """What the tolerance reads of a comparison of two forwards (``refit_verifier.LogprobComparison``)."""

    mean_abs_diff: float


# The derived numerics tolerance (``numerics_tolerance``): the larger of EPS_FACTOR x the dtype's
# eps and NOISE_FACTOR x the engine's own spread. Measured mean |d logprob| after exact refits
# (engine vs Megatron / the engine against itself, eager vs default attention): bf16 CPU qwen3-tiny
# 1.1e-3 / 8.8e-4; bf16 H200 Qwen3-1.7B shape 0.018 / 0.025 (TP2: 0.025 / 0.026); fp32 CPU
# 1.0e-7 / 1.0e-7; fp32 H200 without TF32 3.3e-6 / 2.7e-6. A perturbed weight: 0.26 (bf16, H200).
EPS_FACTOR = 4.0
NOISE_FACTOR = 4.0


def numerics_tolerance(dtype: torch.dtype, engine_noise: Spread | None = None) -> tuple[float, str]:
    """The derived numerics tolerance and how it was derived: the larger of ``EPS_FACTOR`` x the
    eps of ``dtype`` (the dtype both forwards compute in) and ``NOISE_FACTOR`` x ``engine_noise``
    (the engine against itself with another attention implementation: the spread of two correct
    implementations in this dtype, for this model)."""
    import torch

    from_eps = EPS_FACTOR * torch.finfo(dtype).eps
    from_noise = NOISE_FACTOR * engine_noise.mean_abs_diff if engine_noise is not None else 0.0
    if from_noise > from_eps:
        return from_noise, f"derived: {NOISE_FACTOR:g} x the engine's eager-vs-default attention difference"
    return from_eps, f"derived: {EPS_FACTOR:g} x {str(dtype).removeprefix('torch.')} eps"


def tolerance_from_reference(reference: Spread) -> float:
    """A numerics tolerance from a reference run: ``reference`` is the same comparison for an
    engine loaded from a checkpoint of the same weights (e.g. the one ``convert`` wrote), which
    an exact refit reproduces (bit for bit in vLLM's batch-invariant mode); ``NOISE_FACTOR`` x
    its mean leaves room for run-to-run kernel differences."""
    return NOISE_FACTOR * reference.mean_abs_diff
