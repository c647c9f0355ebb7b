"""A checkpoint write killed at any point leaves the output directory holding either the complete
old checkpoint or the complete new one (``--overwrite`` builds beside and swaps), and the rerun
names what the killed run left.

A child process writes a new checkpoint over an old one with ``ShardedSafetensorsWriter`` and
pauses at one point of the publish protocol (a function of the writer wrapped by the child, not
a hook in the package); the test kills its whole process group with SIGKILL there, then reads
the output directory back with plain safetensors (tests/oracle.py) and compares it with both.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO
from oracle import read_checkpoint

from mbridge_refit.checkpoints.publish import leftovers
from mbridge_refit.sinks import ShardedSafetensorsWriter, drain

OLD = {f"old.{i}": torch.full((16,), float(i)) for i in range(6)}
NEW = {f"new.{i}": torch.full((16,), float(-i)) for i in range(7)}

CHILD = textwrap.dedent(
    """
    import os, shutil, sys, time
    from pathlib import Path
    import torch
    import mbridge_refit.checkpoints.publish as publish
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
    publish.swap_in = pausing("exchange", publish.swap_in)               # right before the swap
    sink.fsync_file = pausing("fsync_shard_renamed", sink.fsync_file, after=5)  # while side files are written
    shutil.rmtree = pausing("remove_old", shutil.rmtree)                     # swapped, old not yet removed
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
    child = subprocess.Popen(
        [sys.executable, str(script), str(out), point],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
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
    assert (point in ("remove_old",)) == (expected is NEW), (
        f"{point}: the swap happened {'after' if expected is NEW else 'before'} it"
    )

    if leftovers(out):  # a rerun without --overwrite names it; with --overwrite it is removed
        with pytest.raises(FileExistsError, match=r"left from an interrupted write.*--overwrite"):
            ShardedSafetensorsWriter(out_dir=out)
    _write(out, NEW, overwrite=True)  # the killed writer's lock is taken over
    assert read_checkpoint(out).keys() == NEW.keys()
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py", "out"], "a staging directory or lock left"


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "abort must remove everything the writer created"


def test_failure_writing_a_new_output_leaves_nothing(tmp_path, monkeypatch):
    """The output directory a failed write created is removed with its staging directory and lock."""
    import mbridge_refit.sinks.safetensors as sink

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sink.ShardedSafetensorsWriter, "_write_index", disk_full)
    with pytest.raises(OSError, match="No space left"):
        _write(tmp_path / "new", NEW)
    assert list(tmp_path.iterdir()) == [], "abort must remove everything the writer created"


# Files an older checkpoint in the output may hold, each one a loader could read (weights of
# other formats and their temporaries, their indexes, processor and tokenizer files).
OLD_LOADER_FILES = [
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "pytorch_model-00001-of-00002.bin",
    "training_args.bin",
    "model.safetensors",
    "model-00001-of-00009.safetensors.tmp",
    "adapter_model.safetensors",
    "consolidated.00.pth",
    "model.pt",
    "tf_model.h5",
    "flax_model.msgpack",
    "model.gguf",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "tokenizer.model",
    "spiece.model",
    "special_tokens_map.json",
    "vocab.txt",
    "chat_template.json",
    "chat_template.jinja",
    ".tmp-model-00003.safetensors",
]


def test_overwrite_leaves_no_file_of_the_old_checkpoint_a_loader_could_read(tmp_path):
    from mbridge_refit.checkpoints.hf import COPIED_FILE_NAMES

    out = tmp_path / "out"
    out.mkdir()
    old_files = [*OLD_LOADER_FILES, "config.json", *COPIED_FILE_NAMES]
    for name in old_files:
        (out / name).write_bytes(b"old")
    (out / "README.md").write_text("mine")
    (out / "results").mkdir()
    (out / "results" / "eval.json").write_text("{}")
    _write(out, NEW, overwrite=True)
    names = sorted(p.name for p in out.iterdir())
    assert [n for n in names if n in old_files] == [], names
    assert "README.md" in names and (out / "results" / "eval.json").read_text() == "{}"
    assert read_checkpoint(out).keys() == NEW.keys()


