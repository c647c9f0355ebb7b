"""Tests for the on-disk oracle: `HFCheckpoint` and `compare_checkpoints`.

Checkpoints here are written with safetensors directly (not with our writer), so the oracle is
tested independently of the sink it checks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mbridge_refit.checkpoints.hf import HFCheckpoint, compare_checkpoints

INDEX = "model.safetensors.index.json"


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "layers.0.w": torch.randn(5, 3, generator=g),
        "layers.0.ids": torch.arange(7, dtype=torch.int64),
        "layers.0.scale": torch.tensor(0.25),
        "norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }


def _save_hf(path: Path, tensors: dict[str, torch.Tensor], *, per_shard: int = 2) -> Path:
    """Write an HF sharded checkpoint with `per_shard` tensors per file, by hand."""
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    chunks = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    weight_map = {}
    for k, chunk in enumerate(chunks):
        file_name = f"model-{k + 1:05d}-of-{len(chunks):05d}.safetensors"
        shard = {n: tensors[n].contiguous() for n in chunk}
        save_file(shard, path / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index))
    return path


def _flip_byte(file: Path, name: str, byte_offset: int) -> None:
    """XOR one byte of tensor `name`'s data inside a safetensors file."""
    raw = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    begin, end = header[name]["data_offsets"]
    assert 0 <= byte_offset < end - begin
    raw[8 + header_len + begin + byte_offset] ^= 0x01
    file.write_bytes(bytes(raw))


# -- HFCheckpoint --------------------------------------------------------------------------


def test_open_sharded_reads_names_shapes_dtypes(tmp_path):
    tensors = _tensors()
    ckpt = HFCheckpoint.open(_save_hf(tmp_path / "a", tensors))
    assert ckpt.names() == sorted(tensors)
    assert len(set(ckpt.weight_map.values())) == 3
    for name, t in tensors.items():
        assert ckpt.shape(name) == tuple(t.shape)
        assert ckpt.dtype(name) == t.dtype
        assert torch.equal(ckpt.tensor(name), t)


def test_open_single_file(tmp_path):
    (tmp_path / "a").mkdir()
    save_file({"w": torch.ones(3)}, tmp_path / "a" / "model.safetensors")
    ckpt = HFCheckpoint.open(tmp_path / "a")
    assert ckpt.weight_map == {"w": "model.safetensors"}
    assert torch.equal(ckpt.tensor("w"), torch.ones(3))


def test_slice_reads_part_of_a_tensor(tmp_path):
    tensors = _tensors()
    ckpt = HFCheckpoint.open(_save_hf(tmp_path / "a", tensors))
    assert torch.equal(ckpt.slice("layers.0.w")[1:3], tensors["layers.0.w"][1:3])


def test_config(tmp_path):
    path = _save_hf(tmp_path / "a", _tensors())
    assert HFCheckpoint.open(path).config() is None
    (path / "config.json").write_text('{"model_type": "llama"}')
    assert HFCheckpoint.open(path).config() == {"model_type": "llama"}


def test_unknown_name_raises_key_error(tmp_path):
    ckpt = HFCheckpoint.open(_save_hf(tmp_path / "a", _tensors()))
    with pytest.raises(KeyError, match="nope"):
        ckpt.tensor("nope")


def test_open_missing_dir_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpoint.open(tmp_path / "missing")


def test_open_dir_without_checkpoint_raises(tmp_path):
    (tmp_path / "a").mkdir()
    save_file({"w": torch.ones(1)}, tmp_path / "a" / "other.safetensors")
    expected = r"model\.safetensors\.index\.json.*other\.safetensors"
    with pytest.raises(FileNotFoundError, match=expected):
        HFCheckpoint.open(tmp_path / "a")


