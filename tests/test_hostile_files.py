"""Hostile files among a checkpoint's inputs are refused by name, quickly, never waited on or walked
for hours.

Covered: an HF index naming a shard that is no regular file (a FIFO or a device, or a shard
swapped for a FIFO after the index was read), a safetensors header of many keys naming one
twice (refused in linear time), and a Megatron-Bridge PEFT checkpoint whose ``run_config.yaml`` uses
YAML aliases (a "billion laughs" bomb of under 1 kB), is oversized or nested past the parser's
depth, or whose tracker holds text that is not an iteration number. A reader that could block runs
in a thread with a deadline: a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from mbridge_refit.checkpoints.hf import INDEX_NAME, CheckpointError, HFCheckpoint
from mbridge_refit.checkpoints.megatron_peft import (
    LORA_TARGET,
    RUN_CONFIG_NAME,
    TRACKER_NAME,
    NotAPeftCheckpoint,
    PeftCheckpoint,
)
from mbridge_refit.models import recipes

DEADLINE_S = 10.0


def outcome(call: Callable[[], Any], *, unblock: Path | None = None) -> BaseException | None:
    """What ``call()`` raised (None if it returned), run in a thread; fails the test if it is still
    running after ``DEADLINE_S``. ``unblock`` (a FIFO the call may be waiting on) is then opened for
    writing and closed, so the stuck thread sees end of file and ends."""
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
            result.append(None)
        except BaseException as err:  # noqa: BLE001 (handed to the test)
            result.append(err)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    if thread.is_alive():
        if unblock is not None:
            try:
                os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(DEADLINE_S)
        pytest.fail(f"still running after {DEADLINE_S} s: the reader blocked instead of refusing")
    return result[0]


# --- HF shards that are no regular file --------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "sharded"
    return recipes.make_random_checkpoint(
        recipes.get_model_recipe("qwen3-tiny"), out, seed=7, max_shard_bytes=96 * 1024
    )


def _a_shard(checkpoint: Path) -> str:
    return sorted(set(json.loads((checkpoint / INDEX_NAME).read_text())["weight_map"].values()))[0]


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (os.mkfifo, "FIFO"),
        (lambda path: path.symlink_to("/dev/zero"), "character device"),
    ],
    ids=["fifo", "device"],
)
def test_an_index_naming_a_shard_that_is_no_regular_file_is_refused(sharded, make, kind, tmp_path):
    """Refused when the index is read, before any shard is opened. (A directory in place of a shard
    never blocks: ``validate`` refuses it as IsADirectoryError, tests/test_checkpoint.py.)"""
    checkpoint = shutil.copytree(sharded, tmp_path / "hf")
    shard = checkpoint / _a_shard(checkpoint)
    shard.unlink()
    make(shard)
    err = outcome(lambda: HFCheckpoint.open(checkpoint).validate(), unblock=shard if kind == "FIFO" else None)
    assert isinstance(err, CheckpointError), err
    message = str(err)
    assert f"{shard} is a {kind}" in message and "must be a regular safetensors file" in message


def test_a_shard_swapped_for_a_fifo_after_the_index_was_read_is_refused(sharded, tmp_path):
    checkpoint = shutil.copytree(sharded, tmp_path / "hf")
    opened = HFCheckpoint.open(checkpoint)
    shard = checkpoint / _a_shard(checkpoint)
    name = next(name for name, file in opened.weight_map.items() if checkpoint / file == shard)
    shard.unlink()
    os.mkfifo(shard)
    for call in (opened.validate, lambda: opened.tensor(name)):
        err = outcome(call, unblock=shard)
        assert isinstance(err, CheckpointError), err
        assert str(shard) in str(err) and "must be a regular safetensors file" in str(err)


# --- a header naming a key twice -----------------------------------------------------------------------


def test_a_long_header_naming_a_key_twice_is_refused_in_linear_time(tmp_path):
    keys = 20_000
    header = ("{" + ",".join(f'"k{i}":0' for i in range(keys)) + ',"k0":0}').encode()
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"the header names \['k0'\] more than once"):
        HFCheckpoint.open(checkpoint)
    assert time.perf_counter() - start < 5.0


# --- run_config.yaml and the tracker of a PEFT checkpoint ----------------------------------------------


def _iteration(tmp_path: Path, run_config: str | bytes) -> Path:
    """An iteration directory with a placeholder index and ``run_config`` as its run_config.yaml."""
    iteration = tmp_path / "save" / "iter_0000001"
    iteration.mkdir(parents=True)
    (iteration / ".metadata").write_bytes(b"")
    target = iteration / RUN_CONFIG_NAME
    target.write_bytes(run_config.encode() if isinstance(run_config, str) else run_config)
    return iteration


def _alias_bomb(depth: int = 12) -> str:
    """10**depth strings as a tree, under 1 kB as YAML."""
    lines = ['b0: &b0 ["x","x","x","x","x","x","x","x","x","x"]']
    lines += [f"b{i}: &b{i} [" + ",".join([f"*b{i - 1}"] * 10) + "]" for i in range(1, depth + 1)]
    lines += ["model: {}", "peft:", f"  _target_: {LORA_TARGET}", f"  target_modules: *b{depth}"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text",
    [
        _alias_bomb(),
        f"model: &m {{num_layers: 2}}\npeft: {{_target_: {LORA_TARGET}, dim: 4}}\ncopy: *m\n",
        f"model: {{num_layers: 2}}\npeft: &p {{_target_: {LORA_TARGET}, dim: 4}}\n",
    ],
    ids=["billion-laughs", "one-alias", "an-unused-anchor"],
)
def test_a_run_config_with_yaml_aliases_is_refused(text, tmp_path):
    iteration = _iteration(tmp_path, text)
    start = time.perf_counter()
    err = outcome(lambda: PeftCheckpoint.open(iteration).lora())
    assert isinstance(err, NotAPeftCheckpoint), err
    assert f"{iteration / RUN_CONFIG_NAME} uses YAML aliases (&/*)" in str(err)
    assert time.perf_counter() - start < 2.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_run_config_as_megatron_bridge_dumps_it_opens(tmp_path):
    """yaml.safe_dump (Megatron-Bridge's dumper) writes equal values in full, never as aliases: the
    refusal above never meets a file a run wrote."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    targets = ["linear_qkv", "linear_proj"]
    config = {
        "model": {"num_layers": 2, "a": targets, "b": list(targets)},
        "peft": {"_target_": LORA_TARGET, "dim": 4, "target_modules": list(targets)},
    }
    text = yaml.safe_dump(config)
    assert "&" not in text and "*" not in text
    iteration = tmp_path / "save" / "iter_0000001"
    key = "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"
    planner = DefaultSavePlanner(flatten_state_dict=False)  # no planner_data, as Megatron-Core's writer
    dcp.save({key: torch.zeros(2, 2)}, checkpoint_id=iteration, no_dist=True, planner=planner)
    (iteration / RUN_CONFIG_NAME).write_text(text)
    (iteration.parent / TRACKER_NAME).write_text("1")
    checkpoint = PeftCheckpoint.open(iteration.parent)
    assert checkpoint.weights == iteration and checkpoint.peft == config["peft"]
    assert list(checkpoint.adapter_keys()) == [key]


def test_an_oversized_run_config_is_refused_unread(tmp_path):
    iteration = _iteration(tmp_path, b"")
    with open(iteration / RUN_CONFIG_NAME, "wb") as handle:
        handle.truncate(16 * 2**20 + 1)  # sparse: nothing is written
    err = outcome(lambda: PeftCheckpoint.open(iteration))
    assert isinstance(err, NotAPeftCheckpoint), err
    assert f"{iteration / RUN_CONFIG_NAME} has {16 * 2**20 + 1} bytes" in str(err)


def test_a_run_config_nested_past_the_parser_depth_is_refused(tmp_path):
    iteration = _iteration(tmp_path, "[" * 10_000 + "]" * 10_000)
    err = outcome(lambda: PeftCheckpoint.open(iteration))
    assert isinstance(err, NotAPeftCheckpoint), err
    assert str(iteration / RUN_CONFIG_NAME) in str(err) and "nested" in str(err)


@pytest.mark.parametrize("text", ["\u00b2".encode(), b"\xff1"], ids=["superscript", "latin1"])
def test_a_tracker_that_names_no_iteration_number_is_refused(text, tmp_path):
    iteration = _iteration(tmp_path, "")
    (iteration.parent / TRACKER_NAME).write_bytes(text)
    err = outcome(lambda: PeftCheckpoint.open(iteration.parent))
    assert isinstance(err, NotAPeftCheckpoint), err
    assert str(iteration.parent / TRACKER_NAME) in str(err) and "names iteration" in str(err)
