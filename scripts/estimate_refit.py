"""Estimate the steady-state refit export per rank of layouts too large to run, from measured costs.

    python scripts/estimate_refit.py            # write refit_estimate.json and the block in docs/benchmarks/scale.md
    python scripts/estimate_refit.py --check    # exit 1 if either differs from what the inputs give (tests)

Each ``Estimate`` names a per-rank traffic file (``scripts/simulate_plan.py``: what every rank of
the layout yields, copies on its device, receives in gathers and in pipeline broadcasts,
``runtime.rank_traffic``) and the committed measurements its costs come from
(``scripts/bench_export.py`` results, with their device):

* host: ``refit_cached_host_us_per_tensor``, the host CPU per yielded tensor of the cached steady
  export, times the tensors the rank yields;
* copy: the rank's local copy bytes at the clone floor's rate (``bytes`` / ``clone_floor_ms``: one
  device copy of the model's bytes);
* gathers: the rank's tensor- and expert-parallel gather bytes at the rate one rank received in
  ``gather_floor_ms`` (one all-gather over the result's ranks whose output is the model's bytes).

The slowest rank is the one with the largest host + copy + gathers. What the estimate leaves out
(the pipeline broadcasts, whose cost is not measured; collective launches; overlap) is written
beside the table. Every number in the block comes from ``refit_estimate.json``, which this script
writes (with its manifest) from the files it names.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from provenance import REPO, RESULTS, write_result
from render_performance import replace_block

OUTPUT = "2026-11-26-cpu/refit_estimate.json"
PAGE = REPO / "docs" / "benchmarks" / "scale.md"
PAGE_RESULTS = "../../benchmarks/results"  # RESULTS as PAGE links it
BEGIN = "<!-- refit estimate: written by scripts/estimate_refit.py -->"
END = "<!-- end of refit estimate -->"


@dataclass(frozen=True)
class Estimate:
    """One row: the layout's per-rank traffic and the results its costs come from (relative to ``RESULTS``)."""

    label: str
    layout: str  # as the docs write it
    traffic: str
    per_tensor_and_copy: str  # refit_cached_host_us_per_tensor, clone_floor_ms and bytes
    gather: str  # gather_floor_ms, bytes and world_size


ESTIMATES = (
    Estimate(
        "Qwen3-235B-A22B",
        "TP4 × PP4 (23/…/23 layers) × EP8",
        "2026-11-26-cpu/rank_traffic_qwen3-235b-a22b_tp4_pp4_split23-23_ep8.json",
        "2026-11-26-h200/export_qwen3-30b-a3b-24layers_tp1.json",
        "2026-11-23-h200x2/export_qwen3-8b_tp2.json",
    ),
    Estimate(
        "DeepSeek-V3 / R1 671B",
        "PP4 (16/15/15/15 layers) × EP8",
        "2026-11-26-cpu/rank_traffic_deepseek-v3_pp4_split16-15_ep8.json",
        "2026-11-26-h100x2-b/export_deepseek-v3-4layers_tp1.json",
        "2026-11-25-h100x2/export_qwen3-30b-a3b-4layers_tp2_etp2.json",
    ),
)


