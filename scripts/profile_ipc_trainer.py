"""Profile the trainer side of a steady colocated refit (``IpcSession.refit``) on the GPU host, without an
engine: where does its host time go?

    python3 scripts/profile_ipc_trainer.py --model qwen3-30b-a3b --layers 24 [--fp8]

Builds the shape's Megatron model (TP1, random bf16 weights) on GPU 0, refits an engine stand-in whose
workers only answer (the engine's replay is not the trainer's work) until steady, times 20 steady steps,
then prints cProfile's top functions by their own time over 10 more.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from mbridge_refit.testing.vllm_harness import tp1_trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--work", default="/tmp")
    parser.add_argument("--fp8", action="store_true", help="blockwise FP8 on the way: every weight exported each step")
    parser.add_argument(
        "--trainer-quantizes",
        action="store_true",
        help="with --fp8: the trainer quantizes every weight (IpcSession(engine_quantizes=False)); by default the "
        "engine quantizes the weights that are whole-block rows of a parameter, and the trainer exports only the rest",
    )
    args = parser.parse_args()
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.ipc.trainer import IpcSession
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.testing.silent_engine import answering_workers

    config = full_size_config(args.model)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    fp8 = "blockwise" if args.fp8 else None
    with tp1_trainer(config, args.work) as (bridge, chunks, _):
        session = IpcSession(answering_workers, transport=LocalTransport(), engine_quantizes=not args.trainer_quantizes)
        for _ in range(3):
            step = session.refit(bridge, chunks, fp8=fp8)
        times = []
        for _ in range(20):
            started = time.perf_counter()
            session.refit(bridge, chunks, fp8=fp8)
            times.append((time.perf_counter() - started) * 1e3)
        median = statistics.median(times)
        print(f"{torch.cuda.get_device_name()} {args.model} layers={config.num_hidden_layers} tensors={step.tensors}")
        print(f"steady trainer step: median {median:.3f} ms, {median * 1e3 / step.tensors:.2f} us per tensor")
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(10):
            session.refit(bridge, chunks, fp8=fp8)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        session.close()


if __name__ == "__main__":
    main()
