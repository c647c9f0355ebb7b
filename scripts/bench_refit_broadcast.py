"""Benchmark: non-colocated refit from GPU 0 (trainer) to GPU 1 (engine-side transformers model).

Run on the GPU host with two GPUs:

    torchrun --nproc-per-node 2 scripts/bench_refit_broadcast.py --model qwen3-8b

Rank 0 holds a Megatron model (TP=1, bf16, TE spec, Megatron's random init); rank 1 holds a
``transformers`` model of the same shape. Timed side by side in one run (median of --repeats
after one warm-up each):

* ``raw_broadcast_ms``: one NCCL broadcast of the stream's byte count (the transport floor);
* ``packed_transport_ms``: the packed broadcast alone (sender fed from tensors exported
  beforehand, receiver draining without applying);
* ``packed_end_to_end_ms``: ``RefitBridge.export_hf_weights(reuse_buffer_from_cache=True)`` ->
  ``PackedBroadcastSender`` -> ``PackedBroadcastReceiver`` -> ``HFModelUpdateSink``;
* ``stock_end_to_end_ms``: stock ``AutoBridge.export_hf_weights``, one NCCL broadcast per tensor
  (the receiver allocates each from the shapes it was given up front) and the same update sink.

After the packed refit the receiver's model is compared bit for bit with the trainer's export
(names, dtypes, bytes), through a per-tensor checksum exchanged once. Writes
benchmarks/results/<date>-<device>/refit_broadcast_<model>.json (with its manifest) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import results_dir, write_result

TRAINER, ENGINE = 0, 1


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(median ms over ``repeats`` after one warm-up, all times); both ranks call it in step."""
    times = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times