def test_open_index_with_missing_shard_raises(tmp_path):
    path = _save_hf(tmp_path / "a", _tensors())
    (path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003"):
        HFCheckpoint.open(path)


# -- compare_checkpoints -------------------------------------------------------------------


def test_identical_checkpoints_compare_equal(tmp_path):
    a = _save_hf(tmp_path / "a", _tensors())
    b = _save_hf(tmp_path / "b", _tensors(), per_shard=4)  # different sharding, same tensors
    assert compare_checkpoints(a, b) == []
    assert compare_checkpoints(a, a) == []


def test_missing_and_extra_names(tmp_path):
    tensors = _tensors()
    a = _save_hf(tmp_path / "a", tensors)
    changed = {k: v for k, v in tensors.items() if k != "layers.0.ids"} | {"extra": torch.ones(1)}
    b = _save_hf(tmp_path / "b", changed)
    diffs = compare_checkpoints(a, b)
    assert len(diffs) == 2
    assert diffs[0].startswith("only in A") and diffs[0].endswith("layers.0.ids")
    assert diffs[1].startswith("only in B") and diffs[1].endswith("extra")


def test_dtype_change(tmp_path):
    tensors = _tensors()
    a = _save_hf(tmp_path / "a", tensors)
    b = _save_hf(tmp_path / "b", tensors | {"norm.weight": tensors["norm.weight"].float()})
    assert compare_checkpoints(a, b) == ["dtype mismatch: norm.weight: A torch.bfloat16 vs B torch.float32"]


def test_shape_change(tmp_path):
    tensors = _tensors()
    a = _save_hf(tmp_path / "a", tensors)
    b = _save_hf(tmp_path / "b", tensors | {"layers.0.w": tensors["layers.0.w"].t()})
    assert compare_checkpoints(a, b) == ["shape mismatch: layers.0.w: A [5, 3] vs B [3, 5]"]


def test_one_flipped_byte_is_caught(tmp_path):
    tensors = _tensors()
    a = _save_hf(tmp_path / "a", tensors)
    b = _save_hf(tmp_path / "b", tensors)
    file = b / HFCheckpoint.open(b).weight_map["layers.0.w"]
    _flip_byte(file, "layers.0.w", byte_offset=4 * 7)  # lowest mantissa byte of element 7
    diffs = compare_checkpoints(a, b)
    assert len(diffs) == 1
    assert diffs[0].startswith("byte mismatch: layers.0.w: 1 of 15 elements differ, max abs diff ")
    before = tensors["layers.0.w"].reshape(-1)[7]
    after = HFCheckpoint.open(b).tensor("layers.0.w").reshape(-1)[7]
    assert float(diffs[0].rsplit(" ", 1)[1]) == pytest.approx(float(abs(after - before)), rel=1e-5)


def test_one_changed_element_in_0d_tensor(tmp_path):
    tensors = _tensors()
    a = _save_hf(tmp_path / "a", tensors)
    b = _save_hf(tmp_path / "b", tensors | {"layers.0.scale": torch.tensor(0.5)})
    assert compare_checkpoints(a, b) == ["byte mismatch: layers.0.scale: 1 of 1 elements differ, max abs diff 0.25"]


def test_bitwise_compare_sees_nan_payload_and_signed_zero(tmp_path):
    quiet_nan = torch.tensor([float("nan"), 0.0])
    # A NaN with another payload, and -0.0.
    other_nan = torch.tensor([0x7FC00001, -(2**31)], dtype=torch.int32).view(torch.float32)
    a = _save_hf(tmp_path / "a", {"w": quiet_nan})
    b = _save_hf(tmp_path / "b", {"w": other_nan})
    (diff,) = compare_checkpoints(a, b)
    assert diff.startswith("byte mismatch: w: 2 of 2 elements differ")
    assert "max abs diff 0" in diff and "1 differing elements are NaN/inf" in diff


# -- damaged checkpoints: bad input, never a "difference" ---------------------------------------


def _verify(a: Path, b: Path, capsys) -> tuple[int, str]:
    from mbridge_refit.convert import main

    code = main(["verify", str(a), str(b)])
    return code, capsys.readouterr().err


def test_unlisted_second_copy_of_a_tensor_is_refused(tmp_path, capsys):
    good = _save_hf(tmp_path / "a", _tensors())
    bad = _save_hf(tmp_path / "b", _tensors())
    first = sorted(bad.glob("model-00001-*.safetensors"))[0]
    extra = {"norm.weight": torch.zeros(4, dtype=torch.bfloat16), "embed.weight": _tensors()["embed.weight"]}
    save_file({**extra, "layers.0.w": _tensors()["layers.0.w"]}, first, metadata={"format": "pt"})
    code, err = _verify(good, bad, capsys)
    assert code == 2, err
    assert "holds norm.weight, which the index does not list there" in err and first.name in err


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncate", "cannot read"),
        ("garbage_header", "cannot read"),
        ("huge_header", "cannot read"),
        ("bad_index", "cannot read"),
    ],
)
def test_damaged_checkpoint_is_bad_input(damage, needle, tmp_path, capsys):
    good = _save_hf(tmp_path / "a", _tensors())
    bad = _save_hf(tmp_path / "b", _tensors())
    shard = sorted(bad.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) - 7])
    elif damage == "garbage_header":
        shard.write_bytes(data[:8] + b"\x00not json" + data[17:])
    elif damage == "huge_header":
        shard.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    else:
        (bad / INDEX).write_text("{not json")
    code, err = _verify(good, bad, capsys)
    assert code == 2, err
    assert needle in err and (shard.name in err or INDEX in err)


