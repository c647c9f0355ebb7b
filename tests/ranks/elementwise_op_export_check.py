"""Qwen3-Next's zero-centred norms (an elementwise op on export) through the cached export.

Usage: elementwise_op_export_check.py --tp T --result FILE  (under torchrun, CPU ranks)

Builds the tiny random Qwen3-Next model (``testing.conformance.random_megatron_model``), exports it
with stock ``export_hf_weights`` (the oracle) and twice with ``RefitBridge.export_hf_weights``
and the buffer cache on. Checks, on every rank: the fast path ran and planned the op; both
exports equal stock (names, order, dtype, shape, bytes), so the op is applied once per export
to freshly assembled slices, never twice; no norm parameter changed (the op never ran on a view
of one); ``live_rows`` names no tensor with an op. Writes ``{"rank": ..., "failures": [...],
"with_op": N}`` to FILE.rank<R>.
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
from mbridge_refit.testing.conformance import random_megatron_model


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def check(tp: int) -> tuple[list[str], int]:
    bridge, chunks, _ = random_megatron_model("Qwen3NextForCausalLM", ParallelLayout(tp=tp), device=torch.device("cpu"))
    norms = {
        n: p.detach().clone() for chunk in chunks for n, p in chunk.named_parameters() if n.endswith("out_norm.weight")
    }
    stock = [(n, t.clone()) for n, t in bridge.export_hf_weights_stock(chunks, show_progress=False)]
    exports = [
        [(n, t.clone()) for n, t in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False)]
        for _ in range(2)
    ]
    with_op = {e.hf_name for e in bridge.export_plan(chunks).entries if e.elementwise_op is not None}
    failures = []
    if bridge.export_diagnostics().fallback_reason is not None:
        failures.append(f"stock fallback: {bridge.export_diagnostics().fallback_reason[:300]}")
    for label, ours in zip(("first", "second"), exports):
        if [n for n, _ in ours] != [n for n, _ in stock]:
            failures.append(f"{label} export: names or order differ from stock")
        failures += [
            f"{label} export: {n} differs from stock" for (n, t), (_, s) in zip(ours, stock) if not _same(t, s)
        ]
    now = {n: p.detach() for chunk in chunks for n, p in chunk.named_parameters() if n in norms}
    failures += [f"parameter {n} changed by the export" for n, kept in norms.items() if not _same(now[n], kept)]
    live = with_op & set(bridge.live_rows(chunks))
    if live:
        failures.append(f"live_rows names tensors with an op: {sorted(live)[:3]}")
    if not with_op or not norms:
        failures.append("the plan has no entry with an elementwise op")
    return failures, len(with_op)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    with distributed_session(
        ParallelLayout(tp=args.tp), device=torch.device("cpu"), timeout=datetime.timedelta(minutes=2)
    ):
        failures, with_op = check(args.tp)
        rank = dist.get_rank()
    Path(f"{args.result}.rank{rank}").write_text(json.dumps({"rank": rank, "failures": failures, "with_op": with_op}))


if __name__ == "__main__":
    main()
