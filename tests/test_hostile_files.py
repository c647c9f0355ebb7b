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
    never blocks: ``validate`` refuses it as IsADirectoryError, tests/test_checkpoint.py.) The device
    is a link to ``/dev/zero`` (no ``mknod`` without privileges): a link out of the checkpoint."""
    checkpoint = shutil.copytree(sharded, tmp_path / "hf")
    shard = checkpoint / _a_shard(checkpoint)
    shard.unlink()
    make(shard)
    err = outcome(lambda: HFCheckpoint.open(checkpoint).validate(), unblock=shard if kind == "FIFO" else None)
    assert isinstance(err, CheckpointError), err
    message = str(err)
    if kind == "FIFO":
        assert f"{shard} is a {kind}" in message and "must be a regular safetensors file" in message
    else:
        assert f"{shard} leads to /dev/zero, outside the checkpoint directory" in message


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


# --- shards linked from outside the checkpoint: the rule side files follow ------------------------------


def _linked_outside(source: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A copy of ``source`` whose file ``name`` is a link to an intact copy of it outside the checkpoint."""
    checkpoint = shutil.copytree(source, tmp_path / "hf")
    elsewhere = tmp_path / "elsewhere" / name
    elsewhere.parent.mkdir()
    shutil.move(checkpoint / name, elsewhere)
    (checkpoint / name).symlink_to(elsewhere)
    return checkpoint, elsewhere


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "single"
    return recipes.make_random_checkpoint(recipes.get_model_recipe("qwen3-tiny"), out, seed=7)


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_a_shard_linked_from_outside_the_checkpoint_is_refused(sharded, single, layout, tmp_path, capsys):
    """A shard (or the single model.safetensors) that is a link to a file elsewhere was read as the
    checkpoint's own: its tensors went into the output. Refused by name, as a side file is, before
    any shard is opened; exit 2 from the command line, nothing written."""
    from mbridge_refit.convert import ExitCode, main

    source = sharded if layout == "sharded" else single
    name = _a_shard(sharded) if layout == "sharded" else "model.safetensors"
    checkpoint, elsewhere = _linked_outside(source, tmp_path, name)
    with pytest.raises(CheckpointError) as refused:
        HFCheckpoint.open(checkpoint)
    assert f"{checkpoint / name} leads to {elsewhere}, outside the checkpoint directory" in str(refused.value)
    assert "copy the file into the checkpoint directory" in str(refused.value)
    for argv in (["verify", source, checkpoint], ["roundtrip", "--hf", checkpoint, "--out", tmp_path / "out"]):
        assert main([str(a) for a in argv]) == ExitCode.BAD_INPUT
        err = capsys.readouterr().err
        assert f"{checkpoint / name} leads to {elsewhere}" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_shard_swapped_for_a_link_outside_after_the_index_was_read_is_refused(sharded, tmp_path):
    checkpoint = shutil.copytree(sharded, tmp_path / "hf")
    opened = HFCheckpoint.open(checkpoint)
    shard = _a_shard(checkpoint)
    name = next(name for name, file in opened.weight_map.items() if file == shard)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(checkpoint / shard, elsewhere)
    (checkpoint / shard).symlink_to(elsewhere)
    for call in (opened.validate, lambda: opened.tensor(name)):
        err = outcome(call)
        assert isinstance(err, CheckpointError) and f"leads to {elsewhere}, outside the checkpoint" in str(err), err


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_shards_linked_into_a_hub_cache_blobs_are_read(sharded, single, layout, tmp_path):
    """A Hugging Face cache snapshot (``snapshots/<rev>/<file> -> ../../blobs/<hash>``, every file a link)
    reads as before: the same tensors as the plain checkpoint."""
    source = sharded if layout == "sharded" else single
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for index, file in enumerate(sorted(source.iterdir())):
        shutil.copy(file, blobs / f"{index:040x}")
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / f"{index:040x}")
    hub, plain = HFCheckpoint.open(snapshot), HFCheckpoint.open(source)
    hub.validate()
    assert hub.names() == plain.names()
    assert all(hub.tensor(name).equal(plain.tensor(name)) for name in plain.names())


# --- found by tests/test_fuzz_inputs.py --------------------------------------------------------------


@pytest.mark.parametrize("missing", ["shard", "weights"])
def test_missing_shards_are_the_packages_input_error(sharded, missing, tmp_path):
    """An index naming a shard that does not exist (or no weights at all) raised a bare
    FileNotFoundError: ``export-adapter``, which opens ``--hf``'s weights after its checks, exited 3
    with a traceback. Now a ``CheckpointError`` (still a FileNotFoundError): exit 2."""
    from mbridge_refit.convert import ExitCode
    from mbridge_refit.convert.app import classify

    checkpoint = shutil.copytree(sharded, tmp_path / "hf")
    if missing == "shard":
        index = json.loads((checkpoint / INDEX_NAME).read_text())
        index["weight_map"]["extra.weight"] = "model-00009-of-00009.safetensors"
        (checkpoint / INDEX_NAME).write_text(json.dumps(index))
    else:
        for file in checkpoint.glob("*.safetensors*"):
            file.unlink()
    with pytest.raises(CheckpointError, match="shard files that do not exist|no checkpoint in") as refused:
        HFCheckpoint.open(checkpoint)
    assert isinstance(refused.value, FileNotFoundError)
    assert classify(refused.value).code == ExitCode.BAD_INPUT


