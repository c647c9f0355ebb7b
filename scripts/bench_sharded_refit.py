"""Benchmark: engine-sharded refit against the gathering export, in one run (one process per GPU).

    torchrun --nproc-per-node 2 scripts/bench_sharded_refit.py --model qwen3-8b --tp 2 --engine tp2 --tp1-json /tmp/r/export_qwen3-8b_tp1.json
    torchrun --nproc-per-node 2 scripts/bench_sharded_refit.py --model qwen3-tiny --tp 2 --device cpu   # a smoke run (gloo)

Trainer at ``--tp`` with random weights; engine ``--engine`` placed on the same ranks (engine rank
i on global rank i), its shards allocated once. Side by side, steady state (median of
``--steps`` after a first call): ``sharded_ms`` (``ShardedTransfer.run``: every engine rank
receives only its shard), ``gather_cached_ms`` (``export_hf_weights(reuse_buffer_from_cache=True)``
consumed by a no-op: every rank receives full tensors), ``stock_steady_ms`` (stock
``AutoBridge.export_hf_weights``). ``tp1_ms`` is the cached TP1 export of the same shape, taken by
``bench_export.py --tp 1`` on the same host just before (``--tp1-json``; one process cannot hold
a TP1 and a TP2 model; ``gpu_run.sh sharded`` runs both). Exactness rides along: every engine shard equals the matching box of the
stock export's tensor. Writes ``sharded_refit_<model>_<layout>.json`` (rank 0) through
``scripts/provenance.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import results_dir, write_result

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags


def hf_config(name: str, layers: int | None):
    from mbridge_refit.models import recipes

    config = (
        recipes.full_size_config(name)
        if name in recipes.full_size_shapes()
        else recipes.get_model_recipe(name).to_hf_config()
    )
    if layers is not None:
        config.num_hidden_layers = layers
    return config


def timed(action, device: torch.device, steps: int) -> tuple[list[float], int]:
    """Milliseconds of ``steps`` synchronised calls after a first one, and the CUDA allocations
    those steady calls made (the barrier between calls, which allocates on NCCL, not counted)."""
    action()
    times, new_allocations = [], 0
    for _ in range(steps):
        _synchronize(device)
        dist.barrier()
        _synchronize(device)
        before = _allocations(device)
        start = time.perf_counter()
        action()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        new_allocations += _allocations(device) - before
    return times, new_allocations


def same_weights_on_every_replica(chunks) -> None:
    """Random weights differ between ranks that hold copies of one parameter; a training job's do not
    (and the transfer refuses copies that differ: ``runtime.replica_agreement``). Broadcast each
    parameter the tensor-parallel ranks hold whole (no ``tensor_model_parallel`` attribute: norms,
    routers) from the first rank of its tensor-parallel group (expert-TP for experts), then every
    parameter from the first data-parallel replica (context-parallel ranks included; experts over the
    expert data-parallel group)."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        for name, param in chunk.named_parameters():
            expert = ".experts." in name
            groups = []
            if not getattr(param, "tensor_model_parallel", False):
                groups.append(ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group())
            groups.append(
                ps.get_expert_data_parallel_group()
                if expert
                else ps.get_data_parallel_group(with_context_parallel=True)
            )
            for group in groups:
                if group is not None and dist.get_world_size(group) > 1:
                    dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


def drain(stream) -> None:
    for _ in stream:
        pass


def check_against_stock(stock_stream, transfer, shards) -> int:
    """Every engine shard on this rank against the stock export's tensor cut to its box."""
    boxes = {s.hf_name: s.box for s in transfer.plan.shards_on(dist.get_rank())}
    mismatches = 0
    for name, tensor in stock_stream:
        if name in boxes:
            expected = tensor[tuple(slice(a, b) for a, b in boxes[name])]
            mismatches += not torch.equal(
                expected.reshape(-1).view(torch.uint8), shards[name].reshape(-1).view(torch.uint8)
            )
    return mismatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a shape in recipes/shapes/ or a tiny recipe")
    parser.add_argument("--layers", type=int, default=None, help="cut the shape to its first N layers")
    parser.add_argument("--engine", default=None, help="engine layout (default: the trainer's TP)")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--tp1-json",
        type=Path,
        default=None,
        help="bench_export.py --tp 1 result of the same shape on this host: its refit_cached_steady_ms is tp1_cached_ms",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    add_layout_flags(parser)
    args = parser.parse_args()

    from megatron.bridge import AutoBridge

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model

    layout = layout_from_flags(args)
    device = torch.device(args.device)
    with distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=10)) as env:
        config = hf_config(args.model, args.layers)
        bridge, stock = (
            RefitBridge.from_hf_config(config),
            AutoBridge.from_hf_config(hf_config(args.model, args.layers)),
        )
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        same_weights_on_every_replica(chunks)
        plan = bridge.transfer_plan(chunks, args.engine or f"tp{layout.tp}")
        transfer = bridge.sharded_transfer(chunks, plan)
        shards = transfer.allocate_shards()

        sharded, sharded_allocations = timed(lambda: transfer.run(shards), device, args.steps)
        mismatches = check_against_stock(
            stock.export_hf_weights(chunks, cpu=device.type == "cpu", show_progress=False), transfer, shards
        )
        gather, _ = timed(
            lambda: drain(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)),
            device,
            args.steps,
        )
        stock_times, _ = timed(
            lambda: drain(stock.export_hf_weights(chunks, cpu=device.type == "cpu", show_progress=False)),
            device,
            max(2, args.steps // 3),
        )

        row = torch.tensor(
            [
                statistics.median(sharded),
                statistics.median(gather),
                statistics.median(stock_times),
                mismatches,
                sharded_allocations,
            ],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the slowest rank, the most mismatches
        tp1_ms = json.loads(args.tp1_json.read_text())["refit_cached_steady_ms"] if args.tp1_json else None
        if env.rank == 0:
            summary = plan.summary()
            result = dict(
                device=_device_name(device),
                model=args.model,
                layers=config.num_hidden_layers,
                layout=f"tp{layout.tp}->{plan.engine.name}",
                world_size=env.world_size,
                sharded_ms=round(row[0].item(), 3),
                gather_cached_ms=round(row[1].item(), 3),
                tp1_cached_ms=tp1_ms,
                stock_steady_ms=round(row[2].item(), 3),
                bytes_moved=summary["bytes_moved"],
                full_gather_bytes=summary["full_gather_bytes"],
                shard_bytes=summary["shard_bytes"],
                moves=summary["moves"],
                mismatches_vs_stock=int(row[3].item()),
                new_allocations_after_first=int(row[4].item()),
                sharded_all_ms=[round(t, 3) for t in sharded],
            )
            result["speedup_vs_stock"] = round(result["stock_steady_ms"] / result["sharded_ms"], 2)
            if tp1_ms:
                result["sharded_vs_tp1"] = round(result["sharded_ms"] / tp1_ms, 2)
            print(result, flush=True)
            write_result(
                args.out_dir or results_dir(None if device.type == "cuda" else "cpu"),
                f"sharded_refit_{args.model}_{result['layout'].replace('->', '_to_')}.json",
                result,
            )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _allocations(device: torch.device) -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0) if device.type == "cuda" else 0


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return f"{torch.cuda.get_device_name()} x{dist.get_world_size()}"


if __name__ == "__main__":
    main()
