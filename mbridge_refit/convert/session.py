"""Process groups: start and stop torch.distributed and Megatron's model-parallel state.

This is the one module that reads the launcher's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` set by ``torchrun``; ``EXIT_RECORDS_VARIABLE`` set by ``convert --nproc-per-node``).
CPU runs use gloo; GPU runs use NCCL with one device per local rank. A plain ``python -m ...`` without torchrun gets a one-process group, so the same
code path serves one process and N ranks.
torch and Megatron are imported by the functions that start them: ``LaunchEnv`` (read by the
CLI's entry point before any command runs) costs no torch import.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from mbridge_refit.plan.layout import ParallelLayout

if TYPE_CHECKING:
    import torch

__all__ = [
    "EXIT_RECORDS_VARIABLE",
    "LaunchEnv",
    "default_device",
    "distributed_session",
    "init_model_parallel",
    "init_process_group",
    "teardown",
]

logger = logging.getLogger(__name__)

# Set by ``convert --nproc-per-node`` for its ranks (``convert.launcher``): a directory for their exit codes.
EXIT_RECORDS_VARIABLE = "MBRIDGE_REFIT_EXIT_RECORDS"


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchEnv:
    """What the launcher told this process (torchrun's variables, or a single process)."""

    rank: int
    world_size: int
    local_rank: int
    exit_records: str | None = None  # where ``convert --nproc-per-node`` collects its ranks' exit codes

    @property
    def launched_by_torchrun(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ

    @classmethod
    def from_environ(cls) -> "LaunchEnv":
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            exit_records=os.environ.get(EXIT_RECORDS_VARIABLE) or None,
        )


def default_device(prefer_gpu: bool = True) -> torch.device:
    """``cuda`` when a GPU is present (and wanted), else ``cpu``."""
    import torch

    return torch.device("cuda") if prefer_gpu and torch.cuda.is_available() else torch.device("cpu")


def init_process_group(
    *, device: torch.device, timeout: datetime.timedelta = datetime.timedelta(minutes=10)
) -> LaunchEnv:
    """Initialise the default process group for this launch (idempotent).

    gloo on CPU, NCCL on GPU. ``timeout`` bounds every collective, so a rank whose peer died
    raises instead of waiting forever.
    """
    import torch
    import torch.distributed as dist

    env = LaunchEnv.from_environ()
    if dist.is_initialized():
        return env
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    if env.launched_by_torchrun:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    logger.debug("process group ready: backend=%s rank=%d world=%d", backend, env.rank, env.world_size)
    return env


def init_model_parallel(layout: ParallelLayout, *, seed: int = 0) -> None:
    """Create Megatron's model-parallel groups for ``layout`` (the default group must exist); the
    ranks beyond one replica (``layout.model_parallel_size``) become data-parallel replicas.

    Seeds the CPU generator as Megatron's own initialisation does (``_set_random_seed``: ``seed``
    plus 100 per pipeline stage, the same on every tensor-, data- and context-parallel rank of a
    stage). Megatron initialises router weights on the CPU: seeded alike they are equal across
    tensor-parallel ranks, as in training, and a transfer may take any rank's copy. With NCCL,
    also seeds Megatron's CUDA RNG tracker from the same number (Transformer Engine layers draw
    their initialisation from it).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    layout.validate_world_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.pp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()  # as Megatron's _set_random_seed
    torch.manual_seed(stage_seed)
    if dist.get_backend() == "nccl":
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def teardown() -> None:
    """Destroy Megatron's groups and the default process group, if they exist."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_session(
    layout: ParallelLayout, *, device: torch.device, timeout: datetime.timedelta = datetime.timedelta(minutes=10)
) -> Iterator[LaunchEnv]:
    """Process group + model-parallel groups for the duration of the block, torn down after
    (``timeout`` bounds every collective, as in ``init_process_group``)."""
    env = init_process_group(device=device, timeout=timeout)
    try:
        init_model_parallel(layout)
        yield env
    finally:
        teardown()