# --- a header naming a key twice -----------------------------------------------------------------------


def test_a_long_header_naming_a_key_twice_is_refused_in_linear_time(tmp_path):
    keys = 20_000
    header = ("{" + ",".join(f'"k{i}":0' for i in range(keys)) + ',"k0":0}').encode()
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"its header .*names \['k0'\] more than once"):
        HFCheckpoint.open(checkpoint)
    assert time.perf_counter() - start < 5.0


# --- JSON naming a key twice: json.loads keeps the last value silently -------------------------------


def _with_key_twice(text: str, key: str, value: object) -> str:
    """``text`` (a JSON object's text) with ``key`` given again, inside the object that holds it."""
    at = text.index(json.dumps(key) + ":")
    return text[:at] + f"{json.dumps(key)}: {json.dumps(value)}, " + text[at:]


def test_an_index_listing_a_tensor_twice_is_refused_naming_it(sharded, tmp_path, capsys):
    """The weight_map gave a tensor twice (once per shard): the last entry won without a word."""
    from mbridge_refit.convert import ExitCode, main

    checkpoint = shutil.copytree(sharded, tmp_path / "hf")
    index = json.loads((checkpoint / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == shards[0])
    (checkpoint / INDEX_NAME).write_text(_with_key_twice(json.dumps(index), name, shards[1]))
    with pytest.raises(CheckpointError, match=rf"{INDEX_NAME}: one object names \['{name}'\] more than once"):
        HFCheckpoint.open(checkpoint)
    assert main(["verify", str(sharded), str(checkpoint)]) == ExitCode.BAD_INPUT
    assert f"names ['{name}'] more than once" in capsys.readouterr().err


def test_a_config_naming_a_key_twice_is_refused_naming_it(sharded, tmp_path):
    from mbridge_refit.checkpoints.hf import ConfigError, read_config_json

    path = tmp_path / "config.json"
    path.write_text(_with_key_twice((sharded / "config.json").read_text(), "vocab_size", 1024))
    with pytest.raises(ConfigError, match=r"config.json is not the JSON of a config .*\['vocab_size'\] more than once"):
        read_config_json(path)


def test_megatron_metadata_naming_a_key_twice_is_refused_naming_it(tmp_path):
    from mbridge_refit.checkpoints.megatron import METADATA_NAME, CheckpointInfo, NotAMegatronCheckpoint

    info = {"format": "mbridge_refit.checkpoints.megatron", "version": 1, "params_dtype": "bfloat16"}
    (tmp_path / METADATA_NAME).write_text(_with_key_twice(json.dumps(info), "params_dtype", "float32"))
    with pytest.raises(NotAMegatronCheckpoint, match=r"\['params_dtype'\] more than once"):
        CheckpointInfo.read(tmp_path)


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


@pytest.mark.parametrize("value", ["orthogonal", ["xavier"]], ids=["unknown", "a-list"])
@pytest.mark.parametrize("field", ["lora_A_init_method", "lora_B_init_method"])
def test_a_lora_init_method_the_adapters_cannot_build_is_refused(field, value, tmp_path):
    """LoRA takes any string for its init methods; wrapping the model then raised NotImplementedError
    (``export-adapter`` exit 3 with a traceback, found by tests/test_fuzz_inputs.py). Now refused by name
    when the LoRA is made, before the model is wrapped."""
    import megatron.bridge.peft.lora  # noqa: F401  (imported here: outcome's 10 s are the reader's alone)
    import torch
    import torch.distributed.checkpoint as dcp

    iteration = tmp_path / "save" / "iter_0000001"
    key = "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"
    dcp.save({key: torch.zeros(2, 2)}, checkpoint_id=iteration, no_dist=True)
    peft = {"_target_": LORA_TARGET, "dim": 4, field: value}
    (iteration / RUN_CONFIG_NAME).write_text(json.dumps({"model": {"num_layers": 2}, "peft": peft}))
    err = outcome(lambda: PeftCheckpoint.open(iteration).lora())
    assert isinstance(err, NotAPeftCheckpoint), err
    assert f"peft.{field} is {value!r}, not one of ['kaiming', 'normal', 'xavier', 'zero']" in str(err)


@pytest.mark.parametrize("value", [1024, -0.5, True, "0.1"])
def test_a_lora_dropout_that_is_not_a_probability_is_refused(value, tmp_path):
    """torch's Dropout refused it only while the model was wrapped (``export-adapter`` exit 3 with a
    traceback, found by tests/test_fuzz_inputs.py). Now refused by name when the LoRA is made."""
    import megatron.bridge.peft.lora  # noqa: F401  (imported here: outcome's 10 s are the reader's alone)
    import torch
    import torch.distributed.checkpoint as dcp

    iteration = tmp_path / "save" / "iter_0000001"
    key = "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight"
    dcp.save({key: torch.zeros(2, 2)}, checkpoint_id=iteration, no_dist=True)
    peft = {"_target_": LORA_TARGET, "dim": 4, "dropout": value}
    (iteration / RUN_CONFIG_NAME).write_text(json.dumps({"model": {"num_layers": 2}, "peft": peft}))
    err = outcome(lambda: PeftCheckpoint.open(iteration).lora())
    assert isinstance(err, NotAPeftCheckpoint), err
    assert f"peft.dropout is {value!r}, not a probability in [0, 1]" in str(err)


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
