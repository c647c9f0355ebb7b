"""The model a config describes, checked against the checkpoint it is loaded from before any weight
memory is allocated.

``build_checked`` builds the model chunks on the meta device (``BuildOptions(materialize=False)``:
nothing is allocated), runs a check on them, and only then gives them memory. The checks:

- ``parameter_problem``, a bound: the elements of this rank's parameters (from the meta model)
  against the elements of every tensor the checkpoint stores. Every parameter is loaded from the
  checkpoint, so its model cannot hold more; a config off by orders of magnitude (``hidden_size``
  1e9) is refused naming both numbers. Elements, not bytes, because the model may hold a tensor
  wider than stored (``verify-refit --dtype float32`` on a bf16 checkpoint; float32 router biases)
  without being larger; the bound allows ``PARAMETER_SLACK`` times the checkpoint because a few
  parameters are derived from a stored tensor another parameter also reads (Gemma 4's ``v_proj``
  from ``k_proj`` with ``attention_k_eq_v``). The exact check is the next one.
- the exact check, tensor by tensor: HF checkpoints through the loader's own checks, reading no
  data (``RefitBridge.check_hf_shapes``: each tensor present with exactly the shape the model
  needs, every parameter covered); Megatron checkpoints against the DCP index
  (``checkpoints.megatron``: every tensor with its global shape and dtype, no stored tensor the
  model lacks, every stored piece inside its file). ``export`` thereby never crops or pads.

A GPU build cannot start on the meta device here: its check runs on a CPU meta build of the same
model (same parameters, same HF shapes), then the GPU model is built; a family the CPU cannot
build is checked after its GPU build, before any weight is read.

Every rank takes part and every rank raises the same error (the problems of all ranks gathered), so
a mismatch that only one pipeline stage sees ends every rank with exit code 2, without a hang.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from mbridge_refit.convert.exit_codes import BadInput
from mbridge_refit.models.builder import BuildOptions, build_model, materialize
from mbridge_refit.plan.layout import ParallelLayout

if TYPE_CHECKING:
    from mbridge_refit.bridge import RefitBridge

__all__ = [
    "PARAMETER_SLACK",
    "build_checked",
    "check_hf_source",
    "check_megatron_source",
    "parameter_problem",
    "raise_on_every_rank",
]

logger = logging.getLogger(__name__)

# How many times the checkpoint's elements this rank's parameters may hold (see the module docstring).
PARAMETER_SLACK = 2
_SHOWN_PROBLEMS = 8


def build_checked(
    bridge: RefitBridge, layout: ParallelLayout, options: BuildOptions, check: Callable[[list[torch.nn.Module]], None]
) -> list[torch.nn.Module]:
    """``build_model(bridge, layout, options)``, after ``check`` accepted the same model on the meta device."""
    if options.device.type == "cpu":
        meta = build_model(bridge, layout, dataclasses.replace(options, materialize=False))
        check(meta)
        return materialize(meta) if options.materialize else meta
    cpu_meta = BuildOptions(
        device=torch.device("cpu"), params_dtype=options.params_dtype, materialize=False, weights_only=True
    )
    try:
        meta = build_model(bridge, layout, cpu_meta)
    except Exception as err:  # a family only the GPU builds: checked after its build (the loader checks too)
        reason = f"{type(err).__name__}: {err}"
        logger.warning("no CPU meta-device build of this model (%s): it is checked after the GPU build", reason)
        chunks = build_model(bridge, layout, options)
        check(chunks)
        return chunks
    check(meta)
    return build_model(bridge, layout, options)


def check_hf_source(bridge: RefitBridge, chunks: list[torch.nn.Module], checkpoint: Any) -> None:
    """``chunks`` (meta) against the HF checkpoint ``checkpoint`` (an ``HFCheckpoint``)."""
    stored = sum(math.prod(checkpoint.shape(name)) for name in checkpoint.names())
    problem = parameter_problem(chunks, stored, checkpoint.path)
    raise_on_every_rank([problem] if problem else [], checkpoint.path)
    bridge.check_hf_shapes(chunks, checkpoint.path)


def check_megatron_source(chunks: list[torch.nn.Module], path: Path, *, stored: Any = None) -> None:
    """``chunks`` (meta) against the Megatron checkpoint in ``path`` (its DCP index; no data read): one of
    ``import``'s, or the model's tensors ``stored`` of a training checkpoint (``checkpoints.megatron_training``)."""
    from mbridge_refit.checkpoints.megatron import (
        NotAMegatronCheckpoint,
        fit_problems,
        model_tensors,
        read_stored,
    )

    stored = read_stored(path) if stored is None else stored
    if stored.problems:  # read from the same files on every rank: the same verdict everywhere, no collective
        raise NotAMegatronCheckpoint(
            f"the checkpoint at {path} is damaged: {_joined(stored.problems)}. Re-create it with `import`"
        )
    tensors, objects = model_tensors(chunks)
    problem = parameter_problem(chunks, sum(math.prod(shape) for shape, _ in stored.tensors.values()), path)
    problems = ([problem] if problem else []) + fit_problems(tensors, objects, stored)
    every_rank = _gathered((problems, sorted(tensors)))
    every = [p for rank_problems, _ in every_rank for p in rank_problems]
    lacking = sorted(set(stored.tensors) - {key for _, keys in every_rank for key in keys})
    if lacking:
        every.append(f"it stores {len(lacking)} tensors the model of config.json lacks (e.g. {lacking[:3]})")
    raise_on_every_rank(every, path, gathered=True)


def parameter_problem(chunks: list[torch.nn.Module], stored_elements: int, source: Path) -> str | None:
    """Why this rank's parameters cannot come from a checkpoint of ``stored_elements``, or None."""
    params = {id(p): p for chunk in chunks for p in chunk.parameters()}.values()
    elements = sum(p.numel() for p in params)
    if elements <= PARAMETER_SLACK * stored_elements:
        return None
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return (
        f"config.json describes a model whose parameters on this rank hold {elements:,} elements "
        f"({nbytes / 2**30:.3g} GiB), "
        f"but the checkpoint at {source} stores only {stored_elements:,} elements: the config does not describe these "
        "weights (check vocab_size, hidden_size, intermediate_size, the layer and head counts)"
    )


def raise_on_every_rank(problems: list[str], source: Path, *, gathered: bool = False) -> None:
    """Raise the same ``BadInput`` on every rank if any rank found a problem (a collective unless
    ``gathered``: ``problems`` are already every rank's, the same list on each)."""
    every = problems if gathered else [p for rank in _gathered(problems) for p in rank]
    if every:
        raise BadInput(
            f"the checkpoint at {source} does not match its config.json: {_joined(every)}. No weight was read or "
            "written. Fix config.json or use the checkpoint it belongs to"
        )


def _joined(problems: list[str]) -> str:
    unique = list(dict.fromkeys(problems))
    more = len(unique) - _SHOWN_PROBLEMS
    return "; ".join(unique[:_SHOWN_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")


def _gathered(obj: Any) -> list[Any]:
    """``obj`` of every rank (this one alone outside a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every
