"""Writers that exclude each other: one writer at a time per output directory (the output's lock,
``checkpoints.output_lock``), each in its own staging directory.

Several writers started together on one output leave one complete checkpoint of exactly one of
them (read back with plain safetensors and compared with what that writer was given, saved with
safetensors' own ``save_file``); the others are refused naming the holder (the CLI: exit 2);
nothing is left beside the output. A killed holder's lock is taken over; ranks of one write
share rank 0's verdict.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from oracle import read_checkpoint

from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

WRITERS = 4
ROUNDS = 4
CHILD_ENV = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}

# A writer process: in each round, waits for the test's go, then writes its own tensors (seeded
# by its index and the round) over the output, slowly enough that the writers overlap, and
# reports what happened. Before writing it saves the same tensors with safetensors' save_file:
# the reference the test compares the output with.
WRITER = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

    work, out, index, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    def stream(tensors):
        for name, tensor in tensors.items():
            time.sleep(0.1)  # the writers overlap: each holds the output for about 2 s
            yield name, tensor

    (work / f"ready-{index}").touch()
    for round_ in range(rounds):
        while not (work / f"go-{round_}").exists():
            time.sleep(0.01)
        g = torch.Generator().manual_seed(1000 * round_ + index)
        tensors = {f"w{index}.{i}": torch.randn(16 + index, generator=g) for i in range(20)}
        save_file(tensors, str(work / f"reference-{round_}-{index}.safetensors"))
        try:
            drain(stream(tensors), ShardedSafetensorsWriter(out_dir=out, max_shard_bytes=256, overwrite=True))
            report = {"pid": os.getpid(), "written": True}
        except FileExistsError as err:  # refused: the output is another writer's
            report = {"pid": os.getpid(), "written": False, "message": str(err)}
        (work / f"report-{round_}-{index}.json").write_text(json.dumps(report))
    """
)


def _wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None and p.returncode != 0]
        if dead:
            raise AssertionError(f"a writer died: {dead[0].communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {[p.name for p in paths if not p.exists()]}"
        time.sleep(0.05)


def test_writers_started_together_leave_one_complete_checkpoint_of_one_of_them(tmp_path):
    work, parent = tmp_path / "work", tmp_path / "parent"
    work.mkdir()
    parent.mkdir()
    out = parent / "out"
    drain(iter({f"old.{i}": torch.ones(8) for i in range(5)}.items()), ShardedSafetensorsWriter(out_dir=out))
    (out / "notes.txt").write_text("mine")
    script = work / "writer.py"
    script.write_text(WRITER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(work), str(out), str(i), str(ROUNDS)],
            env=CHILD_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for i in range(WRITERS)
    ]
    try:
        _wait_for([work / f"ready-{i}" for i in range(WRITERS)], procs, timeout=180)
        for round_ in range(ROUNDS):
            (work / f"go-{round_}").touch()
            _wait_for([work / f"report-{round_}-{i}.json" for i in range(WRITERS)], procs, timeout=60)
            reports = [json.loads((work / f"report-{round_}-{i}.json").read_text()) for i in range(WRITERS)]
            _check_round(round_, reports, out, work)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert sorted(p.name for p in parent.iterdir()) == ["out"], "a staging directory, temporary file or lock left"


def _check_round(round_: int, reports: list[dict], out: Path, work: Path) -> None:
    written = [i for i, r in enumerate(reports) if r["written"]]
    refused = [i for i, r in enumerate(reports) if not r["written"]]
    assert written and refused, f"round {round_}: the writers did not overlap ({reports})"
    holders = {reports[i]["pid"] for i in written}
    for i in refused:
        message = reports[i]["message"]
        assert "is being written by another writer" in message and str(out) in message, message
        named = int(message.split("(pid ")[1].split()[0])
        assert named in holders, f"round {round_}: writer {i} names pid {named}, which wrote nothing ({reports})"
    on_disk = read_checkpoint(out)
    matches = []
    for i in written:
        reference = read_checkpoint_file(work / f"reference-{round_}-{i}.safetensors")
        if on_disk.keys() == reference.keys():
            matches.append(i)
            for name, tensor in reference.items():
                assert torch.equal(on_disk[name].view(torch.uint8), tensor.view(torch.uint8)), f"{name}: bytes differ"
    assert len(matches) == 1, f"round {round_}: the output holds {sorted(on_disk)}, not one writer's tensors"
    assert (out / "notes.txt").read_text() == "mine"


def read_checkpoint_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


# --- the lock, in one process and across ranks ------------------------------------------------------


def _write(out: Path, tensors: dict, **kwargs) -> None:
    drain(iter(tensors.items()), ShardedSafetensorsWriter(out_dir=out, max_shard_bytes=128, **kwargs))


def test_a_second_writer_is_refused_naming_the_holder_until_the_first_is_done(tmp_path):
    out = tmp_path / "out"
    busy = rf"{out} is being written by another writer \(pid {os.getpid()} on host \S+ since .*wait until"
    first = ShardedSafetensorsWriter(out_dir=out, overwrite=True)
    with pytest.raises(FileExistsError, match=busy):
        ShardedSafetensorsWriter(out_dir=out, overwrite=True)
    first.abort()  # released on abort ...
    second = ShardedSafetensorsWriter(out_dir=out, overwrite=True)
    with pytest.raises(FileExistsError, match=busy):
        ShardedSafetensorsWriter(out_dir=out, overwrite=True)
    drain(iter([("a", torch.ones(3))]), second)  # ... and once the checkpoint is in place
    _write(out, {"b": torch.zeros(3)}, overwrite=True)
    assert sorted(read_checkpoint(out)) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


