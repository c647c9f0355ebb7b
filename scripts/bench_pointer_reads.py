"""Benchmark: the trainer's look for ``param.data`` swaps in a colocated refit (every live parameter's data
pointer, read as ``IpcSession.refit`` reads them), with warm caches and after other work, on this host's CPU.

    python3 scripts/bench_pointer_reads.py [--params 6315] [--rounds 9] [--out-dir DIR]

Why: in ``bench_refit_vllm.py`` the trainer's export of the 24-layer Qwen3-30B-A3B shape (6,315 live
parameters) took 3.5 ms inside the refit's steps and 0.9 ms in the same session's steps run back to back
(``trainer_alone``). Each pointer is four dependent objects away (the Python object, its tensor, its storage,
the pointer), so a look that follows other work may wait on memory for each of them. This times the look,
in alternating rounds, right after the same look (``warm``), after a sweep over 256 MiB of host memory
(``after_sweep``), after waiting for 5 ms of GPU work (``after_gpu_wait``: the thread spins in the
synchronize, as a trainer does before a refit) and after a 5 ms sleep (``after_sleep``). Needs only torch
and this package (``engines.ipc.trainer.live_pointers``, the look itself).
Writes DIR/bench_pointer_reads.json with its manifest; prints it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from provenance import results_dir, write_result


def timed_ms(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=6315, help="live parameters (default: the 24-layer MoE shape's)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    from mbridge_refit.engines.ipc.trainer import live_pointers

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    parameters = tuple(torch.nn.Parameter(torch.zeros(64, device=device)) for _ in range(args.params))
    sweep = torch.ones(256 << 20, dtype=torch.uint8)  # host memory, larger than any last-level cache
    gpu_work = torch.empty(1 << 30, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def wait_for_gpu() -> None:
        if gpu_work is None:
            time.sleep(0.005)
            return
        for _ in range(8):  # about 5 ms of copies on an H100/H200
            gpu_work[: 1 << 29].copy_(gpu_work[1 << 29 :])
        torch.cuda.synchronize()

    before = {
        "warm": lambda: live_pointers(parameters),
        "after_sweep": lambda: sweep.sum(),
        "after_gpu_wait": wait_for_gpu,
        "after_sleep": lambda: time.sleep(0.005),
    }
    times: dict[str, list[float]] = {name: [] for name in before}
    for _ in range(args.rounds):
        for name, prepare in before.items():
            prepare()
            times[name].append(timed_ms(lambda: live_pointers(parameters)))
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "params": args.params,
        **{
            f"{name}_ms": {"median": round(statistics.median(v), 4), "all": [round(x, 4) for x in v]}
            for name, v in times.items()
        },
        "us_per_param": {name: round(statistics.median(v) * 1e3 / args.params, 3) for name, v in times.items()},
    }
    print(json.dumps(result, indent=1))
    if args.out_dir is not None or device.type == "cuda":
        print("wrote", write_result(args.out_dir or results_dir(), "bench_pointer_reads.json", result))


if __name__ == "__main__":
    main()
