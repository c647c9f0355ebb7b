"""One rank of a parallel layout in this process, without the other ranks (``torch.distributed``'s
"fake" backend: rank R of WORLD, every collective a no-op) and with Megatron's real parallel state.

``scripts/simulate_plan.py`` builds each rank of a layout too large for this machine this way, in
a process per rank, on the meta device; ``tests/test_rank_traffic.py`` visits the ranks of a tiny
model's layout one after another in one process and runs each rank's export.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mbridge_refit.plan.layout import ParallelLayout

__all__ = ["build_rank_model", "enter_rank", "global_param_names", "leave_rank"]


def enter_rank(layout: ParallelLayout, rank: int) -> None:
    """Make this process rank ``rank`` of ``layout`` (its smallest world), leaving the rank it was."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    leave_rank()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.expected_world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,  # uneven stages are a model setting (configure_provider), not a group one
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=False,
    )


def leave_rank() -> None:
    """Drop Megatron's parallel state and the process group, if any."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def build_rank_model(hf_config: Any, layout: ParallelLayout, *, materialize: bool) -> tuple[Any, list[torch.nn.Module]]:
    """This rank's bridge and model chunks of ``hf_config`` at ``layout``, in bfloat16, built for
    weights only (the plan never runs a forward: Megatron's few CUDA-device queries answer the CPU,
    which a model with YaRN RoPE, DeepSeek-V3's MLA, needs to be built without a driver at all);
    on the meta device unless ``materialize``."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models.builder import BuildOptions, build_model

    bridge = RefitBridge.from_hf_config(hf_config)
    options = BuildOptions(
        device=torch.device("cpu"), params_dtype=torch.bfloat16, materialize=materialize, weights_only=True
    )
    return bridge, build_model(bridge, layout, options)


def global_param_names(bridge: Any, chunks: list[torch.nn.Module]) -> list[str]:
    """The global parameter names of every pipeline stage (what Megatron-Bridge exchanges over the
    pipeline group; a fake group cannot): read from a whole model (TP1, this process rank 0 of 1)."""
    return bridge.megatron_model_bridge(chunks)._megatron_global_param_names_all_pp_ranks(chunks)
