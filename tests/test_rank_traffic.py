"""``runtime.rank_traffic`` against a real export, rank by rank.

Every rank of a tiny model's layout is visited in this process (``testing.simulated_ranks``: the
fake backend, Megatron's real parallel state): the plan is assembled from every rank's
contribution, then each rank runs ``PlanExporter.export`` on CPU with its collectives counted
where the exporter issues them (``gather_into``, ``broadcast_from``: bytes received, bytes sent)
and the copies it makes counted as aten ops (a ``TorchDispatchMode``: the bytes written by
``copy_``, ``index_select``, ``stack``, ``cat``, ``clone``). The counts must equal what
``rank_traffic`` reads from the plan, field by field, on every rank: the estimate of
``scripts/simulate_plan.py`` cannot drift from what the exporter does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mbridge_refit.plan.layout import ParallelLayout

# (architecture, layout): pipeline broadcasts with experts over EP; expert-TP and MLA; stacked experts.
CASES = (
    ("Qwen3MoeForCausalLM", ParallelLayout(tp=2, pp=2, ep=2)),
    ("DeepseekV3ForCausalLM", ParallelLayout(tp=2, pp=2, ep=2, etp=2)),
    ("GptOssForCausalLM", ParallelLayout(tp=2, ep=2)),
)
_COPIES = frozenset({"copy_", "index_select", "stack", "cat", "clone", "_to_copy"})


class CopiedBytes(TorchDispatchMode):
    """Bytes written by the aten copies run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and func.__name__.split(".")[0] in _COPIES and isinstance(out, torch.Tensor):
            self.nbytes += out.numel() * out.element_size()
        return out


class CountedCollectives:
    """The exporter's gathers and broadcasts, counted on their way to the (fake) group."""

    def __init__(self, monkeypatch, pp_rank: int) -> None:
        from mbridge_refit.runtime import exporter

        self.counts = dict.fromkeys(
            ("gathered_bytes", "broadcast_received_bytes", "broadcast_sent_bytes", "gathers", "broadcasts"), 0
        )
        gather_into, broadcast_from = exporter.gather_into, exporter.broadcast_from

        def counted_gather(out, local, group, size):
            self.counts["gathers"] += 1
            self.counts["gathered_bytes"] += (out.numel() - local.numel()) * out.element_size()
            gather_into(out, local, group, size)

        def counted_broadcast(tensor, group, group_rank):
            self.counts["broadcasts"] += 1
            side = "broadcast_sent_bytes" if group_rank == pp_rank else "broadcast_received_bytes"
            self.counts[side] += tensor.numel() * tensor.element_size()
            broadcast_from(tensor, group, group_rank)

        monkeypatch.setattr(exporter, "gather_into", counted_gather)
        monkeypatch.setattr(exporter, "broadcast_from", counted_broadcast)

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)


def _ranks_and_plan(architecture: str, layout: ParallelLayout):
    """Every rank's (chunks, bridge, tasks) of the tiny model at ``layout``, and the plan."""
    from mbridge_refit.plan.build import assemble_plan, current_sizes, rank_contribution
    from mbridge_refit.testing.simulated_ranks import build_rank_model, enter_rank, global_param_names
    from mbridge_refit.testing.tiny_models import tiny_config

    config = tiny_config(architecture)
    enter_rank(ParallelLayout(), 0)
    names = global_param_names(*build_rank_model(config, ParallelLayout(), materialize=False))
    ranks, contributions = [], []
    for rank in range(layout.expected_world_size):
        enter_rank(layout, rank)
        bridge, chunks = build_rank_model(config, layout, materialize=True)
        model_bridge = bridge.megatron_model_bridge(chunks)
        model_bridge._cached_param_names = names  # the pipeline name exchange a fake group cannot run
        tasks = model_bridge.build_conversion_tasks(bridge.hf_pretrained, chunks)
        contributions.append(rank_contribution(model_bridge, bridge.hf_pretrained, chunks, tasks))
        ranks.append((chunks, tasks))
    plan = assemble_plan(contributions, current_sizes(chunks), chunks[0].config, model_bridge, bridge.hf_pretrained)
    return ranks, plan


def _exported(plan, params, collectives: CountedCollectives) -> dict[str, int]:
    """A steady export's counts on this rank (the second export: views and buffers made by the first)."""
    from mbridge_refit.runtime.buffers import ExportBuffers
    from mbridge_refit.runtime.exporter import PlanExporter

    exporter = PlanExporter(plan=plan, params=params, device=torch.device("cpu"))
    buffers = ExportBuffers(persistent=True)
    for _ in exporter.export(buffers):
        pass
    collectives.reset()
    with CopiedBytes() as copied:
        yielded = sum(1 for _ in exporter.export(buffers))
    return dict(collectives.counts, tensors_yielded=yielded, local_copy_bytes=copied.nbytes)


@pytest.fixture
def simulated_world():
    from mbridge_refit.testing.simulated_ranks import leave_rank

    yield
    leave_rank()


@pytest.mark.parametrize(("architecture", "layout"), CASES, ids=[f"{a}-{lay.name}" for a, lay in CASES])
def test_rank_traffic_is_what_each_rank_exports(architecture, layout, monkeypatch, simulated_world):
    from mbridge_refit.runtime.collectives import current_groups
    from mbridge_refit.runtime.live_params import LiveParams
    from mbridge_refit.runtime.rank_traffic import rank_traffic
    from mbridge_refit.testing.simulated_ranks import enter_rank

    ranks, plan = _ranks_and_plan(architecture, layout)
    seen = dict.fromkeys(("local_copy_bytes", "gathered_bytes", "broadcast_received_bytes"), 0)
    for rank, (chunks, tasks) in enumerate(ranks):
        enter_rank(layout, rank)
        groups = current_groups()
        params = LiveParams(chunks, tasks).params
        estimated = rank_traffic(plan, groups, params).as_dict()
        exported = _exported(plan, params, CountedCollectives(monkeypatch, groups.pp_rank))
        assert exported == {key: estimated[key] for key in exported}, f"rank {rank}"
        assert estimated["tensors_yielded"] == len(plan.entries)
        assert estimated["views"] <= estimated["tensors_built"] <= len(plan.entries)
        seen = {key: total + exported[key] for key, total in seen.items()}
    # the counters count: every layout copies and gathers, and one with stages broadcasts
    assert seen["local_copy_bytes"] and seen["gathered_bytes"]
    assert bool(seen["broadcast_received_bytes"]) == (layout.pp > 1)