def tensor_sums(stream) -> dict[str, int]:
    """name -> int64 sum of the tensor's bytes as int32 words (a cheap per-tensor fingerprint)."""
    from mbridge_refit.engines.broadcast.packed import checksum

    return {name: int(checksum(t.detach().contiguous().reshape(-1).view(torch.uint8)).item()) for name, t in stream}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a shape in recipes/shapes/ (default: %(default)s)")
    parser.add_argument("--bucket-mib", type=int, default=512, help="packed buffer size (default: %(default)s)")
    parser.add_argument("--buffers", type=int, default=2, help="rotating buffers (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--sweep",
        type=_configs,
        default=[],
        metavar="MIBxN,...",
        help="also time the transport alone with these buffer configurations (e.g. 256x2,256x4,1024x2)",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    parser.add_argument(
        "--stack-dump-s",
        type=float,
        default=None,
        help="print every thread's Python stack and exit after this many seconds (diagnosing a stuck rank)",
    )
    args = parser.parse_args()
    if args.stack_dump_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, exit=True)

    from megatron.core import parallel_state as ps

    from mbridge_refit.convert.session import init_process_group, teardown
    from mbridge_refit.engines.broadcast.packed import (
        PackedBroadcastConfig,
        PackedBroadcastReceiver,
        PackedBroadcastSender,
    )
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.plan.entries import ExportPlan
    from mbridge_refit.sinks import HFModelUpdateSink, drain

    # A short collective timeout: a rank stuck in a collective fails with the collective's name.
    env = init_process_group(device=torch.device("cuda"), timeout=datetime.timedelta(seconds=150))
    if env.world_size != 2:
        raise SystemExit("run with exactly 2 ranks (torchrun --nproc-per-node 2): trainer GPU 0, engine GPU 1")
    rank = dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, local_world_size=1)
    trainers = dist.new_group([TRAINER])
    refit = dist.new_group([TRAINER, ENGINE])
    config = PackedBroadcastConfig(bucket_bytes=args.bucket_mib * 1024**2, num_buffers=args.buffers)
    device = torch.device("cuda", torch.cuda.current_device())
    try:
        if rank == TRAINER:
            from megatron.bridge import AutoBridge
            from megatron.core import tensor_parallel

            from mbridge_refit.bridge import RefitBridge
            from mbridge_refit.models.builder import BuildOptions, build_model
            from mbridge_refit.plan.layout import ParallelLayout

            tensor_parallel.model_parallel_cuda_manual_seed(0)
            bridge = RefitBridge.from_hf_config(full_size_config(args.model))
            chunks = build_model(bridge, ParallelLayout(), BuildOptions(device=device, params_dtype=torch.bfloat16))
            stock_bridge = AutoBridge.from_hf_config(full_size_config(args.model))
            plan = bridge.export_plan(chunks, group=trainers)
            payload = [plan.to_json()]
        else:
            from transformers import AutoModelForCausalLM

            payload = [None]
            # The engine's model is only a refit target: build it without initialising 8B
            # random values (slow on one CPU thread), then give it uninitialised GPU storage.
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(full_size_config(args.model), dtype=torch.bfloat16)
            model = model.to_empty(device=device).eval()
        phase(rank, "models built; exchanging the plan")
        dist.broadcast_object_list(payload, src=TRAINER, group=refit)
        plan = ExportPlan.from_json(payload[0])
        total = plan.total_bytes

        # (a) the floor: one broadcast of the same number of bytes
        raw = torch.empty(total, dtype=torch.uint8, device=device)
        raw_ms, _ = timed(lambda raw=raw: dist.broadcast(raw, src=TRAINER, group=refit), args.repeats)
        del raw

        phase(rank, f"raw broadcast {raw_ms:.1f} ms; packed transport")
        # (b) transport alone: pack + broadcast pre-exported tensors; the receiver only drains
        if rank == TRAINER:
            exported = [
                (n, t.clone())
                for n, t in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
            ]

            def transport_with(cfg):
                return lambda: drain(
                    iter(exported), PackedBroadcastSender(plan, cfg, group=refit, src=TRAINER, trainer_group=trainers)
                )
        else:

            def transport_with(cfg):
                def transport():
                    for _ in PackedBroadcastReceiver(plan, cfg, group=refit, src=TRAINER, device=device).receive():
                        pass

                return transport

        transport_ms, _ = timed(transport_with(config), args.repeats)
        sweep = []
        for mib, buffers in args.sweep:
            other = PackedBroadcastConfig(bucket_bytes=mib * 1024**2, num_buffers=buffers)
            other_ms, _ = timed(transport_with(other), args.repeats)
            sweep.append(
                dict(
                    bucket_mib=mib,
                    buffers=buffers,
                    packed_transport_ms=other_ms,
                    transport_bandwidth_fraction=raw_ms / other_ms,
                )
            )
            phase(rank, f"transport {mib} MiB x {buffers}: {other_ms:.1f} ms")
            torch.cuda.empty_cache()
        if rank == TRAINER:
            del exported
            torch.cuda.empty_cache()

        phase(rank, f"packed transport {transport_ms:.1f} ms; packed end to end")
        # (c) packed end to end: export -> pack/broadcast -> receive -> in-place update
        if rank == TRAINER:

            def packed():
                stream = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
                drain(stream, PackedBroadcastSender(plan, config, group=refit, src=TRAINER, trainer_group=trainers))
        else:

            def packed():
                receiver = PackedBroadcastReceiver(plan, config, group=refit, src=TRAINER, device=device)
                drain(receiver.receive(), HFModelUpdateSink(model))

        packed_ms, packed_times = timed(packed, args.repeats)

        # bitwise check of the packed refit: the engine's tensors vs the trainer's export
        if rank == TRAINER:
            sums = [tensor_sums(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))]
        else:
            sums = [None]
        dist.broadcast_object_list(sums, src=TRAINER, group=refit)
        mismatched = _compare_model(model, sums[0]) if rank == ENGINE else None

        phase(rank, f"packed end to end {packed_ms:.1f} ms; stock end to end")
        # (d) stock: stock export, one broadcast per tensor, the same update sink
        if rank == TRAINER:

            def stock():
                for _, tensor in stock_bridge.export_hf_weights(chunks, cpu=False, show_progress=False):
                    dist.broadcast(tensor.contiguous(), src=TRAINER, group=refit)
        else:

            def stock():
                sink = HFModelUpdateSink(model)
                for entry in plan.entries:
                    tensor = torch.empty(entry.shape, dtype=entry.torch_dtype, device=device)
                    dist.broadcast(tensor, src=TRAINER, group=refit)
                    sink.consume(entry.hf_name, tensor)
                sink.finish()

        stock_ms, _ = timed(stock, args.repeats)

        result = [mismatched]
        dist.broadcast_object_list(result, src=ENGINE, group=refit)
        if rank == TRAINER:
            row = dict(
                device=torch.cuda.get_device_name(),
                model=args.model,
                layout="tp1",
                bytes=total,
                tensors=len(plan.entries),
                bucket_bytes=config.bucket_bytes,
                num_buffers=config.num_buffers,
                raw_broadcast_ms=raw_ms,
                packed_transport_ms=transport_ms,
                packed_end_to_end_ms=packed_ms,
                packed_end_to_end_all_ms=packed_times,
                stock_end_to_end_ms=stock_ms,
                transport_bandwidth_fraction=raw_ms / transport_ms,
                speedup_vs_stock=stock_ms / packed_ms,
                raw_broadcast_gb_s=total / raw_ms / 1e6,
                packed_transport_gb_s=total / transport_ms / 1e6,
                engine_tensors_differing=result[0],
                transport_sweep=sweep,
                repeats=args.repeats,
                torch=torch.__version__,
                date=datetime.date.today().isoformat(),
            )
            print_table(row)
            path = write_result(args.out_dir or results_dir(), f"refit_broadcast_{args.model}.json", row)
            print(f"wrote {path}")
    finally:
        teardown()