def read_result(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def measured_costs(estimate: Estimate) -> dict:
    """The three rates, each with the file and device it was measured on."""
    copy, gather = read_result(estimate.per_tensor_and_copy), read_result(estimate.gather)
    local_share = gather["bytes"] // gather["world_size"]
    return dict(
        host_us_per_tensor=copy["refit_cached_host_us_per_tensor"],
        copy_bytes_per_ms=copy["bytes"] / copy["clone_floor_ms"],
        copy_device=copy["device"],
        copy_result=estimate.per_tensor_and_copy,
        gather_received_bytes_per_ms=(local_share * gather["world_size"] - local_share) / gather["gather_floor_ms"],
        gather_device=f"{gather['world_size']}× {gather['device']}",
        gather_result=estimate.gather,
    )


def rank_estimate(rank: dict, costs: dict) -> dict:
    """One rank's traffic priced at ``costs`` (milliseconds)."""
    host = rank["tensors_yielded"] * costs["host_us_per_tensor"] / 1e3
    copy = rank["local_copy_bytes"] / costs["copy_bytes_per_ms"]
    gathers = rank["gathered_bytes"] / costs["gather_received_bytes_per_ms"]
    return dict(rank, host_ms=host, copy_ms=copy, gather_ms=gathers, total_ms=host + copy + gathers)


def estimate_row(estimate: Estimate) -> dict:
    traffic, costs = read_result(estimate.traffic), measured_costs(estimate)
    ranks = [rank_estimate(rank, costs) for rank in traffic["ranks"]]
    slowest = max(ranks, key=lambda r: r["total_ms"])
    return dict(
        label=estimate.label,
        layout=estimate.layout,
        world_size=traffic["world_size"],
        plan_tensors=traffic["plan_tensors"],
        plan_bytes=traffic["plan_bytes"],
        traffic_result=estimate.traffic,
        costs=costs,
        slowest=slowest,
        ranks_as_slow=sum(r["total_ms"] >= 0.999 * slowest["total_ms"] for r in ranks),
        fastest_total_ms=min(r["total_ms"] for r in ranks),
        broadcast_received_bytes_max=max(r["broadcast_received_bytes"] for r in ranks),
    )


HEADER = (
    "| model | layout (ranks) | tensors yielded per rank (built there, of which views) | copied locally | gathered "
    "(TP, EP) | received from other stages (PP) | host | copy | gathers | estimate per rank (excl. PP) | slowest rank |",
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
)


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _device(name: str) -> str:
    return name.replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def render_row(row: dict) -> str:
    slowest, costs = row["slowest"], row["costs"]
    place = ", ".join(f"{key.removesuffix('_rank')} {slowest[key]}" for key in ("pp_rank", "tp_rank", "ep_rank"))
    cells = (
        row["label"],
        f"[{row['layout']}]({PAGE_RESULTS}/{row['traffic_result']}) ({row['world_size']})",
        f"{slowest['tensors_yielded']:,} ({slowest['tensors_built']:,}, {slowest['views']:,})",
        _gb(slowest["local_copy_bytes"]),
        _gb(slowest["gathered_bytes"]),
        _gb(slowest["broadcast_received_bytes"]),
        f"{slowest['host_ms']:.0f} ms ({costs['host_us_per_tensor']:.2f} µs/tensor, {_device(costs['copy_device'])})",
        f"{slowest['copy_ms']:.1f} ms ({costs['copy_bytes_per_ms'] / 1e9:.2f} TB/s, {_device(costs['copy_device'])})",
        f"{slowest['gather_ms']:.0f} ms ({costs['gather_received_bytes_per_ms'] / 1e6:.0f} GB/s in, "
        f"{_device(costs['gather_device'])})",
        f"{slowest['total_ms']:.0f} ms (fastest rank {row['fastest_total_ms']:.0f} ms)",
        f"{slowest['rank']} ({place}; {row['ranks_as_slow']} ranks within 0.1%)",
    )
    return "| " + " | ".join(cells) + " |"


def render_block(rows: list[dict]) -> list[str]:
    return [BEGIN, *HEADER, *(render_row(row) for row in rows), END]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", type=Path, default=PAGE, help="the page whose block is rewritten")
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON or the block differs")
    args = parser.parse_args(argv)
    rows = [estimate_row(estimate) for estimate in ESTIMATES]
    text = args.page.read_text()
    rendered = replace_block(text, render_block(rows))
    if args.check:
        committed = json.loads((RESULTS / OUTPUT).read_text())["rows"]
        if committed != json.loads(json.dumps(rows)) or rendered != text:
            print(f"{args.page} or {OUTPUT} differs from what the inputs give; run {__file__}")
            return 1
        return 0
    output = RESULTS / OUTPUT
    write_result(output.parent, output.name, {"rows": rows}, device="CPU (arithmetic over the files it names)")
    args.page.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
