"""HF -> Megatron (every claimed layout, real ranks under torchrun on CPU) -> HF, bit for bit.

The oracle is the source checkpoint on disk (tests/oracle.py reads both with plain safetensors).
"""

from __future__ import annotations

import shutil

import pytest
from conftest import torchrun
from oracle import assert_bitwise_equal_checkpoints, read_checkpoint

from mbridge_refit.models import recipes

pytestmark = pytest.mark.multirank

DENSE_LAYOUTS = ["tp1", "tp2", "pp2", "pp2_vpp2", "tp2_pp2"]
MOE_LAYOUTS = [
    "tp2",
    "pp2",
    "pp2_vpp2",
    "ep2",
    "tp2_ep2",
    "tp2_pp2",
    "tp2_etp2",
    "tp2_ep2_etp2",
    "tp2_pp2_etp2",
    "etp2",
]
CASES = (
    [("qwen3-tiny", layout) for layout in DENSE_LAYOUTS]
    + [("llama-tied-tiny", layout) for layout in DENSE_LAYOUTS if layout != "tp1"]
    + [("qwen3-moe-tiny", layout) for layout in MOE_LAYOUTS]
)


def layout_flags(name: str) -> tuple[int, list[str]]:
    layout = recipes.get_layout(name)
    flags = ["--tp", str(layout.tp), "--pp", str(layout.pp), "--ep", str(layout.ep), "--etp", str(layout.etp)]
    if layout.vpp:
        flags += ["--vpp", str(layout.vpp)]
    return layout.expected_world_size, flags


@pytest.mark.parametrize(("recipe", "layout"), CASES, ids=[f"{r}-{layout}" for r, layout in CASES])
def test_roundtrip_is_bitwise_exact(recipe, layout, source_checkpoints, tmp_path):
    source = source_checkpoints(recipe)
    out = tmp_path / "out"
    nproc, flags = layout_flags(layout)
    run = torchrun(nproc, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(out), *flags])
    assert run.returncode == 0, run.output[-6000:]
    assert_bitwise_equal_checkpoints(source, out)
    assert (out / "config.json").read_text() == (source / "config.json").read_text()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_verify_catches_one_corrupted_tensor(source_checkpoints, tmp_path):
    source = source_checkpoints("qwen3-tiny")
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert torchrun(1, ["mbridge_refit.convert", "verify", str(source), str(copy)]).returncode == 0

    name = "model.layers.1.self_attn.k_proj.weight"
    original = read_checkpoint(source)[name]
    file = _file_holding(copy, name)
    data = bytearray(file.read_bytes())
    position = _find_tensor_bytes(data, original)
    data[position] ^= 0x01  # flip one bit of the first element
    file.write_bytes(bytes(data))

    run = torchrun(1, ["mbridge_refit.convert", "verify", str(source), str(copy)])
    assert run.returncode == 1, run.output
    assert name in run.output


def _file_holding(path, name):
    import json

    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][name]


def _find_tensor_bytes(data: bytearray, tensor) -> int:
    raw = tensor.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
    position = bytes(data).find(raw)
    assert position > 0, "tensor bytes not found in its file"
    return position
