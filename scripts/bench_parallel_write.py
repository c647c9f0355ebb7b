"""Benchmark: checkpoint conversion with data-parallel replicas writing in parallel (CPU ranks).

The same `convert roundtrip` at one model-parallel layout (default TP2) on 2, 4, 8 ... ranks: the
ranks beyond the layout are data-parallel replicas, and each replica exports and writes its own
share of the shards. Every run's output must be byte-identical to the first one's (same files,
same index) and equal to the source checkpoint tensor by tensor.

Reports the export+write phase (rank 0's `export+write:` log line: planning, gathers, files,
index, swap; what replicas divide), rank 0's time in its own shard files, the disk floor (the
same bytes written and fsynced by as many threads as there are ranks, no export), and the
whole launch's wall time (which also holds process start and every rank loading its slices,
which replicas do not divide), per rank count, in interleaved rounds. Needs as many CPU cores as the largest rank count to show the speed-up:

    python scripts/bench_parallel_write.py --ranks 2 4 8 --rounds 2
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import REPO, results_dir, write_result

# Qwen3 dense, about 0.4 GB in bf16: big enough that gathers and file writes dominate.
BENCH_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "head_dim": 64,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
    "attention_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "bfloat16",
    "num_hidden_layers": 12,
    "intermediate_size": 3072,
    "vocab_size": 32768,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}
PHASE = re.compile(r"export\+write: (\d+) tensors in ([0-9.]+) s, of which ([0-9.]+) s writing .* \((\d+) replica")


def make_source(directory: Path, max_shard_bytes: int) -> Path:
    from mbridge_refit.models.recipes import ModelRecipe, make_random_checkpoint

    recipe = ModelRecipe(name="qwen3-bench-write", hf_config=BENCH_CONFIG, description="parallel-write benchmark")
    return make_random_checkpoint(recipe, directory, seed=7, max_shard_bytes=max_shard_bytes)


def convert(ranks: int, source: Path, out: Path, layout: list[str], max_shard_bytes: int) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "mbridge_refit.convert",
        "--nproc-per-node",
        str(ranks),
        "roundtrip",
        "--hf",
        str(source),
        "--out",
        str(out),
        "--overwrite",
        "--no-progress",
        "--max-shard-bytes",
        str(max_shard_bytes),
        *layout,
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    match = PHASE.search(proc.stdout + proc.stderr)
    if match is None:
        raise SystemExit(f"no export+write line in the output of {' '.join(cmd)}")
    return {
        "export_write_s": float(match[2]),
        "rank0_files_s": float(match[3]),
        "wall_s": wall,
        "replicas": int(match[4]),
    }


def disk_floor(directory: Path, total_bytes: int, shard_bytes: int, writers: int) -> float:
    """Seconds to write and fsync ``total_bytes`` as ``shard_bytes`` files from ``writers`` threads
    (fsync and file writes release the GIL): what the files alone cost on this disk."""
    from concurrent.futures import ThreadPoolExecutor

    directory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(min(shard_bytes, 1 << 20))
    sizes = [min(shard_bytes, total_bytes - start) for start in range(0, total_bytes, shard_bytes)]

    def write(index: int) -> None:
        path = directory / f"floor-{index}.bin"
        with path.open("wb") as handle:
            left = sizes[index]
            while left:
                left -= handle.write(block[: min(left, len(block))])
            handle.flush()
            os.fsync(handle.fileno())

    start = time.monotonic()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(len(sizes))))
    seconds = time.monotonic() - start
    for path in directory.glob("floor-*.bin"):
        path.unlink()
    return seconds


def same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="rank counts to compare (default: 2 4)")
    parser.add_argument(
        "--layout", nargs="*", default=["--tp", "2"], help="model-parallel layout flags (default: --tp 2)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the rank counts")
    parser.add_argument(
        "--max-shard-bytes", type=int, default=32 << 20, help="source and output shard size (default 32 MiB: 14 files)"
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument(
        "--out-dir", type=Path, default=None, help="results folder (default: benchmarks/results/<date>-cpu<cores>/)"
    )
    args = parser.parse_args()

    from mbridge_refit.checkpoints.hf import compare_checkpoints

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-parallel-write-"))
    source = make_source(work / "source", args.max_shard_bytes) if not (work / "source").is_dir() else work / "source"
    source_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    runs: dict[int, list[dict]] = {n: [] for n in args.ranks}
    for round_number in range(args.rounds):
        for ranks in args.ranks:
            result = convert(ranks, source, work / f"out-{ranks}", args.layout, args.max_shard_bytes)
            result["disk_floor_s"] = disk_floor(work / "floor", source_bytes, args.max_shard_bytes, ranks)
            runs[ranks].append(result)
            print(f"round {round_number} ranks {ranks}: {result}", flush=True)
    first = work / f"out-{args.ranks[0]}"
    identical = {n: same_files(first, work / f"out-{n}") for n in args.ranks}
    equal_to_source = compare_checkpoints(source, first) == []
    rows = [
        {
            "ranks": n,
            "replicas": runs[n][0]["replicas"],
            "export_write_s": statistics.median(r["export_write_s"] for r in runs[n]),
            "rank0_files_s": statistics.median(r["rank0_files_s"] for r in runs[n]),
            "disk_floor_s": statistics.median(r["disk_floor_s"] for r in runs[n]),
            "wall_s": statistics.median(r["wall_s"] for r in runs[n]),
            "files_identical_to_first": identical[n],
        }
        for n in args.ranks
    ]
    base = rows[0]["export_write_s"]
    for row in rows:
        row["export_write_speedup"] = round(base / row["export_write_s"], 2)
    payload = {
        "model": "qwen3 1024h x 12 layers, vocab 32768 (bf16)",
        "bytes": source_bytes,
        "layout": " ".join(args.layout),
        "cpu_cores": os.cpu_count(),
        "rounds": args.rounds,
        "output_equals_source": equal_to_source,
        "rows": rows,
    }
    for row in rows:
        print(
            f"{row['ranks']} ranks ({row['replicas']} replicas): export+write {row['export_write_s']:.2f} s "
            f"({row['export_write_speedup']}x; rank 0 in its files {row['rank0_files_s']:.2f} s; the same bytes written "
            f"and synced by {row['ranks']} writers alone {row['disk_floor_s']:.2f} s), launch {row['wall_s']:.1f} s, "
            f"identical {row['files_identical_to_first']}"
        )
    print(f"output equals the source: {equal_to_source}")
    label = f"cpu{os.cpu_count()}"  # CPU ranks only: the folder names the core count, not a GPU
    write_result(
        args.out_dir or results_dir(label), "parallel_write.json", payload, device=f"{label} ({os.uname().nodename})"
    )
    if not (equal_to_source and all(identical.values())):
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
