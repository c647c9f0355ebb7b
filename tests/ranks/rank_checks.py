"""Helpers shared by the per-rank check scripts in this folder (run under torchrun by the tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open


def oracle(path: Path):
    """``read(name)`` -> the tensor stored under ``name`` in the HF checkpoint at ``path`` (plain safetensors)."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())["weight_map"] if index_file.exists() else None
    handles = {}

    def read(name: str) -> torch.Tensor:
        file = index[name] if index else "model.safetensors"
        if file not in handles:
            handles[file] = safe_open(str(path / file), framework="pt")
        return handles[file].get_tensor(name)

    return read


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def fail(message: str):
    """Report a failed check on this rank and exit 1 (the test reads the exit code and the message)."""
    print(f"[rank{dist.get_rank()}] CHECK FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)
