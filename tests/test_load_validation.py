"""A checkpoint whose tensors do not match its config is refused with exit code 2, never cropped.

The source checkpoints are tiny recipes with one tensor rewritten (with safetensors directly) to
a shape the config does not describe; the output directory must not be created.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.multirank


def with_tensor_reshaped(source, dest, name, grow_dim, by=1):
    """Copy ``source`` to ``dest`` with tensor ``name`` grown (or shrunk, ``by`` < 0) along ``grow_dim``."""
    shutil.copytree(source, dest)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    shard = dest / index["weight_map"][name]
    tensors = load_file(str(shard))
    old = tensors[name]
    shape = list(old.shape)
    shape[grow_dim] += by
    new = torch.zeros(shape, dtype=old.dtype)
    keep = [slice(0, min(a, b)) for a, b in zip(old.shape, shape)]
    new[tuple(keep)] = old[tuple(keep)]
    tensors[name] = new
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return list(old.shape), shape


@pytest.mark.parametrize(
    ("name", "dim", "by"),
    [
        ("model.embed_tokens.weight", 0, 8),  # more vocabulary rows than vocab_size
        ("model.layers.0.input_layernorm.weight", 0, 1),  # a longer norm
        ("model.layers.1.mlp.down_proj.weight", 1, 4),  # a wider projection
        ("model.layers.0.self_attn.q_proj.weight", 0, -2),  # a smaller one
    ],
    ids=["embedding-rows", "norm-longer", "projection-wider", "projection-smaller"],
)
def test_mismatched_tensor_is_refused(name, dim, by, source_checkpoints, tmp_path):
    bad = tmp_path / "bad"
    expected, found = with_tensor_reshaped(source_checkpoints("qwen3-tiny"), bad, name, dim, by)
    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(bad), "--out", str(tmp_path / "out")])
    assert run.returncode == 2, run.output[-3000:]
    assert f"{name!r}" in run.output and str(found) in run.output and str(expected) in run.output, run.output[-3000:]
    assert not (tmp_path / "out").exists()


def test_mismatch_on_one_rank_fails_every_rank_without_a_hang(source_checkpoints, tmp_path):
    """At PP2 only the last stage holds the final norm: the first stage must fail too, at once."""
    bad = tmp_path / "bad"
    with_tensor_reshaped(source_checkpoints("qwen3-tiny"), bad, "model.norm.weight", 0, 1)
    run = torchrun(
        2,
        [
            "mbridge_refit.convert",
            "roundtrip",
            "--hf",
            str(bad),
            "--out",
            str(tmp_path / "out"),
            "--pp",
            "2",
            "--timeout-s",
            "120",
        ],
        timeout=240,
    )
    assert run.returncode != 0 and run.output.count("(exitcode: 2)") >= 1, run.output[-3000:]
    assert "model.norm.weight" in run.output and "another rank" in run.output


def with_tensor_stored_as(source, dest, name, dtype, nudge: bool):
    """Copy ``source`` to ``dest`` with tensor ``name`` stored as ``dtype``; with ``nudge`` one value
    gets a low mantissa bit the model's dtype cannot hold."""
    shutil.copytree(source, dest)
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    shard = dest / index["weight_map"][name]
    tensors = load_file(str(shard))
    wide = tensors[name].to(dtype)
    if nudge:
        wide.view(-1)[3] = 1 + 2**-20  # needs 21 mantissa bits; bfloat16 has 7
    tensors[name] = wide
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return tensors[name]


def test_lossy_dtype_is_refused(source_checkpoints, tmp_path):
    """A float32 tensor with a value bfloat16 cannot hold: converting it would change the weight."""
    name = "model.layers.1.mlp.up_proj.weight"
    with_tensor_stored_as(source_checkpoints("qwen3-tiny"), tmp_path / "bad", name, torch.float32, nudge=True)
    run = torchrun(
        1, ["mbridge_refit.convert", "roundtrip", "--hf", str(tmp_path / "bad"), "--out", str(tmp_path / "out")]
    )
    assert run.returncode == 2, run.output[-3000:]
    assert f"{name!r}" in run.output and "float32" in run.output and "bfloat16" in run.output, run.output[-3000:]
    assert "changes 1 of" in run.output and '"dtype"' in run.output
    assert not (tmp_path / "out").exists()


def test_following_the_lossy_dtype_fix_loads_the_checkpoint_exactly(source_checkpoints, tmp_path):
    """The refusal's fix (set "dtype" in config.json to the wider dtype) is what the command line
    then does: the model keeps float32 parameters, and the round trip and an import/export through a
    Megatron checkpoint give back the mixed-dtype checkpoint bit for bit."""
    import re

    from oracle import assert_bitwise_equal_checkpoints

    name = "model.layers.1.mlp.up_proj.weight"
    mixed = tmp_path / "mixed"
    with_tensor_stored_as(source_checkpoints("qwen3-tiny"), mixed, name, torch.float32, nudge=True)
    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(mixed), "--out", str(tmp_path / "refused")])
    assert run.returncode == 2, run.output[-3000:]
    advice = re.search(r'Fix: set "dtype" in config.json to "(\w+)"', run.output)
    assert advice is not None and advice[1] == "float32", run.output[-3000:]
    config = json.loads((mixed / "config.json").read_text())
    config["dtype"] = advice[1]
    (mixed / "config.json").write_text(json.dumps(config, indent=2))

    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(mixed), "--out", str(tmp_path / "out")])
    assert run.returncode == 0, run.output[-3000:]
    assert_bitwise_equal_checkpoints(mixed, tmp_path / "out")
    run = torchrun(1, ["mbridge_refit.convert", "import", "--hf", str(mixed), "--megatron", str(tmp_path / "mcore")])
    assert run.returncode == 0, run.output[-3000:]
    run = torchrun(
        1, ["mbridge_refit.convert", "export", "--megatron", str(tmp_path / "mcore"), "--out", str(tmp_path / "back")]
    )
    assert run.returncode == 0, run.output[-3000:]
    assert_bitwise_equal_checkpoints(mixed, tmp_path / "back")