HOLDER = textwrap.dedent(
    """
    import sys, time
    from mbridge_refit.sinks import ShardedSafetensorsWriter
    writer = ShardedSafetensorsWriter(out_dir=sys.argv[1], overwrite=True)
    print("HOLDING", flush=True)
    time.sleep(120)
    """
)


def test_a_killed_writers_lock_is_taken_over_with_a_log_line(tmp_path, caplog):
    out = tmp_path / "out"
    _write(out, {"old": torch.ones(3)})
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        line = holder.stdout.readline()
        assert line.startswith("HOLDING"), line + holder.communicate(timeout=60)[0][-3000:]
        with pytest.raises(FileExistsError, match=rf"another writer \(pid {holder.pid} on host"):
            _write(out, {"new": torch.zeros(3)}, overwrite=True)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="mbridge_refit"):
        _write(out, {"new": torch.zeros(3)}, overwrite=True)  # the killed writer's staging is removed too
    assert f"taking over {tmp_path / '.out.lock'}: its holder, pid {holder.pid} on host" in caplog.text
    assert sorted(read_checkpoint(out)) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


RANK_WRITER = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

    dist.init_process_group("gloo")
    try:
        drain([("w", torch.ones(2))], ShardedSafetensorsWriter(out_dir=sys.argv[1], overwrite=True))
        print(f"rank {dist.get_rank()}: WROTE", flush=True)
    except FileExistsError as err:
        print(f"rank {dist.get_rank()}: REFUSED {err}", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.multirank
def test_every_rank_learns_rank_0s_verdict_on_a_held_output(tmp_path):
    from test_safetensors_sink import _free_port

    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        env=CHILD_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    line = holder.stdout.readline()
    assert line.startswith("HOLDING"), line
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_WRITER, str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=CHILD_ENV | {"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for r in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        for p in procs:
            if p.poll() is None:
                p.kill()
    busy = f"rank 0: REFUSED {out} is being written by another writer (pid {holder.pid} on host"
    assert busy in outputs[0], outputs[0]
    assert "rank 1: REFUSED the first rank refused to write" in outputs[1], outputs[1]
    assert not any(out.iterdir()), "the held output was changed"


# --- the CLI: `convert roundtrip` processes started together on one --out -----------------------------

# Each shard file takes a second to write, so the writers' holds overlap however the model loads
# spread out (a test hook in the child's startup, not in the package).
SLOW_SHARDS = """
import time
import safetensors.torch

_save_file = safetensors.torch.save_file

def save_file(*args, **kwargs):
    time.sleep(1.0)
    return _save_file(*args, **kwargs)

safetensors.torch.save_file = save_file
"""


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory):
    from mbridge_refit.models import recipes

    root = tmp_path_factory.mktemp("seeded")
    recipe = recipes.get_model_recipe("qwen3-tiny")
    return [
        recipes.make_random_checkpoint(recipe, root / f"seed{seed}", seed=seed, max_shard_bytes=64 * 1024)
        for seed in (1, 2, 3)
    ]


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "new-output"])
def test_roundtrips_started_together_write_one_source_and_the_others_exit_2(three_sources, tmp_path, overwrite):
    """3 processes over an existing checkpoint with --overwrite, or 2 into a new output without
    it (each process imports Megatron: 30-90 s on 2 busy cores)."""
    from oracle import assert_bitwise_equal_checkpoints

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SLOW_SHARDS)
    parent = tmp_path / "parent"
    parent.mkdir()
    out = parent / "out"
    if overwrite:
        _write(out, {"old": torch.ones(3)})
        (out / "notes.txt").write_text("mine")
    env = {**CHILD_ENV, "PYTHONPATH": f"{shim}{os.pathsep}{REPO}", "PYTHONUNBUFFERED": "1"}
    flags = ["--overwrite"] if overwrite else []
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mbridge_refit.convert",
                "roundtrip",
                "--hf",
                str(source),
                "--out",
                str(out),
                "--no-progress",
                "--max-shard-bytes",
                "40000",
                *flags,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for source in (three_sources if overwrite else three_sources[:2])
    ]
    try:
        outputs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    codes = [p.returncode for p in procs]
    written = [i for i, code in enumerate(codes) if code == 0]
    assert sorted(set(codes)) == [0, 2], f"exit codes {codes}:\n" + "\n".join(o[-2000:] for o in outputs)
    if not overwrite:
        assert len(written) == 1, codes
    for i, code in enumerate(codes):
        if code == 2 and "is being written by another writer" in outputs[i]:
            named = int(outputs[i].split("another writer (pid ")[1].split()[0])
            assert named in {procs[w].pid for w in written}, outputs[i][-2000:]
        elif code == 2:  # it came after the writer had finished: a new output is not empty any more
            assert not overwrite and "exists and is not empty" in outputs[i], outputs[i][-2000:]
    matching = []
    for i in written:
        try:
            assert_bitwise_equal_checkpoints(three_sources[i], out)
            matching.append(i)
        except AssertionError:
            pass
    assert len(matching) == 1, f"the output is not one writer's source (writers {written})"
    assert not overwrite or (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in parent.iterdir()) == ["out"], "a staging directory, temporary file or lock left"
