"""Export plans written out by hand, for the tests and GPU checks of what moves a plan's bytes (test support).

``replicated_plan(*specs)`` is the plan of one trainer rank holding every tensor whole (TP = PP = EP = 1):
each ``(hf_name, shape, dtype)`` an entry, in order. The packed broadcast's wire, buffers and kernels depend
only on the entries' names, shapes, dtypes and order, so their tests and checks need no model.
"""

from __future__ import annotations

from mbridge_refit.plan.entries import ExportPlan, PlanEntry, TensorSharding

__all__ = ["replicated_plan"]


def replicated_plan(*specs: tuple[str, tuple[int, ...], str]) -> ExportPlan:
    """A TP1 plan of ``(hf_name, shape, dtype)`` entries, each its own Megatron parameter, replicated."""
    sharding = TensorSharding(
        mesh_dims=("tp",), mesh_shape=(1,), placements=("Replicate()",), pieces=((),), local_shape=()
    )
    entries = tuple(
        PlanEntry(
            hf_name=name,
            shape=shape,
            dtype=dtype,
            megatron_param=name,
            pp_rank=0,
            vpp_stage=0,
            is_expert=False,
            kind="x",
            sharding=sharding,
        )
        for name, shape, dtype in specs
    )
    return ExportPlan(entries=entries, layer_map={}, tp=1, pp=1, ep=1, vpp=1)
