"""Benchmark: build the export plan of a full-size model on the meta device (CPU machine, no GPU).

Each rank builds its shard of the model on the meta device (no weight memory), then
``RefitBridge.export_plan``. Real ranks, real process groups (gloo):

    python scripts/bench_plan.py --model qwen3-235b-a22b                       # 1 rank holds all
    torchrun --nproc-per-node 4 scripts/bench_plan.py --model qwen3-235b-a22b --tp 2 --pp 2 --ep 2

Reports, per run (rank 0 prints; every rank measures): model build time, plan time, the number
of plan entries and bytes, and peak RSS of the process (max over ranks). Appends a JSON line to
--out (default benchmarks/results/<date>-cpu/plan_scale.jsonl).
"""

from __future__ import annotations

import argparse
import datetime
import json
import resource
import time
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import results_dir

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB


def append_jsonl(path: Path, row: dict) -> None:
    """Add one result row to a JSON-lines results file (benchmarks/results/<date>-cpu/plan_scale.jsonl)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-235b-a22b", help="a shape in recipes/shapes/")
    add_layout_flags(parser)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results/<date>-cpu/plan_scale.jsonl"
    )
    args = parser.parse_args()

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.models.recipes import full_size_config

    layout = layout_from_flags(args)
    cpu = torch.device("cpu")
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=20)) as env:
        rss_start = peak_rss_gib()
        bridge = RefitBridge.from_hf_config(full_size_config(args.model))
        start = time.perf_counter()
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16, materialize=False))
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        plan = bridge.export_plan(chunks)
        plan_s = time.perf_counter() - start
        local = torch.tensor([build_s, plan_s, peak_rss_gib()], dtype=torch.float64)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        if env.rank == 0:
            row = dict(
                model=args.model,
                layout=layout.name,
                world_size=env.world_size,
                entries=len(plan.entries),
                plan_gb=plan.total_bytes / 1e9,
                meta_build_s=local[0].item(),
                plan_s=local[1].item(),
                peak_rss_gib=local[2].item(),
                rss_after_imports_gib=rss_start,
                host_cpus=torch.get_num_threads(),
                date=datetime.date.today().isoformat(),
            )
            print(
                f"{row['model']:16s} {row['layout']:10s} ranks {row['world_size']}: {row['entries']} entries, "
                f"{row['plan_gb']:.1f} GB; meta build {row['meta_build_s']:.1f} s, plan {row['plan_s']:.2f} s, "
                f"peak RSS {row['peak_rss_gib']:.2f} GiB (after imports {row['rss_after_imports_gib']:.2f})",
                flush=True,
            )
            append_jsonl(args.out or results_dir("cpu") / "plan_scale.jsonl", row)


if __name__ == "__main__":
    main()