def test_symlinked_out_is_written_through(tmp_path):
    """The link stays and keeps pointing at its directory, which now holds the new checkpoint;
    the staging directory and the lock lie beside that directory; a rerun works alike."""
    real = tmp_path / "disk" / "ckpt"
    _write(real, OLD)
    (real / "notes.txt").write_text("mine")
    (tmp_path / "links").mkdir()
    out = tmp_path / "links" / "out"
    out.symlink_to(real, target_is_directory=True)
    for tensors in (NEW, OLD):
        _write(out, tensors, overwrite=True)
        assert out.is_symlink() and out.resolve() == real.resolve()
        assert read_checkpoint(real).keys() == tensors.keys() and (real / "notes.txt").read_text() == "mine"
        assert [p.name for p in (tmp_path / "links").iterdir()] == ["out"]
        assert [p.name for p in (tmp_path / "disk").iterdir()] == ["ckpt"]


def test_old_content_that_cannot_be_removed_leaves_the_new_checkpoint_and_a_warning(tmp_path, monkeypatch, caplog):
    import shutil

    out = tmp_path / "out"
    _write(out, OLD)
    real_rmtree = shutil.rmtree

    def undeletable(path, *args, **kwargs):
        if Path(path).name.startswith(".out.partial"):  # after the swap: the old content
            raise PermissionError(13, "Permission denied (injected by the test)", str(path))
        return real_rmtree(path, *args, **kwargs)

    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(shutil, "rmtree", undeletable)
    with caplog.at_level(logging.WARNING, logger="mbridge_refit"):
        _write(out, NEW, overwrite=True)
    assert read_checkpoint(out).keys() == NEW.keys()
    [old] = leftovers(out)
    assert f"{out} now holds the new checkpoint, but its old content could not be removed from {old}" in caplog.text
    assert "Permission denied (injected by the test)" in caplog.text
    assert read_checkpoint(old).keys() == OLD.keys()


def test_sigterm_to_a_single_process_write_removes_its_staging(tmp_path, monkeypatch, capsys):
    # SIGTERM ended the process where it stood: a checkpoint's worth of staging stayed beside the output
    import signal

    import mbridge_refit.sinks.safetensors as sink
    from mbridge_refit.convert import ExitCode, main
    from mbridge_refit.models import recipes
    from mbridge_refit.testing.conformance import restored_environment

    source = recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), tmp_path / "hf", seed=7)
    real = sink.fsync_file
    sent = []

    def terminated(path):
        if not sent:
            sent.append(path)
            os.kill(os.getpid(), signal.SIGTERM)  # handled at the next bytecode, in the middle of the write
        return real(path)

    monkeypatch.setattr(sink, "fsync_file", terminated)
    out = tmp_path / "out"
    with restored_environment():
        code = main(["roundtrip", "--hf", str(source), "--out", str(out)])
    assert sent and code == ExitCode.TERMINATED
    assert "interrupted by SIGTERM" in capsys.readouterr().err
    assert not out.exists() and not leftovers(out)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is the command's only


def test_an_interrupt_as_the_export_starts_removes_the_staging(tmp_path, monkeypatch, capsys):
    """Ctrl-C after the writer had made its staging directory and taken the lock, while the export was
    starting (planning, before drain's first tensor): both stayed beside the output."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert import ExitCode, main
    from mbridge_refit.models import recipes
    from mbridge_refit.testing.conformance import restored_environment

    source = recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), tmp_path / "hf", seed=7)

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(RefitBridge, "export_hf_weights", interrupted)
    out = tmp_path / "out"
    with restored_environment():
        code = main(["roundtrip", "--hf", str(source), "--out", str(out), "--no-progress"])
    assert code == ExitCode.INTERRUPTED and "interrupted by SIGINT (Ctrl-C)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"], "the staging directory or the lock was left"


def test_an_interrupt_wrapped_by_a_checkpoint_load_is_reported_as_one():
    from torch.distributed.checkpoint.api import CheckpointException

    from mbridge_refit.convert import ExitCode
    from mbridge_refit.convert.app import classify

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as interrupt:
            raise CheckpointException("load", {0: interrupt}) from interrupt
    except CheckpointException as err:
        failure = classify(err)
        assert failure.code == ExitCode.INTERRUPTED and failure.message.startswith("interrupted by SIGINT")
