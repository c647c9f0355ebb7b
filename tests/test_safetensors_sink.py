"""Tests for the sink contract (`drain`) and the sharded safetensors writer.

The checkpoint on disk is read back through safetensors' own reader (`HFCheckpoint`), never
through writer internals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.elastic.utils.distributed import get_free_port as _free_port

from mbridge_refit.checkpoints.hf import HFCheckpoint
from mbridge_refit.sinks import (
    INDEX_NAME,
    ShardedSafetensorsWriter,
    WeightSink,
    drain,
    plan_shards,
    shard_file_name,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _tensors() -> list[tuple[str, torch.Tensor]]:
    """A small mixed-dtype stream: sizes 0..256 bytes, 0-d and 1-d, a non-contiguous view."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=g)
    return [
        ("embed.weight", torch.randn(4, 8, generator=g).to(torch.bfloat16)),  # 64 B
        ("layers.0.w", torch.randn(16, generator=g)),  # 64 B
        ("layers.0.scalar", torch.tensor(3.5, dtype=torch.float32)),  # 0-d, 4 B
        ("layers.0.ids", torch.arange(-5, 27, dtype=torch.int64)),  # 256 B
        ("layers.0.bias", torch.randn(1, generator=g).to(torch.bfloat16)),  # 1-d, 2 B
        ("layers.0.transposed", base.t()),  # non-contiguous, 192 B
        ("layers.0.view", base[2:4, 1:5]),  # offset view, 32 B
        ("layers.0.fp8", torch.randn(8, generator=g).to(torch.float8_e4m3fn)),  # 8 B
        ("layers.0.mask", torch.tensor([True, False, True])),  # 3 B
        ("empty", torch.zeros(0, 4, dtype=torch.float16)),  # 0 B
        ("norm.weight", torch.full((40,), float("nan"))),  # 160 B
    ]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _write(out_dir: Path, stream, **kwargs) -> Path:
    drain(iter(stream), ShardedSafetensorsWriter(out_dir=out_dir, **kwargs))
    return out_dir


def _bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    x, y = x.contiguous().reshape(-1), y.contiguous().reshape(-1)
    return x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))


# -- shard plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "limit", "expected"),
    [
        ([10, 10, 10], 30, [0, 0, 0]),
        ([10, 10, 10], 29, [0, 0, 1]),
        ([10, 10, 10], 20, [0, 0, 1]),
        ([10, 10, 10], 5, [0, 1, 2]),
        ([10, 50, 10], 20, [0, 1, 2]),  # oversized tensor gets its own shard
        ([50, 10], 20, [0, 1]),
        ([10, 50], 20, [0, 1]),
        ([0, 0, 10, 0], 10, [0, 0, 0, 0]),
        ([], 10, []),
    ],
)
def test_plan_shards_greedy_fill(sizes, limit, expected):
    assert plan_shards(sizes, max_shard_bytes=limit) == expected


def test_plan_shards_rejects_non_positive_limit():
    with pytest.raises(ValueError, match="max_shard_bytes"):
        plan_shards([1], max_shard_bytes=0)


def test_shard_file_name_is_hf_style():
    assert shard_file_name(0, 3) == "model-00001-of-00003.safetensors"
    assert shard_file_name(11, 12) == "model-00012-of-00012.safetensors"


# -- layout on disk ------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 64, 100, 256, 300, 10**9])
def test_files_follow_the_plan(tmp_path, limit):
    stream = _tensors()
    plan = plan_shards([_nbytes(t) for _, t in stream], max_shard_bytes=limit)
    num_shards = plan[-1] + 1
    out = _write(tmp_path / "out", stream, max_shard_bytes=limit)

    files = sorted(p.name for p in out.iterdir())
    expected_files = sorted(shard_file_name(k, num_shards) for k in range(num_shards))
    assert files == sorted([*expected_files, INDEX_NAME])
    for k, file_name in enumerate(expected_files):
        expected_names = {name for (name, _), shard in zip(stream, plan) if shard == k}
        with safe_open(out / file_name, framework="pt") as f:
            assert set(f.keys()) == expected_names
            assert f.metadata() == {"format": "pt"}
        shard_bytes = sum(_nbytes(t) for (name, t) in stream if name in expected_names)
        assert shard_bytes <= limit or len(expected_names) == 1