def test_roundtrip_refuses_a_damaged_source_before_any_work(tmp_path, capsys):
    from mbridge_refit.convert import main
    from mbridge_refit.models import recipes

    source = recipes.make_random_checkpoint(
        recipes.get_model_recipe("qwen3-tiny"), tmp_path / "src", seed=1, max_shard_bytes=64 * 1024
    )
    shard = sorted(source.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-5])
    code = main(["roundtrip", "--hf", str(source), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert shard.name in err and "damaged" in err
    assert not (tmp_path / "out").exists()


def _without_file_permission_override() -> None:
    """In the child, before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding
    set, so even root is denied a file its mode denies (as a user without those rights is)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "cannot drop a capability")


def test_an_unreadable_shard_is_reported_with_its_real_reason(tmp_path):
    """safetensors reports a shard it may not open as "No such file or directory": the message
    must say permission denied (a real one: mode 000, read by a process without the override)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    good = _save_hf(tmp_path / "a", _tensors())
    bad = _save_hf(tmp_path / "b", _tensors())
    shard = sorted(bad.glob("*.safetensors"))[1]
    shard.chmod(0)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "mbridge_refit.convert", "verify", str(good), str(bad)],
            cwd=REPO,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=_without_file_permission_override if os.geteuid() == 0 else None,
        )
    except subprocess.SubprocessError as err:
        if "preexec_fn" in str(err):  # _without_file_permission_override failed: no CAP_SETPCAP
            pytest.skip("running as root without CAP_SETPCAP: cannot make a file unreadable to the child")
        raise
    finally:
        shard.chmod(0o644)
    output = run.stdout + run.stderr
    assert run.returncode == 2, output[-3000:]
    assert f"cannot read {shard}: PermissionError" in output and "Permission denied" in output, output[-3000:]
    assert "No such file" not in output, output[-3000:]


def test_a_directory_in_place_of_a_shard_is_reported_as_one(tmp_path, capsys):
    good = _save_hf(tmp_path / "a", _tensors())
    bad = _save_hf(tmp_path / "b", _tensors())
    shard = sorted(bad.glob("*.safetensors"))[1]
    shard.unlink()
    shard.mkdir()
    code, err = _verify(good, bad, capsys)
    assert code == 2, err
    assert f"cannot read {shard}: IsADirectoryError" in err, err
