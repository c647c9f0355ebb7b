"""Host time per tensor of a steady colocated refit's trainer side (``IpcSession.refit``), on the CPU.

    python scripts/bench_ipc_host.py --experts 128 --fp8 --stub-quantizer --json out.json

Builds the tiny Qwen3-MoE recipe with ``--experts`` routed experts on one CPU rank (gloo), refits an
engine stand-in whose workers only answer (the engine's replay is not the trainer's work) until
steady, then times ``--steps`` steady refits. With ``--fp8`` the weights are quantized on the way,
so every weight and its scale are exported each step; ``--stub-quantizer`` replaces the quantize
launches with nothing, leaving the host work around them (on the CPU the reference quantizer's torch
ops would otherwise dominate; on CUDA one grouped kernel launch per bucket does that work). Before
2026-11-28 (the stamped buckets) the stub replaced ``BucketQuantizer.run`` whole, its checks of where
the sources are included. Prints
and writes the median and range of microseconds per yielded tensor. A CPU figure: it shows a change
of the Python around the export, not what a GPU host takes (scripts/profile_ipc_trainer.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--fp8", action="store_true", help="blockwise FP8 on the way out")
    parser.add_argument(
        "--trainer-quantizes",
        action="store_true",
        help="with --fp8: the trainer quantizes every weight (IpcSession(engine_quantizes=False)); by default the "
        "engine quantizes the weights that are whole-block rows of a parameter, and the trainer exports only the rest",
    )
    parser.add_argument("--stub-quantizer", action="store_true", help="time the host work around the quantize")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.ipc.trainer import IpcSession
    from mbridge_refit.fp8 import quantize
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.testing.many_experts import many_expert_model
    from mbridge_refit.testing.silent_engine import answering_workers

    if args.stub_quantizer:  # the device work only: planning and picking the outputs still run
        quantize.BucketQuantizer._launch_grouped = lambda self: None
        quantize.BucketQuantizer._quantize_singles = lambda self, *args, **kwargs: None
    fp8 = "blockwise" if args.fp8 else None
    cpu, layout = torch.device("cpu"), ParallelLayout()
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=10)):
        bridge, chunks = many_expert_model(args.experts)
        session = IpcSession(answering_workers, transport=LocalTransport(), engine_quantizes=not args.trainer_quantizes)
        for _ in range(3):
            step = session.refit(bridge, chunks, fp8=fp8)
        per_tensor = []
        for _ in range(args.steps):
            started = time.perf_counter()
            step = session.refit(bridge, chunks, fp8=fp8)
            per_tensor.append((time.perf_counter() - started) / step.tensors * 1e6)
        session.close()
    result = {
        "experts": args.experts,
        "format": "fp8-blockwise" if fp8 else "bf16",
        "quantizer_stubbed": args.stub_quantizer,
        "engine_quantizes": bool(fp8) and not args.trainer_quantizes,
        "tensors": step.tensors,
        "host_us_per_tensor": {
            "median": round(statistics.median(per_tensor), 3),
            "min": round(min(per_tensor), 3),
            "max": round(max(per_tensor), 3),
        },
    }
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
