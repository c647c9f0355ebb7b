"""Helpers shared by the per-rank check scripts in this folder (run under torchrun by the tests)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import read_checkpoint  # noqa: E402  (tests/oracle.py: the independent checkpoint reader)


def oracle(path: Path) -> Callable[[str], torch.Tensor]:
    """``read(name)`` -> the tensor stored under ``name`` in the HF checkpoint at ``path``."""
    return read_checkpoint(path).__getitem__


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def fail(message: str):
    """Report a failed check on this rank and exit 1 (the test reads the exit code and the message)."""
    print(f"[rank{dist.get_rank()}] CHECK FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)
