"""A tiny MoE model whose tensor count is a parameter: the host-work checks and benchmarks that tell
work per tensor from work per step build it at two expert counts (``tests/ranks/host_work_check.py``,
``tests/ranks/ipc_host_work_check.py``, ``scripts/bench_ipc_host.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mbridge_refit.bridge import RefitBridge

__all__ = ["many_expert_model"]


def many_expert_model(experts: int, *, device: torch.device | None = None) -> tuple[RefitBridge, list[torch.nn.Module]]:
    """The ``qwen3-moe-tiny`` recipe with ``experts`` routed experts: its bridge (from the config: no
    checkpoint, random bf16 weights) and its Megatron model, built on this rank at TP1 (call inside a
    distributed session of one rank)."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models import recipes
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout

    config = recipes.get_model_recipe("qwen3-moe-tiny").to_hf_config()
    config.num_experts = experts
    config.architectures = ["Qwen3MoeForCausalLM"]
    bridge = RefitBridge.from_hf_config(config)
    options = BuildOptions(device=device or torch.device("cpu"), params_dtype=torch.bfloat16)
    return bridge, build_model(bridge, ParallelLayout(), options)
