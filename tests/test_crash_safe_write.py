"""A checkpoint write killed at any point leaves the output directory holding either the complete
old checkpoint or the complete new one (``--overwrite`` builds beside and swaps), and the rerun
names what the killed run left.

A child process writes a new checkpoint over an old one with ``ShardedSafetensorsWriter`` and
pauses at one point of the publish protocol (a function of the writer wrapped by the child, not
a hook in the package); the test kills its whole process group with SIGKILL there, then reads
the output directory back with plain safetensors (tests/oracle.py) and compares it with both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO
from oracle import read_checkpoint

from mbridge_refit.sinks import ShardedSafetensorsWriter, drain
from mbridge_refit.checkpoints.publish import staging_dir

OLD = {f"old.{i}": torch.full((16,), float(i)) for i in range(6)}
NEW = {f"new.{i}": torch.full((16,), float(-i)) for i in range(7)}

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    import mbridge_refit.sinks.safetensors as sink
    from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

    out, point = Path(sys.argv[1]), sys.argv[2]
    calls = {}

    def pausing(name, real, after=1):
        def wrapped(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if name == point and calls[name] == after:
                print("PAUSED", point, flush=True)
                time.sleep(120)
            return real(*args, **kwargs)
        return wrapped

    sink.save_file = pausing("save_file", sink.save_file, after=2)          # a shard written, more to come
    sink.fsync_dir = pausing("fsync_staging", sink.fsync_dir)              # all written, before the swap
    sink.swap_in = pausing("exchange", sink.swap_in)                     # right before the swap
    sink.fsync_file = pausing("fsync_shard_renamed", sink.fsync_file, after=5)  # while side files are written
    real_rmtree = sink.shutil.rmtree
    sink.shutil.rmtree = pausing("remove_old", real_rmtree)                  # swapped, old not yet removed
    real_replace = os.replace
    def replace(a, b):  # during the renames of the shards inside the staging directory
        calls["rename"] = calls.get("rename", 0) + 1
        if point == "rename_shards" and calls["rename"] == 2:
            print("PAUSED", point, flush=True)
            time.sleep(120)
        return real_replace(a, b)
    sink.os.replace = replace
    stream = [(f"new.{i}", torch.full((16,), float(-i))) for i in range(7)]
    drain(stream, ShardedSafetensorsWriter(out_dir=out, max_shard_bytes=128, overwrite=True))
    print("DONE", flush=True)
    """
)

POINTS = ["save_file", "rename_shards", "fsync_shard_renamed", "fsync_staging", "exchange", "remove_old"]


def _write(out, tensors, **kwargs):
    drain(iter(tensors.items()), ShardedSafetensorsWriter(out_dir=out, max_shard_bytes=128, **kwargs))


@pytest.mark.parametrize("point", POINTS)
def test_kill_during_overwrite_leaves_old_or_new(point, tmp_path):
    out = tmp_path / "out"
    _write(out, OLD)
    (out / "notes.txt").write_text("mine")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    child = subprocess.Popen([sys.executable, str(script), str(out), point], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        seen = []
        for line in child.stdout:
            seen.append(line)
            if line.startswith(("PAUSED", "DONE")):
                break
        assert any(line.startswith("PAUSED") for line in seen), "".join(seen)[-3000:]
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=30)

    on_disk = read_checkpoint(out)
    assert on_disk.keys() in (OLD.keys(), NEW.keys()), sorted(on_disk)
    expected = OLD if on_disk.keys() == OLD.keys() else NEW
    assert all(torch.equal(on_disk[name], expected[name]) for name in expected)
    assert (out / "notes.txt").read_text() == "mine"
    assert (point in ("remove_old",)) == (expected is NEW), f"{point}: the swap happened {'after' if expected is NEW else 'before'} it"

    leftover = staging_dir(out)
    if leftover.exists():  # a rerun without --overwrite names it; with --overwrite it is removed
        with pytest.raises(FileExistsError, match=r"left from an interrupted write.*--overwrite"):
            ShardedSafetensorsWriter(out_dir=out)
    _write(out, NEW, overwrite=True)
    assert read_checkpoint(out).keys() == NEW.keys() and not leftover.exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_drops_old_checkpoint_files_and_keeps_others(tmp_path):
    out = tmp_path / "out"
    _write(out, OLD)
    (out / "tokenizer.json").write_text("{}")
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("mine")
    _write(out, NEW, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" not in names and "extra" in names
    assert (out / "extra" / "notes.txt").read_text() == "mine"
    assert read_checkpoint(out).keys() == NEW.keys()


def test_failure_in_finish_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    import mbridge_refit.sinks.safetensors as sink

    out = tmp_path / "out"
    _write(out, OLD)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sink.ShardedSafetensorsWriter, "_write_index", disk_full)
    with pytest.raises(OSError, match="No space left"):
        _write(out, NEW, overwrite=True)
    assert read_checkpoint(out).keys() == OLD.keys()
    assert not staging_dir(out).exists(), "abort must remove everything the writer created"
