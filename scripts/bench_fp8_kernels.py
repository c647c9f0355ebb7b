"""Benchmark: launch shapes of the blockwise FP8 quantizer kernel on the linear weights of a
full-size model shape (random bf16), as the TP1 FP8 export quantizes them: one grouped launch per
layer (the export launches one per bucket), q, k and v read run by run from the fused QKV weight.

Run on the GPU host (one GPU, no Megatron needed):

    python scripts/bench_fp8_kernels.py --model qwen3-8b --out benchmarks/results/DATE-DEVICE/fp8_kernels_qwen3-8b.json

The baseline (whole tensors, one table row each) launch's bytes and scales are first checked against the torch reference path (first
layer), then every config's against the baseline's. Device times are CUDA-event medians. Taken
side by side: the floor (a bf16 clone moving the same bytes), and torch's ``copy_`` of the weights
into float8 (a cast that reads and writes what quantizing does, without the amax; slower than the
quantizer on H200, so not a floor).

Configs (``fp8_kernels.LaunchConfig``, listed by ``candidate_configs`` here): how tensors are cut into
chunks of block rows, and warps per block program. Also timed: the default config in one launch
for all layers (what launch boundaries cost), the host time per launch (Triton's launch
against replaying a CUDA graph of it), and with ``--te`` Transformer Engine's own CUDA blockwise
quantizer on the same pieces (what a hand-written kernel reaches).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

logger = logging.getLogger("bench_fp8_kernels")


def layer_weights(config, weight) -> tuple[list[tuple[str, torch.Tensor]], dict[str, tuple]]:
    """One decoder layer's linear weights as the TP1 export holds them: fused QKV (grouped heads:
    per KV group its q rows, then k, then v) with the row runs of q, k and v, and the others."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    groups, q_rows = config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads * head_dim
    group_rows = q_rows + 2 * head_dim
    qkv = weight((groups * group_rows, hidden))
    runs = {
        "q": tuple((g * q_rows, g * group_rows, q_rows) for g in range(groups)),
        "k": tuple((g * head_dim, g * group_rows + q_rows, head_dim) for g in range(groups)),
        "v": tuple((g * head_dim, g * group_rows + q_rows + head_dim, head_dim) for g in range(groups)),
    }
    shapes = {"o": (hidden, groups * q_rows), "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return [("qkv", qkv), *((name, weight(shape)) for name, shape in shapes.items())], runs


def run_jobs(qkv: torch.Tensor, runs: tuple, q: torch.Tensor, s: torch.Tensor) -> list[tuple]:
    """(source, q, scale) views quantizing each run of ``qkv`` into its rows of ``q`` / ``s``."""
    from mbridge_refit.fp8.format import row_piece

    return [row_piece(qkv, q, s, x_row=src, q_row=hf, rows=n) for hf, src, n in runs]


def candidate_configs() -> list:
    """The launch configs timed: chunk sizes at 4 warps, and the default at 8 warps."""
    from mbridge_refit.fp8_kernels import LaunchConfig

    return [*(LaunchConfig(chunk_blocks=chunk) for chunk in (None, 64, 128, 256, 512)), LaunchConfig(num_warps=8)]


def device_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times[1:])


