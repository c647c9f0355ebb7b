"""GPU check: the export of a MoE model built the way an RL trainer builds it, against stock.

    torchrun --nproc-per-node N scripts/check_trainer_truth_gpu.py --model qwen3-30b-a3b --layers 4 --out-dir DIR

Megatron's parallel state at TP = N with every expert setting left to Megatron (expert-TP then
equals TP: each routed expert is split over the N ranks), the model built from the shape's
config with the bridge's provider, Megatron's Transformer Engine spec (grouped experts) and the
provider's own expert-TP default (None). Checks (exit 1 on any failure):

1. the provider's expert-TP is N and the plan splits the experts over N ranks;
2. the cached export (two calls) and the FP8 export's BF16 base are on the fast path
   (``export_diagnostics``), and every tensor equals stock ``AutoBridge.export_hf_weights`` of the
   same model bit for bit, names and order included;
3. after ``load_state_dict(assign=True)`` with new values (what checkpoint reloads and offload
   frameworks do), the next cached export equals stock's export of the changed model;
4. timing of the freshness check (``runtime.live_params``): the cached export when no parameter
   was replaced, and when one parameter is registered again before every call (which makes the
   check look every parameter up again), interleaved; and ``registration_count()`` alone.
Writes ``trainer_truth_<model>_tp<N>.json`` with its manifest to --out-dir (rank 0).
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


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def compare(bridge, stock_bridge, chunks, what: str) -> list[str]:
    problems = []
    ours = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
    theirs = stock_bridge.export_hf_weights(chunks, show_progress=False)
    for (name, got), (stock_name, expected) in zip(ours, theirs, strict=True):
        if name != stock_name or not same(got, expected):
            problems.append(f"{what}: {name} vs stock {stock_name}")
    return problems


def timed(make_stream, before=None) -> float:
    if before is not None:
        before()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in make_stream():
        pass
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()

    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import init_process_group, teardown
    from mbridge_refit.models.builder import BuildOptions, configure_provider
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.runtime.live_params import registration_count

    env = init_process_group(device=torch.device("cuda"), timeout=datetime.timedelta(minutes=10))
    tp = dist.get_world_size()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)  # expert settings left to Megatron
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        config = full_size_config(args.model)
        config.num_hidden_layers = args.layers
        bridge, stock_bridge = RefitBridge.from_hf_config(config), AutoBridge.from_hf_config(config)
        options = BuildOptions(
            device=torch.device("cuda"),
            params_dtype=torch.bfloat16,
            provider_overrides={"expert_tensor_parallel_size": None},
        )
        provider = configure_provider(bridge.to_megatron_provider(load_weights=False), ParallelLayout(tp=tp), options)
        chunks = provider.provide_distributed_model(wrap_with_ddp=False, mixed_precision_wrapper=None)
        result: dict = {
            "model": f"{args.model}-{args.layers}layers",
            "tp": tp,
            "device": torch.cuda.get_device_name(),
            "expert_tp": chunks[0].config.expert_tensor_parallel_size,
        }
        problems = [] if result["expert_tp"] == tp else [f"provider expert-TP {result['expert_tp']}, expected {tp}"]
        plan = bridge.export_plan(chunks)
        result["tensors"] = len(plan.entries)
        result["expert_tensors_split"] = sum(e.is_expert and len(e.sharding.pieces) == tp for e in plan.entries)
        if tp > 1 and not result["expert_tensors_split"]:
            problems.append("no expert tensor planned as split over the expert-TP ranks")
        problems += compare(bridge, stock_bridge, chunks, "first cached export")
        problems += compare(bridge, stock_bridge, chunks, "second cached export")
        diagnostics = bridge.export_diagnostics()
        result["fast_path"] = diagnostics.planned and diagnostics.fallback_reason is None
        if not result["fast_path"]:
            problems.append(f"not on the fast path: {diagnostics.fallback_reason}")

        torch.manual_seed(4321 + dist.get_rank())
        state = {
            k: torch.randn_like(v, dtype=torch.float32).to(v.dtype)
            for k, v in chunks[0].state_dict().items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and "_extra_state" not in k
        }
        chunks[0].load_state_dict(state, strict=False, assign=True)
        problems += compare(bridge, stock_bridge, chunks, "after load_state_dict(assign=True)")

        def export():
            return bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)

        module = chunks[0].decoder.final_layernorm

        def register_again():
            module.weight = module.weight  # a parameter registration: the next call looks every parameter up

        timed(export), timed(export, register_again)
        steady, looked_up = [], []
        for _ in range(args.pairs):
            steady.append(timed(export))
            looked_up.append(timed(export, register_again))
        count_start = time.perf_counter()
        for _ in range(100_000):
            registration_count()
        result.update(
            cached_steady_ms=statistics.median(steady),
            cached_after_registration_ms=statistics.median(looked_up),
            freshness_lookup_cost_ms=statistics.median(b - a for a, b in zip(steady, looked_up)),
            registration_count_ns=(time.perf_counter() - count_start) * 1e4,
            pairs=args.pairs,
            parameters=sum(1 for _ in chunks[0].parameters()),
        )
        result["problems"] = problems
        ok = [None] * tp
        dist.all_gather_object(ok, not problems)
        if env.rank == 0:
            result["ok_per_rank"] = ok
            out = args.out_dir or results_dir()
            write_result(out, f"trainer_truth_{args.model}_tp{tp}.json", result)
            print(result, flush=True)
        return 0 if all(ok) else 1
    finally:
        teardown()


if __name__ == "__main__":
    sys.exit(main())
