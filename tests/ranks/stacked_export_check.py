"""GPT-OSS's stacked expert tensors through the cached export, on every rank of a layout.

Usage: stacked_export_check.py --tp T --ep E --result FILE  (under torchrun, CPU ranks)

Builds the tiny random GPT-OSS model (``testing.conformance.random_megatron_model``), exports it
with stock ``export_hf_weights`` (the oracle) and twice with ``RefitBridge.export_hf_weights``
and the buffer cache on. Checks, on every rank: the fast path ran; both exports equal stock
(names, order, dtype, shape, bytes); the second export wrote every stacked tensor into the
first one's storage and allocated no buffer (the cache's count and bytes unchanged). Writes
``{"rank": ..., "failures": [...], "stacked": N}`` to FILE.rank<R>.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.distributed as dist

from mbridge_refit.convert.session import distributed_session
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.plan.stacking import STACKED_KIND
from mbridge_refit.testing.conformance import random_megatron_model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def check(tp: int, ep: int) -> tuple[list[str], int]:
    layout = ParallelLayout(tp=tp, ep=ep)
    cpu = torch.device("cpu")
    bridge, chunks, _ = random_megatron_model("GptOssForCausalLM", layout, device=cpu)
    stock = [(n, t.clone()) for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)]
    first = [
        (n, t.data_ptr(), t.clone())
        for n, t in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False)
    ]
    after_first = bridge.export_diagnostics()
    second = [
        (n, t.data_ptr(), t.clone())
        for n, t in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False)
    ]
    after_second = bridge.export_diagnostics()
    stacked = {e.hf_name for e in bridge.export_plan(chunks).entries if e.kind == STACKED_KIND}
    failures = []
    if after_second.fallback_reason is not None:
        failures.append(f"stock fallback: {after_second.fallback_reason[:300]}")
    for label, ours in (("first", first), ("second", second)):
        if [n for n, *_ in ours] != [n for n, _ in stock]:
            failures.append(f"{label} export: names or order differ from stock")
        failures += [
            f"{label} export: {n} differs from stock" for (n, _, t), (_, s) in zip(ours, stock) if not _same(t, s)
        ]
    moved = [n for (n, p1, _), (_, p2, _) in zip(first, second) if n in stacked and p1 != p2]
    if moved:
        failures.append(f"stacked tensors not written into the cached buffers: {moved[:3]}")
    if (after_first.buffers, after_first.buffer_bytes) != (after_second.buffers, after_second.buffer_bytes):
        failures.append(f"the second export allocated: {after_first} -> {after_second}")
    if not stacked:
        failures.append("the plan has no stacked expert tensor")
    return failures, len(stacked)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    with distributed_session(layout, device=torch.device("cpu"), timeout=datetime.timedelta(minutes=2)):
        failures, stacked = check(args.tp, args.ep)
        rank = dist.get_rank()
    Path(f"{args.result}.rank{rank}").write_text(json.dumps({"rank": rank, "failures": failures, "stacked": stacked}))


if __name__ == "__main__":
    main()
