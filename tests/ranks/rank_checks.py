"""Helpers shared by the per-rank check scripts in this folder (run under torchrun by the tests)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import read_checkpoint  # noqa: E402  (tests/oracle.py: the independent checkpoint reader)


def oracle(path: Path) -> Callable[[str], torch.Tensor]:
    """``read(name)`` -> the tensor stored under ``name`` in the HF checkpoint at ``path``."""
    return read_checkpoint(path).__getitem__


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def fail(message: str):
    """Report a failed check on this rank and exit 1 (the test reads the exit code and the message)."""
    print(f"[rank{dist.get_rank()}] CHECK FAILED: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def checker_parser() -> argparse.ArgumentParser:
    """``--hf CKPT --result DIR`` and the layout flags: what every checkpoint-based checker takes."""
    from mbridge_refit.convert.flags import add_layout_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    add_layout_flags(parser)
    return parser


@contextlib.contextmanager
def checkpoint_session(
    path: Path, layout, params_dtype: torch.dtype = torch.bfloat16, timeout: datetime.timedelta | None = None
) -> Iterator[tuple]:
    """Inside a CPU (gloo) session at ``layout`` (its collectives' ``timeout``: 5 minutes unless
    given): ``(RefitBridge, model chunks)`` for the checkpoint at ``path``, built in
    ``params_dtype`` and loaded from the checkpoint."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model

    cpu = torch.device("cpu")
    with distributed_session(layout, device=cpu, timeout=timeout or datetime.timedelta(minutes=5)):
        bridge = RefitBridge.from_hf_pretrained(path)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=params_dtype))
        bridge.load_hf_shards(chunks, path)
        yield bridge, chunks


def change_weights(bridge, chunks) -> dict[str, torch.Tensor]:
    """Change every trainer parameter in place (x1.5 + 0.25); returns the stock export of the
    changed model (every HF tensor whole, on every rank: the oracle of the next refit)."""
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.mul_(1.5).add_(0.25)
    return {name: t.clone() for name, t in bridge.export_hf_weights_stock(chunks, show_progress=False)}