def test_oversized_tensor_gets_its_own_shard(tmp_path):
    stream = [("a", torch.zeros(4)), ("big", torch.zeros(100)), ("b", torch.zeros(4))]
    out = _write(tmp_path / "out", stream, max_shard_bytes=32)
    ckpt = HFCheckpoint.open(out)
    assert ckpt.weight_map == {
        "a": "model-00001-of-00003.safetensors",
        "big": "model-00002-of-00003.safetensors",
        "b": "model-00003-of-00003.safetensors",
    }


def test_index_contents(tmp_path):
    stream = _tensors()
    out = _write(tmp_path / "out", stream, max_shard_bytes=100)
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(_nbytes(t) for _, t in stream)
    assert set(index["weight_map"]) == {name for name, _ in stream}
    files = set(index["weight_map"].values())
    num_shards = len(files)
    assert files == {shard_file_name(k, num_shards) for k in range(num_shards)}
    assert all((out / f).is_file() for f in files)


def test_single_shard_still_uses_index_naming(tmp_path):
    out = _write(tmp_path / "out", [("w", torch.ones(2))])
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00001.safetensors",
        INDEX_NAME,
    ]


def test_creates_missing_parents(tmp_path):
    out = _write(tmp_path / "a" / "b" / "out", [("w", torch.ones(2))])
    assert (out / INDEX_NAME).is_file()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_shard_files_get_the_mode_config_json_gets(tmp_path, umask):
    """safetensors' ``save_file`` writes 0o600: the shards get what ``open()`` gives the
    checkpoint's other files (``config.json``, the index) under this umask, 0o666 less it."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    old = os.umask(umask)
    try:
        out = _write(tmp_path / "out", _tensors(), max_shard_bytes=200, copy_files_from=source)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert len([name for name in modes if name.endswith(".safetensors")]) > 1, modes
    assert set(modes.values()) == {0o666 & ~umask}, {name: oct(mode) for name, mode in modes.items()}


def test_make_tiny_shards_get_the_mode_config_json_gets(tmp_path):
    from mbridge_refit.models import recipes

    old = os.umask(0o022)
    try:
        out = recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), tmp_path / "tiny", seed=0)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {"0o644"} and "model.safetensors" in modes, modes


# -- data ----------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 128, 10**9])
def test_round_trip_is_bitwise(tmp_path, limit):
    stream = _tensors()
    out = _write(tmp_path / "out", stream, max_shard_bytes=limit)
    ckpt = HFCheckpoint.open(out)
    assert ckpt.names() == sorted(name for name, _ in stream)
    for name, expected in stream:
        got = ckpt.tensor(name)
        assert got.dtype == expected.dtype == ckpt.dtype(name)
        assert got.shape == expected.shape and ckpt.shape(name) == tuple(expected.shape)
        assert _bitwise_equal(got, expected), name


def test_sink_copies_the_buffer(tmp_path):
    """The exporter may reuse one buffer for every tensor: each output keeps its own value."""
    buffer = torch.zeros(4)

    def reused_buffer_stream():
        for i in range(3):
            buffer.fill_(float(i))
            yield f"w{i}", buffer

    out = _write(tmp_path / "out", reused_buffer_stream(), max_shard_bytes=32)
    buffer.fill_(-1.0)
    ckpt = HFCheckpoint.open(out)
    for i in range(3):
        assert torch.equal(ckpt.tensor(f"w{i}"), torch.full((4,), float(i)))


def test_mutating_source_after_consume_keeps_old_value(tmp_path):
    source = torch.arange(6, dtype=torch.float32)
    writer = ShardedSafetensorsWriter(out_dir=tmp_path / "out")
    writer.consume("w", source)
    source.mul_(100)
    writer.finish()
    assert torch.equal(HFCheckpoint.open(tmp_path / "out").tensor("w"), torch.arange(6.0))


# -- out dir rules -------------------------------------------------------------------------


def test_non_empty_out_dir_without_overwrite_raises_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=r"overwrite=True.*--overwrite") as info:
        ShardedSafetensorsWriter(out_dir=out)
    assert str(out) in str(info.value)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_empty_existing_out_dir_is_fine(tmp_path):
    (tmp_path / "out").mkdir()
    out = _write(tmp_path / "out", [("w", torch.ones(2))])
    assert (out / INDEX_NAME).is_file()


def test_overwrite_replaces_old_shards(tmp_path):
    out = _write(tmp_path / "out", _tensors(), max_shard_bytes=64)
    assert len(list(out.glob("*.safetensors"))) > 2
    (out / "notes.txt").write_text("keep")
    (out / ".tmp-model-00009.safetensors").write_bytes(b"stale")

    _write(out, [("w", torch.ones(2))], overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "model-00001-of-00001.safetensors",
        INDEX_NAME,
        "notes.txt",
    ]
    assert HFCheckpoint.open(out).names() == ["w"]


def test_abort_leaves_no_temp_or_partial_files(tmp_path):
    def failing_stream():
        yield from _tensors()[:5]  # several shards already written under temp names
        raise RuntimeError("gather failed")

    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="gather failed"):
        _write(out, failing_stream(), max_shard_bytes=64)
    assert list(tmp_path.iterdir()) == [], "the output this write created goes with its staging directory"


def test_abort_keeps_files_it_did_not_write(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")

    def failing_stream():
        yield "w", torch.ones(100)
        yield "v", torch.ones(100)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _write(out, failing_stream(), max_shard_bytes=64, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_an_interrupt_after_the_swap_keeps_the_new_checkpoint_and_says_so(tmp_path, caplog, monkeypatch):
    # SIGINT in the last barrier, after rank 0 swapped the new checkpoint in, logged "aborted ... removed"
    out = tmp_path / "out"
    writer = ShardedSafetensorsWriter(out_dir=out, max_shard_bytes=64)
    barriers = {"count": 0}
    ranks = type(writer._ranks)
    barrier = ranks.barrier

    def interrupted_last_barrier(self):
        barriers["count"] += 1
        if barriers["count"] == 3:  # finish's barriers: shards closed, shards published, swapped in
            raise KeyboardInterrupt
        barrier(self)

    monkeypatch.setattr(ranks, "barrier", interrupted_last_barrier)
    with pytest.raises(KeyboardInterrupt), caplog.at_level("WARNING"):
        drain(iter(_tensors()), writer)
    assert sorted(HFCheckpoint.open(out).names()) == sorted(name for name, _ in _tensors())
    assert "the new checkpoint is in place" in caplog.text and "removed" not in caplog.text


def test_empty_stream_raises_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match="no tensors"):
        _write(tmp_path / "out", [])
    assert list(tmp_path.iterdir()) == []


def test_duplicate_name_raises(tmp_path):
    stream = [("a", torch.ones(100)), ("b", torch.ones(2)), ("a", torch.ones(2))]
    with pytest.raises(ValueError, match="'a' was exported twice"):
        _write(tmp_path / "out", stream, max_shard_bytes=64)
    assert list(tmp_path.iterdir()) == []


def test_consume_after_finish_raises(tmp_path):
    writer = ShardedSafetensorsWriter(out_dir=tmp_path / "out")
    drain([("w", torch.ones(1))], writer)
    with pytest.raises(RuntimeError, match="after finish"):
        writer.consume("v", torch.ones(1))


# -- side files ----------------------------------------------------------------------------


def _hf_source_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (path / "generation_config.json").write_text('{"do_sample": false}')
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    (path / "tokenizer_config.json").write_text('{"model_max_length": 16}')
    (path / "merges.txt").write_text("a b\n")
    (path / "model.safetensors").write_bytes(b"not copied")
    (path / "README.md").write_text("not copied")
    return path


def test_copies_config_and_tokenizer_files(tmp_path):
    source = _hf_source_dir(tmp_path / "src")
    out = _write(tmp_path / "out", [("w", torch.ones(2))], copy_files_from=source)
    copied = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "merges.txt",
    }
    shard = "model-00001-of-00001.safetensors"
    assert {p.name for p in out.iterdir()} == copied | {INDEX_NAME, shard}
    for name in copied:
        assert (out / name).read_bytes() == (source / name).read_bytes()


def test_config_overrides_are_merged(tmp_path):
    source = _hf_source_dir(tmp_path / "src")
    overrides = {"quantization_config": {"quant_method": "fp8"}, "hidden_size": 8}
    out = _write(tmp_path / "out", [("w", torch.ones(2))], copy_files_from=source, config_overrides=overrides)
    assert HFCheckpoint.open(out).config() == {"model_type": "llama", **overrides}


def test_config_overrides_need_a_config(tmp_path):
    with pytest.raises(ValueError, match="copy_files_from"):
        ShardedSafetensorsWriter(out_dir=tmp_path / "out", config_overrides={"a": 1})
    (tmp_path / "src").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ShardedSafetensorsWriter(out_dir=tmp_path / "out", copy_files_from=tmp_path / "src", config_overrides={"a": 1})
    assert not (tmp_path / "out").exists()


def test_writer_satisfies_the_protocol(tmp_path):
    assert isinstance(ShardedSafetensorsWriter(out_dir=tmp_path / "out"), WeightSink)


# -- drain ---------------------------------------------------------------------------------


class _RecordingSink:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail_on = fail_on

    def consume(self, hf_name, tensor):
        if hf_name == self.fail_on:
            raise KeyError(hf_name)
        self.calls.append(hf_name)

    def finish(self):
        self.calls.append("finish")

    def abort(self):
        self.calls.append("abort")


def test_drain_counts_and_finishes():
    sink = _RecordingSink()
    assert drain([("a", torch.ones(1)), ("b", torch.ones(1))], sink) == 2
    assert sink.calls == ["a", "b", "finish"]


def test_drain_aborts_and_reraises_on_consume_error():
    sink = _RecordingSink(fail_on="b")
    with pytest.raises(KeyError):
        drain([("a", torch.ones(1)), ("b", torch.ones(1)), ("c", torch.ones(1))], sink)
    assert sink.calls == ["a", "abort"]


# -- multi-rank ----------------------------------------------------------------------------

_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import torch.distributed as dist
    import mbridge_refit.sinks.safetensors as sink_module
    from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

    out_dir, report_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    written = []
    real_save_file = sink_module.save_file

    def recording_save_file(tensors, path, metadata=None):
        written.append({"path": Path(path).name, "names": sorted(tensors)})
        return real_save_file(tensors, path, metadata=metadata)

    sink_module.save_file = recording_save_file

    def stream():
        for i in range(9):  # every rank yields the same names; 40 B each, 2 per shard -> 5 shards
            yield f"layers.{i}.weight", torch.full((10,), float(i))

    drain(stream(), ShardedSafetensorsWriter(out_dir=out_dir, max_shard_bytes=80))
    (report_dir / f"rank{rank}.json").write_text(json.dumps(written))
    dist.destroy_process_group()
    """
)


