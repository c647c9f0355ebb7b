"""Bytes a sharded refit moves between ranks, against a full gather, for full-size shapes (CPU).

Each rank builds its shard of the model on the meta device (no weight memory), then
``RefitBridge.transfer_plan`` for every engine layout asked (engine rank i on global rank i, the
colocated placement). Real ranks and process groups (gloo); no tensor data exists or moves:

    torchrun --nproc-per-node 2 scripts/bench_transfer_plan.py --model qwen3-8b --tp 2 --engines tp2
    torchrun --nproc-per-node 4 scripts/bench_transfer_plan.py --model qwen3-8b --tp 2 --engines tp2 tp4
    torchrun --nproc-per-node 4 scripts/bench_transfer_plan.py --model qwen3-8b --tp 4 --engines tp2 tp4

Per engine layout (rank 0 prints and writes ``transfer_bytes_<model>_<layout>.json`` through
``scripts/provenance.py``): ``bytes_moved`` (sent between ranks per refit), ``bytes_local``
(copied on the engine rank's own rank), ``shard_bytes`` (what the engine ranks hold, with kv
heads replicated), ``full_gather_bytes`` (what a gathering export moves so that the trainer rank
under each engine rank holds every tensor whole: the export's contract, before the engine
slices), the moves, and the time to build the transfer plan.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from provenance import results_dir, write_result

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a shape in recipes/shapes/")
    parser.add_argument("--engines", nargs="+", default=["tp2"], help="engine layouts: tp2, tp4, tp2_ep2, ...")
    parser.add_argument(
        "--engine-ranks",
        type=int,
        nargs="+",
        default=None,
        help="the global rank of each engine rank (default 0, 1, ...: colocated on the first ranks)",
    )
    add_layout_flags(parser)
    args = parser.parse_args()

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.models.recipes import full_size_config

    layout = layout_from_flags(args)
    cpu = torch.device("cpu")
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=30)) as env:
        bridge = RefitBridge.from_hf_config(full_size_config(args.model))
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16, materialize=False))
        export_plan = bridge.export_plan(chunks)
        trainer = f"{layout.name}_dp{dist.get_world_size() // layout.model_parallel_size}"
        for engine in args.engines:
            start = time.perf_counter()
            plan = bridge.transfer_plan(chunks, engine, engine_ranks=args.engine_ranks)
            plan_s = time.perf_counter() - start
            if env.rank != 0:
                continue
            summary = plan.summary()
            row = dict(
                model=args.model,
                layout=f"{trainer}->{plan.engine.name}",
                world_size=env.world_size,
                model_bytes=export_plan.total_bytes,
                transfer_plan_s=round(plan_s, 3),
                **summary,
                moved_vs_full_gather=round(summary["bytes_moved"] / summary["full_gather_bytes"], 4)
                if summary["full_gather_bytes"]
                else None,
            )
            print(
                f"{args.model} {row['layout']}: moved {summary['bytes_moved'] / 1e9:.2f} GB, local {summary['bytes_local'] / 1e9:.2f} GB, "
                f"full gather {summary['full_gather_bytes'] / 1e9:.2f} GB ({len(plan.moves)} moves, plan {plan_s:.2f} s)",
                flush=True,
            )
            placed = "" if args.engine_ranks is None else "_on_" + "-".join(map(str, args.engine_ranks))
            write_result(
                results_dir("cpu"),
                f"transfer_bytes_{args.model}_{trainer}_to_{plan.engine.name}{placed}.json",
                row,
                device="cpu",
            )


if __name__ == "__main__":
    main()