def te_blockwise(jobs: list[tuple], repeats: int) -> dict:
    """Transformer Engine's CUDA 128x128 blockwise quantizer (amax scales, not powers of two) on
    the same pieces, one call per piece replayed from a CUDA graph (so host launch costs do not
    count): its device time, and how many pieces' bytes and scales equal ours (TE scales by
    multiplying with 448/amax, we divide by amax/448: the rounding may differ)."""
    import transformer_engine_torch as tex  # registered by the import above
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
    )

    quantizer = Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, force_pow_2_scales=False)
    pairs = [(x, quantizer(x)) for x, _, _ in jobs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, dst in pairs:
            quantizer.update_quantized(x, dst)
    graph.replay()
    torch.cuda.synchronize()
    equal = 0
    for (x, q, scale), (_, dst) in zip(jobs, pairs):
        meta = dst.get_metadata()
        te_scale = meta["rowwise_scale_inv"][: scale.shape[0], : scale.shape[1]]
        equal += torch.equal(meta["rowwise_data"].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            te_scale, scale
        )
    return {"ms": device_ms(graph.replay, repeats), "pieces": len(jobs), "pieces_equal_to_ours": equal}


def host_launch_costs(launches, repeats: int) -> dict:
    """Host microseconds per launch (no synchronize in between): the Triton launch, and the
    replay of a CUDA graph that holds the same launch."""
    from mbridge_refit.fp8 import kernels as fp8_kernels

    graphs = []
    for launch in launches:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fp8_kernels.launch_grouped(launch)
        graphs.append(graph)

    def host_us(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6 / len(launches))
        torch.cuda.synchronize()
        return statistics.median(times[1:])

    costs = {
        "triton": host_us(lambda: [fp8_kernels.launch_grouped(launch) for launch in launches]),
        "cuda_graph_replay": host_us(lambda: [graph.replay() for graph in graphs]),
    }
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a shape in recipes/shapes/ (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=None, help="layers to quantize (default: the shape's)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--te", action="store_true", help="also time Transformer Engine's blockwise quantizer on the same pieces"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from mbridge_refit.fp8 import kernels as fp8_kernels
    from mbridge_refit.fp8.format import FP8_DTYPE, SCALE_DTYPE, scale_shape
    from mbridge_refit.fp8.reference import quantize_reference
    from mbridge_refit.models.recipes import full_size_config

    config = full_size_config(args.model)
    layers = args.layers or config.num_hidden_layers
    gen = torch.Generator(device="cuda").manual_seed(0)

    def weight(shape):
        return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16)

    def outputs(x):
        return (
            torch.empty(x.shape, dtype=FP8_DTYPE, device="cuda"),
            torch.empty(scale_shape(tuple(x.shape)), dtype=SCALE_DTYPE, device="cuda"),
        )

    jobs = []  # per layer: (source, q, scale) triples, q, k and v quantized run by run from the fused QKV
    for _ in range(layers):
        tensors, runs = layer_weights(config, weight)
        qkv = tensors[0][1]
        layer = []
        for name, selection in runs.items():
            rows = selection[-1][0] + selection[-1][2]
            layer += run_jobs(qkv, selection, *outputs(torch.empty(rows, qkv.shape[1], device="meta")))
        layer += [(x, *outputs(x)) for _, x in tensors[1:]]
        jobs.append(layer)
    nbytes = sum(x.numel() * (x.element_size() + 1) for layer in jobs for x, _, _ in layer)
    logger.info(
        "%s: %d layers, %d jobs (q, k, v by runs of the fused QKV), %.1f GB read + written",
        args.model,
        layers,
        sum(map(len, jobs)),
        nbytes / 1e9,
    )

    previous = fp8_kernels.LaunchConfig(chunk_blocks=None)  # whole tensors, one table row each
    baseline = [fp8_kernels.grouped_launch(layer, previous) for layer in jobs]
    for launch in baseline:
        fp8_kernels.launch_grouped(launch)
    reference = [[(q.view(torch.uint8).clone(), s.clone()) for _, q, s in layer] for layer in jobs]
    for x, q, s in jobs[0]:
        ref_q, ref_s = torch.empty_like(q), torch.empty_like(s)
        quantize_reference(x, out=ref_q, scale_out=ref_s)
        assert torch.equal(ref_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ref_s, s), (
            "baseline != torch path"
        )

    def same_as_reference() -> bool:
        return all(
            torch.equal(q.view(torch.uint8), rq) and torch.equal(s, rs)
            for layer, refs in zip(jobs, reference)
            for (_, q, s), (rq, rs) in zip(layer, refs)
        )

    results = {
        "model": args.model,
        "layers": layers,
        "bytes": nbytes,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "configs": {},
    }
    casts = [[(x, q) for x, q, _ in layer] for layer in jobs]
    results["torch_cast_ms"] = device_ms(lambda: [q.copy_(x) for layer in casts for x, q in layer], args.repeats)
    flat = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")  # a clone reads and writes nbytes / 2
    results["clone_floor_ms"] = device_ms(lambda flat=flat: flat.clone(), args.repeats)
    del flat
    results["baseline_ms"] = device_ms(
        lambda: [fp8_kernels.launch_grouped(launch) for launch in baseline], args.repeats
    )
    logger.info(
        "clone floor %.2f ms, torch cast %.2f ms, baseline (2d, whole tensors) %.2f ms (%.0f GB/s)",
        results["clone_floor_ms"],
        results["torch_cast_ms"],
        results["baseline_ms"],
        nbytes / results["baseline_ms"] / 1e6,
    )

    for launch_config in candidate_configs():
        for _, q, s in (j for layer in jobs for j in layer):
            q.view(torch.uint8).fill_(0xFF)
            s.fill_(-1.0)
        try:
            launches = [fp8_kernels.grouped_launch(layer, launch_config) for layer in jobs]
            for launch in launches:
                fp8_kernels.launch_grouped(launch)
            torch.cuda.synchronize()
        except Exception as err:  # a config that does not compile here is reported, not fatal
            logger.info("%-40s failed: %s", launch_config.label, fp8_kernels.root_cause(err))
            results["configs"][launch_config.label] = {"error": fp8_kernels.root_cause(err)}
            continue
        exact = same_as_reference()
        ms = device_ms(lambda launches=launches: [fp8_kernels.launch_grouped(one) for one in launches], args.repeats)
        results["configs"][launch_config.label] = {"ms": ms, "gb_s": nbytes / ms / 1e6, "exact": exact}
        logger.info("%-40s %7.2f ms  %5.0f GB/s  exact=%s", launch_config.label, ms, nbytes / ms / 1e6, exact)

    whole = fp8_kernels.grouped_launch([job for layer in jobs for job in layer])
    results["default_one_launch_ms"] = device_ms(lambda: fp8_kernels.launch_grouped(whole), args.repeats)
    logger.info(
        "%-40s %7.2f ms in one launch for all layers",
        fp8_kernels.DEFAULT_CONFIG.label,
        results["default_one_launch_ms"],
    )
    results["host_us_per_launch"] = host_launch_costs(
        [fp8_kernels.grouped_launch(layer) for layer in jobs], args.repeats
    )
    logger.info("host time per grouped launch: %s", results["host_us_per_launch"])

    if args.te:
        for launch in [fp8_kernels.grouped_launch(layer) for layer in jobs]:
            fp8_kernels.launch_grouped(launch)  # ours, for the comparison of bits
        results["te_blockwise"] = te_blockwise([job for layer in jobs for job in layer], args.repeats)
        logger.info(
            "Transformer Engine blockwise quantizer (CUDA graph of %d calls): %s",
            results["te_blockwise"]["pieces"],
            results["te_blockwise"],
        )

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