_START = time.perf_counter()


def _configs(text: str) -> list[tuple[int, int]]:
    """'256x2,1024x2' -> [(256, 2), (1024, 2)] (MiB per buffer, buffers)."""
    try:
        return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIBxN[,MIBxN...], got {text!r}") from None


def phase(rank: int, what: str) -> None:
    """Progress on stderr with the elapsed time, so a stuck step is visible in the log."""
    print(f"[rank{rank} {time.perf_counter() - _START:7.1f}s] {what}", file=sys.stderr, flush=True)


def _compare_model(model, expected_sums: dict[str, int]) -> list[str]:
    """Names whose bytes in the engine's model differ from the trainer's export (via the update
    sink's own name resolution, so fused in-memory layouts are compared at the right slice)."""
    from mbridge_refit.engines.broadcast.packed import checksum
    from mbridge_refit.sinks import HFModelUpdateSink

    sink = HFModelUpdateSink(model)
    differing = []
    for name, want in expected_sums.items():
        view = sink.target_view(name)
        if view is None:
            differing.append(f"{name} (no target)")
            continue
        got = int(checksum(view.detach().contiguous().reshape(-1).view(torch.uint8)).item())
        if got != want:
            differing.append(name)
    return differing


def print_table(row: dict) -> None:
    gb = row["bytes"] / 1e9
    print(
        "\n".join(
            [
                f"device {row['device']} x2  model {row['model']}  {row['tensors']} tensors, {gb:.2f} GB, "
                f"{row['num_buffers']} x {row['bucket_bytes'] / 2**20:.0f} MiB buffers",
                f"{'':44s}{'ms':>9s}{'GB/s':>8s}",
                f"{'raw NCCL broadcast (same bytes)':44s}{row['raw_broadcast_ms']:9.1f}{gb / row['raw_broadcast_ms'] * 1e3:8.1f}",
                f"{'packed broadcast, transport only':44s}{row['packed_transport_ms']:9.1f}{gb / row['packed_transport_ms'] * 1e3:8.1f}",
                f"{'packed: export + broadcast + apply':44s}{row['packed_end_to_end_ms']:9.1f}{gb / row['packed_end_to_end_ms'] * 1e3:8.1f}",
                f"{'stock export + per-tensor broadcast + apply':44s}{row['stock_end_to_end_ms']:9.1f}{gb / row['stock_end_to_end_ms'] * 1e3:8.1f}",
                f"transport / raw bandwidth: {row['transport_bandwidth_fraction']:.2%}   end to end vs stock: "
                f"{row['speedup_vs_stock']:.2f}x   engine tensors differing from the export: {len(row['engine_tensors_differing'])}",
            ]
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
