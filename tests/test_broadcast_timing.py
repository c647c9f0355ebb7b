"""Where a packed broadcast's time goes (``engines.broadcast.timing``): the phases computed from marks,
and both ends marking every bucket of a real transfer (CPU, gloo, two threads; on CUDA the same marks
are events, which the GPU benchmark reads: scripts/bench_refit_vllm_broadcast.py).
"""

from __future__ import annotations

import pytest
import torch
from conftest import free_port
from test_broadcast_faults import CONFIG, PLAN, SECRET, Bridge, Engine, InProcessLLM, plan_tensors, run_members

from mbridge_refit.engines.broadcast.group import StoreGroup
from mbridge_refit.engines.broadcast.packed import (
    PackedBroadcastConfig,
    PackedBroadcastReceiver,
    PackedBroadcastSender,
    SendBuffers,
    StreamPacking,
)
from mbridge_refit.engines.broadcast.timing import BucketTimeline, receiver_phases, source_phases


def test_source_phases_from_marks():
    marks = {
        "device": {
            "free": [0.0, 0.6, 2.0],
            "packed": [0.5, 1.0, 2.5],
            "summed": [0.6, 1.1, 2.6],
            "sent": [1.5, 3.0, 4.0],
        }
    }
    phases = source_phases(marks)
    assert phases["pack"] == [0.5, 0.4, 0.5]
    assert phases["checksum"] == [0.1, 0.1, 0.1]
    assert phases["buffer_wait"] == [0.0, 0.0, 0.9]  # bucket 2 waited for bucket 0's broadcast
    assert phases["broadcast"] == [1.0, 1.5, 1.0]  # from max(packed, the broadcast before) to sent


def test_receiver_phases_from_marks():
    marks = {
        "device": {
            "landed": [1.0, 2.0, 3.5],
            "summed": [1.1, 2.1, 3.6],
            "consumed": [1.5, 2.5, 4.0],
            "received": [1.0, 2.0, 3.5],
        }
    }
    phases = receiver_phases(marks, 2)
    assert phases["checksum"] == [0.1, 0.1, 0.1]
    assert phases["consume"] == [0.5, 0.5, 0.5]  # from landed: the checksum runs beside the consumer
    assert phases["data_wait"] == [1.0, 0.5, 1.0]
    assert phases["broadcast"] == [1.0, 1.0, 1.5]  # bucket 2 could start once bucket 0 was consumed (1.5)
    marks["device"]["summed"][0] = 2.3  # summed after it was consumed: the buffer is posted after both
    late = receiver_phases(marks, 2)
    assert late["broadcast"] == [1.0, 1.0, 1.2]
    assert late["data_wait"] == [1.0, 0.0, 1.0]  # bucket 1 landed while bucket 0 was still being summed


@pytest.mark.parametrize("checksum", [True, False])
def test_both_ends_mark_every_bucket(checksum):
    config = PackedBroadcastConfig(bucket_bytes=64, num_buffers=2, checksum=checksum)
    buckets = StreamPacking.build(PLAN, config.bucket_bytes).num_buckets
    port, timelines, groups = free_port(), {}, {}

    def join(rank: int) -> StoreGroup:
        groups[rank] = StoreGroup(host="127.0.0.1", port=port, rank=rank, world_size=2, device="cpu", secret=SECRET)
        timelines[rank] = BucketTimeline("cpu")
        return groups[rank]

    def send(rank: int):
        memory = SendBuffers(PLAN, config, "cpu")
        sender = PackedBroadcastSender(PLAN, config, group=join(rank), src=0, buffers=memory, timeline=timelines[0])
        for name, tensor in plan_tensors(PLAN):
            sender.consume(name, tensor)
        sender.finish()

    def receive(rank: int):
        receiver = PackedBroadcastReceiver(PLAN, config, group=join(rank), src=0, device="cpu", timeline=timelines[1])
        return [(name, tensor.clone()) for name, tensor in receiver.receive()]

    (sent, _), (received, _) = run_members(send, receive)
    for group in groups.values():
        group.close()
    assert sent is None and all(torch.equal(a, b) for (_, a), (_, b) in zip(received, plan_tensors(PLAN)))
    source, receiver = timelines[0].summary(), timelines[1].summary()
    summed = ["summed"] if checksum else []
    assert sorted(source["device"]) == sorted(["free", "packed", *summed])  # no "sent" on CPU: gloo's own threads
    assert sorted(receiver["device"]) == sorted(["landed", "consumed", *summed])
    for marks in (source, receiver):
        assert all(len(each) == buckets and None not in each for each in marks["device"].values()), marks
        assert len(marks["host"]["issued"]) == buckets and marks["host"]["handshake"] <= marks["host"]["status"]
    assert all(len(each) == buckets for each in source_phases(source).values() if each)
    assert all(len(each) == buckets for each in receiver_phases(receiver, 2).values() if each)


def test_a_timed_session_returns_both_ends_phases():
    """``VLLMBroadcastRefit(timing=True)`` and the worker's ``BroadcastTarget.timing``: the step carries
    the source's marks and phases, the worker's report its own, one value per bucket."""
    from mbridge_refit.engines.vllm import VLLMBroadcastRefit

    llm, chunks, bridge = InProcessLLM(Engine()), [torch.nn.Linear(1, 1)], Bridge()
    refit = VLLMBroadcastRefit(
        llm, host="127.0.0.1", port=free_port(), backend="gloo", device="cpu", config=CONFIG, timing=True
    )
    refit.open(bridge, chunks)
    llm.worker._mbridge_broadcast_target.timing = True
    try:
        step = refit.refit(bridge, chunks)
    finally:
        refit.close()
    buckets = StreamPacking.build(PLAN, CONFIG.bucket_bytes).num_buckets
    engine = step.workers[0]["phases"]
    assert set(step.phases["phases"]) == {"pack", "checksum", "buffer_wait"}
    assert set(engine["phases"]) == {"checksum", "consume", "data_wait"}
    for phases in (step.phases["phases"], engine["phases"]):
        assert all(len(each) == buckets for each in phases.values()), phases
    assert len(step.phases["host"]["issued"]) == len(engine["host"]["issued"]) == buckets