def test_exact_dtype_cast_roundtrips_bit_for_bit(source_checkpoints, tmp_path):
    """bfloat16 values saved as float32 load exactly and come back as the same float32 bytes."""
    from oracle import assert_bitwise_equal_checkpoints

    name = "model.layers.0.self_attn.o_proj.weight"
    stored = with_tensor_stored_as(
        source_checkpoints("qwen3-tiny"), tmp_path / "wide", name, torch.float32, nudge=False
    )
    assert stored.dtype == torch.float32
    run = torchrun(
        1, ["mbridge_refit.convert", "roundtrip", "--hf", str(tmp_path / "wide"), "--out", str(tmp_path / "out")]
    )
    assert run.returncode == 0, run.output[-3000:]
    assert_bitwise_equal_checkpoints(tmp_path / "wide", tmp_path / "out")


def test_packed_expert_tensor_of_another_expert_count_is_refused(tmp_path):
    """A packed expert tensor ([E, ...], one tensor for every expert of a layer) with one expert fewer
    than the config's is refused by name with both shapes, never read slot by slot into a model
    whose last expert it lacks."""
    from safetensors import safe_open

    from mbridge_refit.testing.tiny_models import write_tiny_checkpoint

    bad = write_tiny_checkpoint("Glm4MoeForCausalLM+packed_experts", tmp_path / "bad")
    (shard,) = bad.glob("*.safetensors")
    with safe_open(str(shard), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    name = next(n for n in sorted(tensors) if n.endswith("mlp.experts.gate_up_proj"))
    expected = list(tensors[name].shape)
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(bad), "--out", str(tmp_path / "out")])
    assert run.returncode == 2, run.output[-3000:]
    found = [expected[0] - 1, *expected[1:]]
    assert f"{name!r}" in run.output and str(found) in run.output and str(expected) in run.output, run.output[-3000:]
    assert not (tmp_path / "out").exists()


def test_float32_expert_bias_loads_as_megatron_keeps_it(tmp_path):
    """Routers' expert biases are float32 in Megatron-Core (it switches them before loading a state
    dict); ERNIE 4.5's float32 ``e_score_correction_bias`` (values bf16 cannot hold) comes back bit
    for bit, where a load into the bf16 buffer of the CPU build refuses it as a lossy cast. (Its
    router weights, float32 in transformers' checkpoints too, are stored in bf16 here: a float32
    router weight into the bf16 model is refused, as it should be.)"""
    from safetensors import safe_open

    from mbridge_refit.testing.tiny_models import (
        checkpoint_tensors,
        write_tiny_checkpoint,
    )

    source = write_tiny_checkpoint("Ernie4_5_MoeForCausalLM", tmp_path / "source")
    (shard,) = source.glob("*.safetensors")
    with safe_open(str(shard), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    biases = [n for n in tensors if n.endswith("e_score_correction_bias")]
    assert biases and all(tensors[n].dtype == torch.float32 for n in biases)
    for name in biases:
        tensors[name] = tensors[name] + 2**-20  # needs 21 mantissa bits near 1: not a bf16 value
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        tensors[name] = tensors[name].to(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(tmp_path / "out")])
    assert run.returncode == 0, run.output[-3000:]
    written = dict(checkpoint_tensors(tmp_path / "out"))
    assert sorted(written) == sorted(tensors)
    for name, tensor in tensors.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name


def test_a_source_tensor_no_mapping_reads_is_named_in_a_warning(source_checkpoints, tmp_path):
    """A checkpoint tensor no mapping of the bridge reads cannot come back (the Megatron model has no
    place for it); the roundtrip writes the rest and names it in a warning instead of dropping it
    silently."""
    source = tmp_path / "source"
    shutil.copytree(source_checkpoints("qwen3-tiny"), source)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    shard_name = next(iter(index["weight_map"].values()))
    tensors = load_file(str(source / shard_name))
    tensors["model.pooling_head.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    save_file(tensors, str(source / shard_name), metadata={"format": "pt"})
    index["weight_map"]["model.pooling_head.weight"] = shard_name
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(tmp_path / "out")])
    assert run.returncode == 0, run.output[-3000:]
    assert (
        "the output lacks 1 tensors of the source checkpoint" in run.output
        and "model.pooling_head.weight" in run.output
    ), run.output[-3000:]
