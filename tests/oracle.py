"""The independent oracle: compare two checkpoints on disk with plain safetensors reads.

Deliberately does not use mbridge_refit's own reader or comparer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as handle:
            for name in handle.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = handle.get_tensor(name)
    return tensors


def assert_bitwise_equal_checkpoints(source: Path, exported: Path) -> None:
    expected, actual = read_checkpoint(source), read_checkpoint(exported)
    assert sorted(actual) == sorted(expected), (
        f"names differ: missing {sorted(set(expected) - set(actual))}, extra {sorted(set(actual) - set(expected))}"
    )
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
            f"{name}: bytes differ"
        )


def stacked_experts(experts: list[torch.Tensor], *, interleave: int, transpose: bool) -> torch.Tensor:
    """The stacked HF tensor of ``experts`` by its definition, with plain indexing: parameter row
    ``b*h + i`` (``h`` = rows / ``interleave``) lands in slot row ``interleave*i + b``; with
    ``transpose`` each slot's two dimensions are swapped (Qwen3-VL-MoE's published, GPT-OSS's layout)."""
    slots = []
    for expert in experts:
        h = expert.shape[0] // interleave
        slot = expert[[b * h + i for i in range(h) for b in range(interleave)]]
        slots.append(slot.t() if transpose else slot)
    return torch.stack(slots)
