"""Every architecture Megatron-Bridge registers, at TP1 on one GPU with the Transformer Engine
spec: RefitBridge's export against stock ``export_hf_weights`` bit for bit, and its FP8 export
against the reference quantizer applied to stock's tensors.

    torchrun --nproc-per-node 1 scripts/check_families_gpu.py [--only Qwen3ForCausalLM,...]

The checks are the conformance matrix's (``mbridge_refit.testing.conformance``, which the CPU tests
and ``docs/conformance.md`` run with the local layer spec): the architectures come from
``AutoBridge.list_supported_models()`` (and the matrix's checkpoint variants, e.g. packed experts,
whose bridge is built from their tiny checkpoint), each gets the tiny config of ``testing.tiny_models`` and
seeded random weights, and each of its BF16 and FP8 cells ends in one ``CellState`` (``fast path,
exact``, ``stock fallback, exact``, ``FP8 refused``, ``cannot be built here``, ``upstream broken``;
``different`` and ``our export failed`` are bugs of ours until shown otherwise).

Writes ``families_tp1.json`` with its manifest (``scripts/provenance.py``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
from collections import Counter
from pathlib import Path

import torch
from provenance import results_dir, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", default="", help="comma-separated architectures (default: every registered one and the variants)"
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.conformance import architectures_at, check_architecture

    architectures = [a for a in args.only.split(",") if a] or architectures_at("tp1")
    device, rows = torch.device("cuda"), []
    with distributed_session(ParallelLayout(), device=device, timeout=datetime.timedelta(minutes=5)):
        for architecture in architectures:
            cells = check_architecture(architecture, "tp1", device=device)
            rows.append({"architecture": architecture, **{c.precision: c.to_json() for c in cells}})
            print(
                f"{architecture:48s} "
                + "  ".join(f"{c.precision}: {c.state}" for c in cells)
                + f"  {cells[0].detail[:300]}",
                flush=True,
            )
            torch.cuda.empty_cache()
    counts = {precision: dict(Counter(row[precision]["state"] for row in rows)) for precision in ("bf16", "fp8")}
    print(counts)
    path = write_result(
        args.out_dir or results_dir(),
        "families_tp1.json",
        {
            "device": torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat(),
            "counts": counts,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
