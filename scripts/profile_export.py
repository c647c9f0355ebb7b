"""Profile one steady-state cached export on the GPU host: where does the time go?

    torchrun --nproc-per-node 2 scripts/profile_export.py --model qwen3-8b --tp 2

Warms up (plan, buffers), then records one ``export_hf_weights(reuse_buffer_from_cache=True)``
pass with ``torch.profiler`` and prints, on rank 0, device time per kernel family (NCCL
all-gather, index_select, copies, ...) next to the wall time of the pass.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

FAMILIES = (
    ("nccl", "nccl"),
    ("index", "index"),
    ("copy", "copy"),
    ("elementwise", "elementwise"),
    ("memcpy", "memcpy"),
)


def family(name: str) -> str:
    lowered = name.lower()
    return next((label for key, label in FAMILIES if key in lowered), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.plan.layout import ParallelLayout

    layout = ParallelLayout(tp=args.tp)
    device = torch.device("cuda")
    with distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=10)) as env:
        bridge = RefitBridge.from_hf_config(full_size_config(args.model))
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        for _ in range(2):
            for _name, _tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
                pass
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _name, _tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True):
                pass
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3
        if env.rank == 0:
            per_family: dict[str, float] = collections.defaultdict(float)
            counts: dict[str, int] = collections.defaultdict(int)
            for event in prof.key_averages():
                device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
                if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
                    per_family[family(event.key)] += device_us / 1e3
                    counts[family(event.key)] += event.count
            print(f"profiled export wall time (with profiler): {wall_ms:.1f} ms")
            for label, ms in sorted(per_family.items(), key=lambda item: -item[1]):
                print(f"  {label:12s} {ms:8.2f} ms device time in {counts[label]} kernels")
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
