"""Benchmark: an engine's refit replay, the recorded copies from the trainer's tensors into the
engine's parameters, on one GPU, without an engine: the copies vLLM's loader makes for a model
shape (its fused parameters: ``qkv_proj`` from q, k and v, ``gate_up_proj`` from gate and up, a
fused MoE layer's ``w13`` from each expert's gate and up rows and ``w2`` from its down), timed as

* ``per_copy``: one ``copy_`` per recorded copy;
* ``foreach``: ``engines.replay.copy_batches.CopySchedule`` with every group one ``_foreach_copy_`` (the
  replay before ``engines.replay.copy_kernels``);
* ``schedule``: ``CopySchedule`` as the replay runs it now (plain byte copies as one chunked-copy
  launch per group where the kernel's probe passed);

against one copy of the same bytes (the floor), each side checked bit for bit: every parameter
view equal to the tensor copied into it. Wall clock per step with the device synchronised, rounds interleaved (per_copy,
foreach, schedule, floor; again), medians and ranges; also each side's host time to issue a step.

    python scripts/bench_replay_copies.py --model qwen3-30b-a3b --layers 4 [--rounds 5 --repeats 5]

Writes DIR/replay_copies_<model>[_<N>layers].json with its manifest (``provenance.write_result``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
from provenance import results_dir, write_result

from mbridge_refit.engines.replay.copy_batches import CopySchedule

# Per model shape: hidden, attention heads and KV heads of head_dim 128, dense FFN (0: MoE),
# experts and expert FFN, vocabulary, layers. Sizes as published.
SHAPES = {
    "qwen3-8b": dict(hidden=4096, heads=32, kv_heads=8, ffn=12288, experts=0, expert_ffn=0, vocab=151936, layers=36),
    "qwen3-30b-a3b": dict(
        hidden=2048, heads=32, kv_heads=4, ffn=0, experts=128, expert_ffn=768, vocab=151936, layers=48
    ),
    "qwen3-1.7b": dict(hidden=2048, heads=16, kv_heads=8, ffn=6144, experts=0, expert_ffn=0, vocab=151936, layers=28),
}
HEAD_DIM = 128


def layer_copies(shape: dict) -> list[tuple[tuple[int, ...], list[tuple[int, ...]]]]:
    """One layer's engine parameters, each as (its shape, the shapes of the trainer tensors copied
    into it, stacked along dim 0 (``[E, ...]`` parameters: along dim 1 within each expert))."""
    h, q, kv = shape["hidden"], shape["heads"] * HEAD_DIM, shape["kv_heads"] * HEAD_DIM
    params = [
        ((q + 2 * kv, h), [(q, h), (kv, h), (kv, h)]),  # qkv_proj
        ((h, q), [(h, q)]),  # o_proj
        ((h,), [(h,)]),  # input_layernorm
        ((h,), [(h,)]),  # post_attention_layernorm
        ((HEAD_DIM,), [(HEAD_DIM,)]),  # q_norm
        ((HEAD_DIM,), [(HEAD_DIM,)]),  # k_norm
    ]
    if shape["experts"]:
        e, f = shape["experts"], shape["expert_ffn"]
        params += [
            ((e, h), [(e, h)]),  # router
            ((e, 2 * f, h), [(f, h), (f, h)] * e),  # w13: expert by expert, gate rows then up rows
            ((e, h, f), [(h, f)] * e),  # w2
        ]
    else:
        params += [((2 * shape["ffn"], h), [(shape["ffn"], h)] * 2), ((h, shape["ffn"]), [(h, shape["ffn"])])]
    return params


def engine_copies(shape: dict, layers: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(engine parameter view, trainer tensor) pairs for ``layers`` layers plus the embedding, the
    final norm and the output layer, the trainer tensors random, the parameters empty."""
    h, vocab = shape["hidden"], shape["vocab"]
    params = [((vocab, h), [(vocab, h)]), ((h,), [(h,)]), ((vocab, h), [(vocab, h)])]
    params += [p for _ in range(layers) for p in layer_copies(shape)]
    pairs = []
    for param_shape, pieces in params:
        param = torch.empty(param_shape, dtype=torch.bfloat16, device=device)
        flat = param.view(-1, *param_shape[-1:]) if len(param_shape) > 1 else param
        row = 0
        for piece in pieces:
            target = flat[row : row + piece[0]] if len(param_shape) > 1 else flat
            pairs.append((target, torch.randn(piece, dtype=torch.bfloat16, device=device)))
            row += piece[0]
    return pairs


