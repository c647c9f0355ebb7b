"""Benchmark: the chunked-copy kernel's shape (chunk bytes, warps a program, masked or not) on a replay's
copies, against one memcpy of the same bytes, on one GPU (torch and Triton only).

    python scripts/bench_copy_kernel_variants.py --model qwen3-8b [--layers N] [--rounds 7] [--out-dir DIR]

Why: inside vLLM the replay of the 24-layer Qwen3-30B-A3B shape took 15.9 ms against 14.7 ms for one
memcpy on an H200 (1.08x), where ``scripts/bench_replay_copies.py`` had measured the kernel at 1.03x on
an H100. The kernel read every chunk under a mask whose bound is a number from the table, so the
compiler could not prove 16-byte runs and issued 8-byte accesses. The variants:

* ``masked_64k_8w``: that kernel (every chunk masked), 64 KiB chunks, 8 warps;
* ``chunks_<K>k_<W>w``: ``engines.replay.copy_kernels._copy_chunks`` as it is (a whole chunk unmasked, only a
  copy's last shorter chunk masked) with K KiB chunks and W warps a program; the library runs
  ``copy_kernels.CHUNK_BYTES`` and ``NUM_WARPS``.

The copies are ``bench_replay_copies.engine_copies`` (vLLM's fused parameters for the shape), cut into
chunk tables once; each variant is checked bit for bit (every parameter view equal to its source), then
timed by CUDA events, rounds interleaved (every variant and the memcpy, three launches each, again).
Writes DIR/copy_kernel_variants_<model>[_<N>layers].json with its manifest.
"""

from __future__ import annotations

import datetime
import statistics

import torch
import triton
import triton.language as tl
from bench_replay_copies import SHAPES, copies_exact, engine_copies, shape_parser
from provenance import results_dir, write_result

from mbridge_refit.engines.replay import copy_kernels

KIB = 1 << 10
SHAPES_TRIED = ((64, 8), (64, 16), (128, 8), (128, 16), (128, 32), (256, 16))  # (chunk KiB, warps)


@triton.jit
def _masked_chunks(table, CHUNK_WORDS: tl.constexpr):
    """The kernel before: every chunk read and written under ``offsets < words``."""
    row = table + tl.program_id(0).to(tl.int64) * 3
    source = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int64)), 16)
    destination = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int64)), 16)
    offsets = tl.arange(0, CHUNK_WORDS)
    mask = offsets < tl.load(row + 2)
    tl.store(destination + offsets, tl.load(source + offsets, mask=mask), mask=mask)


def launcher(kernel, segments, chunk_bytes: int, warps: int, device: torch.device):
    rows = copy_kernels.chunk_rows(segments, chunk_bytes)
    table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1, 3)
    return lambda: kernel[(len(rows),)](table, CHUNK_WORDS=chunk_bytes // copy_kernels.WORD_BYTES, num_warps=warps)


def event_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def run(args) -> dict:
    device = torch.device("cuda")
    shape = SHAPES[args.model]
    layers = args.layers or shape["layers"]
    pairs = engine_copies(shape, layers, device)
    segments = [segment for d, s in pairs for segment in copy_kernels.byte_segments(d, s)]
    nbytes = sum(n for *_, n in segments)
    sides = {"masked_64k_8w": launcher(_masked_chunks, segments, 64 * KIB, 8, device)}
    for chunk_kib, warps in SHAPES_TRIED:
        sides[f"chunks_{chunk_kib}k_{warps}w"] = launcher(
            copy_kernels._copy_chunks, segments, chunk_kib * KIB, warps, device
        )
    exact = copies_exact(pairs, sides)
    floor_source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    floor_out = torch.empty_like(floor_source)
    sides["memcpy"] = lambda: floor_out.copy_(floor_source)
    for fn in sides.values():
        fn()
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, fn in sides.items():
            ms[name] += [event_ms(fn) for _ in range(3)]
    floor = statistics.median(ms["memcpy"])
    return {
        "device": torch.cuda.get_device_name(device),
        "model": args.model,
        "layers": layers,
        "segments": len(segments),
        "bytes": nbytes,
        "library": {"chunk_bytes": copy_kernels.CHUNK_BYTES, "num_warps": copy_kernels.NUM_WARPS},
        "bitwise_equal_to_source": exact,
        "ms": {name: {"median": round(statistics.median(v), 3), "min": round(min(v), 3)} for name, v in ms.items()},
        "over_memcpy": {name: round(statistics.median(v) / floor, 4) for name, v in ms.items()},
        "rounds": args.rounds,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    parser = shape_parser(__doc__, "qwen3-8b")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    result = run(args)
    print({k: result[k] for k in ("device", "model", "layers", "bytes", "over_memcpy", "bitwise_equal_to_source")})
    name = f"copy_kernel_variants_{args.model}{f'_{args.layers}layers' if args.layers else ''}.json"
    write_result(args.out_dir or results_dir(), name, result)


if __name__ == "__main__":
    main()
