"""Packed broadcast: pure layout/config logic here; the protocol on real ranks under torchrun.

The multi-rank checks run inside each rank (tests/ranks/packed_broadcast_check.py: the trainer
ranks of one layout + 1 receiver, CPU, gloo); the oracle is the source checkpoint on disk. One
launch per foundation layout covers: bucket smaller than the largest tensor, bucket larger than the model, a
mismatched plan and a mismatched config (clear error on every rank, no hang), an injected
checksum corruption, a failing receiver-side sink, and a clean transfer after those failures.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, free_port, torchrun

from mbridge_refit.engines.broadcast import wire as broadcast_wire
from mbridge_refit.engines.broadcast.packed import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_BYTES,
    PackedBroadcastConfig,
    PackedBroadcastSender,
    SendBuffers,
    StreamPacking,
    checksum,
    plan_fingerprint,
)
from mbridge_refit.plan.entries import ExportPlan
from mbridge_refit.testing.plans import replicated_plan

CHECKER = str(REPO / "tests" / "ranks" / "packed_broadcast_check.py")
TIMEOUT_S = 300  # a hang fails the test instead of blocking the suite


_plan = replicated_plan  # the tests here and those importing it


PLAN = _plan(
    ("a", (3,), "bfloat16"),
    ("b", (10, 7), "float32"),
    ("c", (0,), "bfloat16"),
    ("d", (5,), "int8"),
    ("e", (), "float32"),
)


# --- pure logic -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_bytes": 0}, "positive multiple of 16"),
        ({"bucket_bytes": 24}, "multiple of 16"),
        ({"num_buffers": 0}, "num_buffers"),
    ],
)
def test_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackedBroadcastConfig(**kwargs)


def test_config_default_is_512_mib_checksummed_and_frozen():
    config = PackedBroadcastConfig()
    assert config.bucket_bytes == DEFAULT_BUCKET_BYTES == 512 * 1024**2 and config.num_buffers == 2 and config.checksum
    with pytest.raises(AttributeError):
        config.bucket_bytes = 16  # type: ignore[misc]


def test_layout_aligns_every_tensor():
    layout = StreamPacking.build(PLAN, 32)
    assert [s.offset for s in layout.slots] == [0, 16, 304, 304, 320]  # c is empty
    assert all(s.offset % ALIGN_BYTES == 0 for s in layout.slots)
    assert layout.stream_bytes == 324 and layout.num_buckets == 11 and layout.bucket_length(10) == 4
    assert layout.max_split_bytes() == 280  # "b" straddles buckets; nothing larger does


@pytest.mark.parametrize("bucket", [16, 32, 48, 304, 320, 1024])
def test_bucket_events_cover_each_byte_once(bucket):
    layout = StreamPacking.build(PLAN, bucket)
    events = broadcast_wire.bucket_events(layout)
    covered = {s.entry.hf_name: 0 for s in layout.slots}
    completed = []
    for index, bucket_events in enumerate(events):
        for slot, within, start, length, complete in bucket_events:
            if slot.nbytes:
                assert within + length <= layout.bucket_length(index)
                assert index * bucket + within == slot.offset + start
            covered[slot.entry.hf_name] += length
            if complete:
                completed.append(slot.entry.hf_name)
    assert covered == {s.entry.hf_name: s.nbytes for s in layout.slots}
    assert completed == PLAN.names()


def test_fingerprint_sees_name_shape_dtype_and_order():
    base = plan_fingerprint(PLAN)
    changed = [
        _plan(("a", (3,), "bfloat16")),
        _plan(*[(e.hf_name + ("x" if i == 1 else ""), e.shape, e.dtype) for i, e in enumerate(PLAN.entries)]),
        _plan(*[(e.hf_name, (70,) if i == 1 else e.shape, e.dtype) for i, e in enumerate(PLAN.entries)]),
        _plan(*[(e.hf_name, e.shape, "float16" if i == 0 else e.dtype) for i, e in enumerate(PLAN.entries)]),
        _plan(*[(e.hf_name, e.shape, e.dtype) for e in reversed(PLAN.entries)]),
    ]
    assert all(plan_fingerprint(p) != base for p in changed)
    assert plan_fingerprint(ExportPlan.from_json(PLAN.to_json())) == base


@pytest.mark.parametrize("length", [64, 67])
def test_checksum_sees_one_byte(length):
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    before = int(checksum(data))
    for position in (0, 5, length - 1):
        corrupt = data.clone()
        corrupt[position] ^= 0x01
        assert int(checksum(corrupt)) != before


@pytest.mark.parametrize("length", [0, 8, 67, 4096 + 5])
def test_checksum_is_the_sum_of_eight_byte_words_modulo_2_64(length):
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    raw, words = bytes(data.tolist()), length // 8 * 8
    total = sum(int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, words, 8)) + sum(raw[words:])
    total = (total + 2**63) % 2**64 - 2**63  # as int64
    assert int(checksum(data)) == total
    slots = torch.zeros(3, dtype=torch.int64)
    broadcast_wire.checksum_into(data, slots[1])  # in place, into its slot
    assert slots.tolist() == [0, total, 0]
    if length > 1:
        assert int(checksum(data[1:])) == int(checksum(data[1:].clone()))  # a view at an odd offset


@pytest.mark.parametrize(("bucket", "buffers"), [(16, 2), (32, 3), (48, 2), (304, 2), (1024, 4)])
def test_send_buffers_place_every_byte_once(bucket, buffers):
    """Each tensor's pieces are views of buffer ``b % n`` at its offset in bucket ``b``; together they
    hold its bytes once. Made once: a second ``allocate`` keeps the same memory."""
    memory = SendBuffers(PLAN, PackedBroadcastConfig(bucket_bytes=bucket, num_buffers=buffers), "cpu")
    assert not memory.allocated and memory.expected[1] == ("b", (10, 7), torch.float32)
    memory.allocate()
    packing, count = memory.packing, len(memory.buffers)
    assert count == min(buffers, packing.num_buckets) and memory.sums.numel() == packing.num_buckets
    for slot, pieces in zip(packing.slots, memory.pieces):
        assert sum(length for _, _, _, length in pieces) == slot.nbytes
        for b, target, start, length in pieces:
            buffer = memory.buffers[b % count]
            assert target.data_ptr() - buffer.data_ptr() == slot.offset + start - b * bucket
            assert target.numel() == length and target.data_ptr() + length <= memory.data[b].data_ptr() + bucket
    pointers = [b.data_ptr() for b in memory.buffers]
    memory.allocate()
    assert [b.data_ptr() for b in memory.buffers] == pointers


def test_sender_refuses_buffers_of_another_plan_or_config():
    memory = SendBuffers(PLAN, PackedBroadcastConfig(bucket_bytes=32), "cpu")
    for plan, config in ((PLAN.to_json(), memory.config), (PLAN, PackedBroadcastConfig(bucket_bytes=64))):
        with pytest.raises(ValueError, match="made for another plan or config"):
            PackedBroadcastSender(plan, config, group=None, src=0, buffers=memory)


# --- real ranks -----------------------------------------------------------------------------


LAYOUT_CASES = [  # (recipe, trainer ranks, layout flags): every foundation layout, plus one receiver rank
    ("qwen3-tiny", 1, []),
    ("qwen3-tiny", 2, ["--tp", "2"]),
    ("qwen3-tiny", 2, ["--pp", "2"]),
    ("qwen3-tiny", 2, ["--pp", "2", "--vpp", "2"]),
    ("qwen3-tiny", 4, ["--tp", "2", "--pp", "2"]),
    ("qwen3-moe-tiny", 2, ["--ep", "2"]),
    ("qwen3-moe-tiny", 2, ["--tp", "2", "--ep", "2"]),
    ("qwen3-tiny", 2, ["--tp", "2", "--store-group", "PORT"]),  # the group joined by address (StoreGroup)
    ("qwen3-moe-tiny", 2, ["--tp", "2", "--etp", "2"]),  # Megatron's default expert-TP at TP2
]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("recipe", "trainers", "flags"),
    LAYOUT_CASES,
    ids=[
        "qwen3-tp1",
        "qwen3-tp2",
        "qwen3-pp2",
        "qwen3-pp2_vpp2",
        "qwen3-tp2_pp2",
        "qwen3-moe-ep2",
        "qwen3-moe-tp2_ep2",
        "qwen3-tp2-store_group",
        "qwen3-moe-tp2_etp2",
    ],
)
def test_packed_broadcast_ranks(recipe, trainers, flags, source_checkpoints, tmp_path):
    flags = [str(free_port()) if flag == "PORT" else flag for flag in flags]
    run = torchrun(
        trainers + 1,
        [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags],
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(trainers + 1)]
    trainer0, others, receiver = reports[0], reports[1:-1], reports[-1]
    stream = receiver["stream_bytes"]

    for case in ("split", "whole", "again"):  # clean transfers: bit for bit, in order, in place
        for rank, report in enumerate(reports):
            assert report[case]["ok"], f"{case} failed on rank {rank}: {report[case].get('trace')}"
        got = receiver[case]
        assert got["in_order"] and got["differing_from_disk"] == [] and got["differing_from_pretrained"] == []
        assert got["pointers_kept"], "the receiver's transformers model was re-allocated"
        assert trainer0[case]["bytes_sent"] >= stream["value"] and all(t[case]["bytes_sent"] == 0 for t in others)
    assert (
        receiver["split"]["bucket_bytes"] < stream["largest"] and receiver["split"]["split_bytes"] == stream["largest"]
    )
    assert receiver["split"]["buckets"] > 3
    assert receiver["whole"]["bucket_bytes"] > stream["value"] and receiver["whole"]["buckets"] == 1

    for case in ("mismatch", "config", "corrupt", "consumer"):  # every rank fails, none hangs
        assert not any(r[case]["ok"] for r in reports), case
        assert all(r[case]["seconds"] < 30 for r in reports), case

    mismatch = receiver["mismatch"]["error"]
    assert (
        mismatch.startswith("PlanMismatchError")
        and "sender fingerprint 0x" in mismatch
        and "receiver fingerprint 0x" in mismatch
    )
    assert "first differing entry #7" in mismatch and ".renamed" in mismatch
    assert (
        trainer0["mismatch"]["error"].startswith("PlanMismatchError")
        and "first differing entry #7" in trainer0["mismatch"]["error"]
    )
    for trainer in others:
        assert (
            trainer["mismatch"]["error"].startswith("RefitStatusError")
            and "PlanMismatchError" in trainer["mismatch"]["error"]
        )

    assert "bucket_bytes: sender" in receiver["config"]["error"]
    assert "PackedBroadcastConfig differs" in trainer0["config"]["error"]

    corrupt = receiver["corrupt"]["error"]
    assert corrupt.startswith("ChecksumError") and "buffer 1 of" in corrupt and "held tensors ['" in corrupt
    for trainer in (trainer0, *others):
        assert "checksum mismatch in buffer 1" in trainer["corrupt"]["error"]

    assert receiver["consumer"]["error"].startswith("ValueError: test consumer rejects")
    for trainer in (trainer0, *others):
        assert "consumer failed" in trainer["consumer"]["error"]


REPLICA_CASES = {
    "dp2_tp2": ("qwen3-tiny", ["--tp", "2"]),
    "dp2_pp2": ("qwen3-tiny", ["--pp", "2"]),
    "dp2_tp2_ep2": ("qwen3-moe-tiny", ["--tp", "2", "--ep", "2"]),
    "dp2_pp2_vpp2": ("qwen3-tiny", ["--pp", "2", "--vpp", "2"]),
    "cp2_tp2": ("qwen3-tiny", ["--tp", "2", "--cp", "2"]),  # one replica of 4 ranks: every rank exports, rank 0 sends
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", list(REPLICA_CASES))
def test_packed_broadcast_from_one_replica(case, source_checkpoints, tmp_path):
    """4 trainer ranks holding 2 data-parallel replicas (or one CP2 x TP2 replica) + 1 receiver:
    replica 0 exports, rank 0 is the only sender, replica 1 does no export work; the receiver's
    bytes equal the checkpoint."""
    recipe, flags = REPLICA_CASES[case]
    run = torchrun(
        5, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags], timeout=TIMEOUT_S
    )
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(5)]
    exporting = reports[0]["replica_ranks"] or [0, 1, 2, 3]  # None: no data-parallel replicas, all export
    assert 0 in exporting and len(exporting) == (4 if case == "cp2_tp2" else 2), exporting
    idle = [reports[r] for r in range(4) if r not in exporting]
    busy = [reports[r] for r in exporting]
    receiver, stream = reports[-1], reports[-1]["stream_bytes"]
    for case_name in ("split", "whole", "again"):
        got = receiver[case_name]
        assert got["ok"] and got["in_order"] and got["differing_from_disk"] == [] and got["pointers_kept"], got
        assert [r[case_name]["sender"] for r in busy].count(True) == 1 and reports[0][case_name]["sender"]
        assert reports[0][case_name]["bytes_sent"] >= stream["value"]
        assert all(r[case_name]["bytes_sent"] == 0 for r in reports[1:4])
        assert all(r[case_name]["ok"] and r[case_name]["tensors"] == 0 and not r[case_name]["sender"] for r in idle)
    for case_name in (
        "mismatch",
        "config",
        "corrupt",
        "consumer",
    ):  # the exporting ranks and the receiver fail, none hangs
        assert not any(r[case_name]["ok"] for r in [*busy, receiver]), case_name
        assert all(r[case_name]["seconds"] < 30 for r in reports), case_name