def _launch_ranks(script: Path, args: list[str], *, world_size: int) -> None:
    """Run `script` as `world_size` real ranks with torchrun's env:// variables, set by hand.

    Same rendezvous as `torchrun --nproc-per-node N` without the launcher process (one torch
    import fewer, which is most of this test's time on a small CPU box).
    """
    port = str(_free_port())
    base = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
    }
    procs = []
    for rank in range(world_size):
        env = base | {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{output}"


@pytest.mark.multirank
def test_two_ranks_each_shard_written_by_exactly_one_rank(tmp_path):
    script = tmp_path / "rank_main.py"
    script.write_text(_RANK_SCRIPT)
    out, reports = tmp_path / "out", tmp_path / "reports"
    reports.mkdir()
    _launch_ranks(script, [str(out), str(reports)], world_size=2)

    by_rank = {r: json.loads((reports / f"rank{r}.json").read_text()) for r in (0, 1)}
    tmp_names = [w["path"] for r in (0, 1) for w in by_rank[r]]
    assert sorted(tmp_names) == [f".tmp-model-{k:05d}.safetensors" for k in range(1, 6)]
    for rank, writes in by_rank.items():
        for w in writes:
            shard = int(w["path"][len(".tmp-model-") : -len(".safetensors")]) - 1
            assert shard % 2 == rank
    all_names = [n for r in (0, 1) for w in by_rank[r] for n in w["names"]]
    assert sorted(all_names) == sorted(f"layers.{i}.weight" for i in range(9))

    ckpt = HFCheckpoint.open(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([INDEX_NAME, *(shard_file_name(k, 5) for k in range(5))])
    for i in range(9):
        assert torch.equal(ckpt.tensor(f"layers.{i}.weight"), torch.full((10,), float(i)))


# -- a shard assignment fixed up front (replicas writing in parallel) -----------------------------


def _sizes(stream):
    return [(name, tensor.numel() * tensor.element_size()) for name, tensor in stream]


def test_assignment_cuts_the_streamed_shards_and_spreads_them_over_replicas():
    from mbridge_refit.sinks import ShardAssignment

    stream = _tensors()
    assignment = ShardAssignment.build(_sizes(stream), max_shard_bytes=100, replicas=[[0, 1], [2, 3]])
    assert list(assignment.shard_of) == plan_shards([n for _, n in _sizes(stream)], max_shard_bytes=100)
    # shard k -> replica k % 2, then that replica's ranks in turn
    expected = [[0, 1], [2, 3]]
    assert list(assignment.writers) == [expected[k % 2][(k // 2) % 2] for k in range(assignment.num_shards)]
    mine = assignment.names_for([0, 1])
    assert (
        mine
        and mine | assignment.names_for([2, 3]) == {n for n, _ in stream}
        and not mine & assignment.names_for([2, 3])
    )


def test_assigned_writer_takes_any_subset_and_writes_what_the_stream_would(tmp_path):
    """One process holding both 'replicas' (writers 0): the files equal a streamed write's, byte for byte,
    although the tensors arrive with the other replica's tensors skipped and then the rest."""
    from mbridge_refit.sinks import ShardAssignment

    stream = _tensors()
    drain(iter(stream), ShardedSafetensorsWriter(out_dir=tmp_path / "streamed", max_shard_bytes=100))
    assignment = ShardAssignment.build(_sizes(stream), max_shard_bytes=100, replicas=[[0]])
    odd_first = stream[1::2] + stream[0::2]
    drain(
        iter(odd_first),
        ShardedSafetensorsWriter(out_dir=tmp_path / "assigned", max_shard_bytes=100, assignment=assignment),
    )
    names = sorted(p.name for p in (tmp_path / "streamed").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "assigned").iterdir())
    for name in names:
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "assigned" / name).read_bytes(), name


def test_assigned_writer_refuses_an_incomplete_share(tmp_path):
    from mbridge_refit.sinks import ShardAssignment

    stream = _tensors()
    assignment = ShardAssignment.build(_sizes(stream), max_shard_bytes=100, replicas=[[0]])
    writer = ShardedSafetensorsWriter(out_dir=tmp_path / "out", max_shard_bytes=100, assignment=assignment)
    with pytest.raises(ValueError, match=f"missing \\['{stream[-1][0]}'\\]"):
        drain(iter(stream[:-1]), writer)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_assigned_writer_refuses_unplanned_tensors(tmp_path):
    from mbridge_refit.sinks import ShardAssignment

    stream = _tensors()
    assignment = ShardAssignment.build(_sizes(stream[:-1]), max_shard_bytes=100, replicas=[[0]])
    writer = ShardedSafetensorsWriter(out_dir=tmp_path / "out", max_shard_bytes=100, assignment=assignment)
    with pytest.raises(ValueError, match="not in the shard assignment"):
        drain(iter(stream), writer)