def schedule_of(pairs, *, chunked: bool) -> CopySchedule:
    """The replay's schedule of ``pairs``; ``chunked=False``: every group a ``_foreach_copy_``."""
    schedule = CopySchedule(chunked=chunked)
    for destination, source in pairs:
        schedule.add(destination, source)
    schedule.barrier()
    return schedule


def copies_exact(pairs, sides: dict) -> dict[str, bool]:
    """For each side (name -> a call that makes every copy of ``pairs``): whether, run once over
    destinations filled with NaN, every destination holds its source's bits."""
    exact = {}
    for name, fn in sides.items():
        for destination, _ in pairs:
            destination.fill_(float("nan"))
        fn()
        exact[name] = all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in pairs)
    return exact


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_ms(fn, device: torch.device) -> tuple[float, float]:
    """(wall ms of one step with the device synchronised before and after, host ms to issue it)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    issued = time.perf_counter()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3, (issued - start) * 1e3


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def run(args) -> dict:
    device = torch.device(args.device)
    shape = SHAPES[args.model]
    layers = args.layers or shape["layers"]
    pairs = engine_copies(shape, layers, device)
    nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)

    def per_copy():
        for destination, source in pairs:
            destination.copy_(source)

    foreach, schedule = schedule_of(pairs, chunked=False), schedule_of(pairs, chunked=True)
    exact = copies_exact(pairs, {"per_copy": per_copy, "foreach": foreach.run, "schedule": schedule.run})
    floor_source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    floor_out = torch.empty_like(floor_source)
    sides = {
        "per_copy": per_copy,
        "foreach": foreach.run,
        "schedule": schedule.run,
        "floor": lambda: floor_out.copy_(floor_source),
    }
    wall: dict[str, list[float]] = {name: [] for name in sides}
    host: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():
        fn()  # warm-up (the kernel's compile, the allocator)
    for _ in range(args.rounds):
        for name, fn in sides.items():
            for _ in range(args.repeats):
                w, h = step_ms(fn, device)
                wall[name].append(w)
                host[name].append(h)
    floor = statistics.median(wall["floor"])
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "layers": layers,
        "copies": len(pairs),
        "bytes": nbytes,
        "groups": {"foreach": len(foreach.calls), "schedule": len(schedule.calls)},
        "chunked_launches": sum(type(call).__name__ == "ChunkedCopies" for call in schedule.calls),
        "bitwise_equal_to_source": exact,
        "ms": {name: summary(values) for name, values in wall.items()},
        "host_ms": {name: summary(values) for name, values in host.items()},
        "over_floor": {name: round(statistics.median(values) / floor, 3) for name, values in wall.items()},
        "rounds": args.rounds,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def shape_parser(doc: str, model: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark over ``SHAPES``' copies: ``--model`` (default ``model``), ``--layers``,
    ``--out-dir``."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--model", choices=sorted(SHAPES), default=model)
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    return parser


def main() -> None:
    parser = shape_parser(__doc__, "qwen3-30b-a3b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (no kernel; the foreach path)")
    args = parser.parse_args()
    result = run(args)
    print(
        {
            k: result[k]
            for k in ("device", "model", "layers", "copies", "bytes", "over_floor", "bitwise_equal_to_source")
        }
    )
    name = f"replay_copies_{args.model}{f'_{args.layers}layers' if args.layers else ''}.json"
    write_result(args.out_dir or results_dir(), name, result)


if __name__ == "__main__":
    main()
