"""The decision logic of ``runtime.param_sync`` on CPU, with stand-ins for Megatron DDP's bucket groups.

Megatron's DDP with the distributed optimizer needs CUDA (its buffers and type checks), so the
real thing runs on the GPU host: ``scripts/check_ddp_export_gpu.py`` (two data-parallel ranks,
``overlap_param_gather`` on and off, against the optimizer's own main parameters) and
``tests/test_gpu.py::test_export_right_after_a_ddp_step``. Here: which bucket groups count as
pending, that each is completed once with ``force_sync=True``, and that models without deferred
gathers are left alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mbridge_refit.runtime.param_sync import deferred_gather_groups, finish_pending_param_gathers


class BucketGroup:
    def __init__(self, dispatched: bool, in_flight: bool) -> None:
        self.param_gather_dispatched, self.param_gather_handle = dispatched, (object() if in_flight else None)
        self.calls: list[dict] = []

    def start_param_sync(self, **kwargs) -> None:  # what Megatron's force_sync leaves behind
        self.calls.append(kwargs)
        self.param_gather_dispatched, self.param_gather_handle = True, None


def ddp_chunk(overlap: bool, groups: list, expert_groups: list = ()) -> torch.nn.Module:
    chunk = torch.nn.Linear(2, 2)
    chunk.ddp_config = SimpleNamespace(overlap_param_gather=overlap, use_distributed_optimizer=True)
    chunk.bucket_groups, chunk.expert_parallel_bucket_groups = list(groups), list(expert_groups)
    return chunk


def test_pending_groups_are_completed_once_and_only_they():
    after_step = BucketGroup(dispatched=False, in_flight=False)  # deferred to the next forward
    in_flight = BucketGroup(dispatched=True, in_flight=True)  # dispatched by a hook, not waited for
    done = BucketGroup(dispatched=True, in_flight=False)
    expert = BucketGroup(dispatched=False, in_flight=False)
    chunks = [ddp_chunk(True, [after_step, in_flight, done], [expert])]
    assert deferred_gather_groups(chunks) == [after_step, in_flight, expert]
    assert finish_pending_param_gathers(chunks) == 3
    assert [g.calls for g in (after_step, in_flight, done, expert)] == [
        [{"force_sync": True}],
        [{"force_sync": True}],
        [],
        [{"force_sync": True}],
    ]
    assert finish_pending_param_gathers(chunks) == 0  # nothing left: a second export gathers nothing


def test_models_without_deferred_gathers_are_left_alone():
    synchronous = BucketGroup(dispatched=False, in_flight=False)
    chunks = [ddp_chunk(False, [synchronous]), torch.nn.Linear(2, 2)]  # no overlap; a plain module
    assert finish_pending_param_gathers(chunks) == 0 and synchronous.calls == []
