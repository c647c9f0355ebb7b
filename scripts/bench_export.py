"""Benchmark: stock AutoBridge.export_hf_weights vs RefitBridge (cache off / on) vs a clone floor.

Run on the GPU host, one process per GPU:

    torchrun --nproc-per-node 1 scripts/bench_export.py --model qwen3-8b --tp 1
    torchrun --nproc-per-node 2 scripts/bench_export.py --model qwen3-8b --tp 2
    torchrun --nproc-per-node 1 scripts/bench_export.py --model qwen3-vl-30b-a3b --layers 4 --from-checkpoint

All numbers of one run are taken side by side in that run. Each export is consumed by a no-op
consumer (the loop only touches each yielded tensor), then the device is synchronised, so the
time is what the exporter itself costs. Each variant is timed on its own, one after another (its
first call, then the median of ``--steady`` calls: ``<variant>_first_ms``, ``<variant>_steady_ms``),
the floors apart (``clone_floor_ms``, ``gather_floor_ms``: medians of repeats). Memory: "peak
extra" is the peak allocated during an export minus what was allocated before it (the model),
from torch.cuda.memory_stats. ``cached_new_allocations_after_first`` counts CUDA caching-allocator
allocations made by the cached exports after the first one (``allocation.all.allocated``); it
must be 0.
Host: ``<variant>_host_us_per_tensor`` is the exporting thread's CPU time per yielded tensor; after
each steady call a fixed control loop over the model's parameters is timed too
(``host_control_us``): ``refit_cached_`` and ``stock_host_control_us_per_item`` are its medians and
``refit_cached_`` and ``stock_host_over_control`` the medians of the per-call ratios. The host's own speed
moved the first figure 1.8-3.4 µs per tensor on one GPU host within half an hour; the ratio takes out part of
that (two runs 1.31x apart in host time were 1.12x apart in the ratio), not all.
``host_floor`` alternates, ``--rounds`` times, one steady cached export with the same consumer loop over
the pairs one export yielded, replayed from a list by a generator that only yields (``replayed``): that
floor is what handing out as many tensors costs this host at that moment, whatever the exporter, and
``ours_over_yield_floor`` what the exporter adds to it; ``python_process`` what in the process could slow
every Python step (``python_process_state``). At world size 1 the
row also holds ``host_profile`` (cProfile's top functions over one cached export) and ``device_timeline``
(its kernels, busy and idle time on the device's clock), for BF16 and, with ``--fp8``, FP8.

Then ``interleaved`` (what the README's table shows, ``scripts/render_performance.py``): one
warm-up round and ``--rounds`` recorded rounds, each calling stock's export, our cached export,
with ``--fp8`` our cached FP8 export, and the floor once, in that order (the floor: the device
copy of ``clone_floor_ms`` at world size 1, the all-gather of ``gather_floor_ms`` above), so
drift of the host during the run hits every side alike::

    {"rounds": R, "warmup_rounds": 1, "order": ["stock", "ours", ("fp8",) "floor"],
     "stock_ms": [R], "ours_ms": [R], ("fp8_ms": [R],) "floor_ms": [R],   # per recorded round
     "speedup": [stock/ours], "ours_over_floor": [ours/floor], ("fp8_over_floor": [fp8/floor],)
     "median": {each list's key: its median}, "floor": "clone" | "all-gather"}

Writes one JSON per run (rank 0) with its manifest to --out-dir (default benchmarks/results/<date>-<device>/) and prints a table.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import logging
import pstats
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import results_dir, write_result

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags

logger = logging.getLogger("bench_export")


def hf_config(name: str, layers: int | None = None):
    """A full-size shape from recipes/shapes/ (config only; the weights are random), optionally
    cut to its first ``layers`` language layers (every layer keeps the shape's widths and expert
    count; a vision tower is kept whole)."""
    from mbridge_refit.models.recipes import full_size_config

    config = full_size_config(name)
    if layers is not None:
        getattr(config, "text_config", config).num_hidden_layers = layers
    return config


def bridges(args, work_dir: Path, rank: int):
    """(RefitBridge, stock AutoBridge) of the shape: from its config, or with ``--from-checkpoint``
    from a checkpoint shell written by rank 0 (the shape's tensor names and shapes in the published
    layout, uninitialized values: ``testing.tiny_models.write_checkpoint_shell``), so each
    bridge picks its mappings from the checkpoint as users' bridges do (packed experts)."""
    from megatron.bridge import AutoBridge

    from mbridge_refit.bridge import RefitBridge

    config = hf_config(args.model, args.layers)
    if not args.from_checkpoint:
        return RefitBridge.from_hf_config(config), AutoBridge.from_hf_config(hf_config(args.model, args.layers))
    from mbridge_refit.testing.tiny_models import write_checkpoint_shell

    shared = [str(work_dir / "checkpoint")]
    dist.broadcast_object_list(shared, src=0)  # rank 0's directory: one host, so every rank reads it
    shell = Path(shared[0])
    if rank == 0:
        write_checkpoint_shell(config, shell)
    dist.barrier()
    return RefitBridge.from_hf_pretrained(shell), AutoBridge.from_hf_pretrained(shell)


def timed_export(make_stream) -> tuple[float, int, int, int, float]:
    """(ms, peak extra bytes, tensors, CUDA allocations, host ms) for one full pass over an export
    stream; host ms is this thread's CPU time over the pass (``time.thread_time``), the host work
    apart from the device's."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    allocations_before = allocations()
    start, host_start = time.perf_counter(), time.thread_time()
    count = 0
    for _, tensor in make_stream():
        count += 1
        del tensor
    host = (time.thread_time() - host_start) * 1e3
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) * 1e3
    new_allocations = allocations() - allocations_before
    peak = torch.cuda.max_memory_allocated() - base
    return elapsed, peak, count, new_allocations, host


def host_control_us(items: list[torch.Tensor], passes: int = 3) -> float:
    """This thread's CPU time, in µs per item, of a fixed loop over ``items`` (each tensor's ``data_ptr``,
    ``isinstance`` and ``id``, and a dict store: the kinds of host work a cached export does per tensor, none
    of the exporter's code); the median of ``passes``. Timed beside each steady export, it measures how fast
    the host runs Python at that moment, to help tell a host that slowed down from an exporter that does more
    (module docstring)."""
    seen: dict[int, int] = {}
    times = []
    for _ in range(passes):
        start = time.thread_time()
        for item in items:
            seen[id(item)] = isinstance(item, torch.Tensor) and item.data_ptr()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6 / max(len(items), 1)


def replayed(pairs: list) -> Callable[[], Iterator]:
    """A stream of ``pairs`` as a generator that has every pair ready and only yields it: the least any
    exporter that hands out one ``(name, tensor)`` at a time through a Python generator can cost."""

    def stream() -> Iterator:
        yield from pairs

    return stream


def host_floor_rounds(make_stream, rounds: int = 7) -> dict:
    """Host CPU per tensor of the cached export against the yield floor, alternating on this thread.

    Each round times one steady export (``timed_export``'s loop and clock) and then the same loop over
    ``replayed`` pairs that one export yielded, held in a list (the same name and tensor objects, so
    the same memory is touched). The floor is what handing out that many tensors costs this host at
    that moment, whatever the exporter; the ratio is the exporter's own cost on top of it."""
    pairs = list(make_stream())
    floor = replayed(pairs)
    ours_us, floor_us = [], []
    for _ in range(rounds):
        ours_us.append(timed_export(make_stream)[4] * 1e3 / len(pairs))
        floor_us.append(timed_export(floor)[4] * 1e3 / len(pairs))
    ratios = [o / f for o, f in zip(ours_us, floor_us) if f > 0]
    return dict(
        rounds=rounds,
        tensors=len(pairs),
        ours_us_per_tensor=ours_us,
        yield_floor_us_per_tensor=floor_us,
        median=dict(
            ours_us_per_tensor=statistics.median(ours_us),
            yield_floor_us_per_tensor=statistics.median(floor_us),
            ours_over_yield_floor=statistics.median(ratios) if ratios else None,
        ),
    )


def host_figures(host_ms: list[float], control_us: list[float], tensors: int) -> dict:
    """A variant's host figures from its steady runs: this thread's CPU time per yielded tensor (median and
    range), the control loop's time per item beside each run (``host_control_us``) and the median of the
    per-run ratios of the two (None where no control reading was above 0: a clock too coarse for the loop)."""
    per_tensor = [ms * 1e3 / tensors for ms in host_ms]
    ratios = [h / c for h, c in zip(per_tensor, control_us) if c > 0]
    return dict(
        host_us_per_tensor=statistics.median(per_tensor),
        host_us_per_tensor_range=[min(per_tensor), max(per_tensor)],
        host_control_us_per_item=statistics.median(control_us),
        host_over_control=statistics.median(ratios) if ratios else None,
    )


def clone_source(total_bytes: int) -> tuple[torch.Tensor, int]:
    """A random source for device copies of ``total_bytes``, and in how many pieces they are copied: one,
    unless a source and its copy do not fit beside the model (in the memory free now); then equal pieces
    of several GB each (a model of half the GPU's memory), copied one after another from one source piece."""
    free, _ = torch.cuda.mem_get_info()
    pieces = max(1, -(-2 * total_bytes // int(0.9 * free)))
    source = torch.empty(-(-total_bytes // pieces), dtype=torch.uint8, device="cuda")
    source.random_(0, 255)
    return source, pieces


def clone_once_ms(source: torch.Tensor, total_bytes: int, pieces: int) -> float:
    """Milliseconds of one device copy of ``total_bytes`` from ``source`` in ``pieces`` (their times summed)."""
    elapsed = 0.0
    for index in range(pieces):
        size = min(source.numel(), total_bytes - index * source.numel())
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy = source[:size].clone()
        torch.cuda.synchronize()
        elapsed += time.perf_counter() - start
        del copy
    return elapsed * 1e3


def clone_floor_ms(total_bytes: int, repeats: int = 7) -> tuple[float, int]:
    """Milliseconds of one device copy of ``total_bytes`` (the median of ``repeats`` after a warm-up), and in
    how many pieces (``clone_source``)."""
    source, pieces = clone_source(total_bytes)
    times = [clone_once_ms(source, total_bytes, pieces) for _ in range(repeats)]
    del source
    return statistics.median(times[1:]), pieces


def gather_buffers(total_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's random input, the output) of an all_gather_into_tensor whose output is ``total_bytes``."""
    world = dist.get_world_size()
    local = torch.empty(total_bytes // world, dtype=torch.uint8, device="cuda").random_(0, 255)
    return local, torch.empty(local.numel() * world, dtype=torch.uint8, device="cuda")


def gather_once_ms(local: torch.Tensor, out: torch.Tensor) -> float:
    """Milliseconds of one all_gather_into_tensor of ``local`` into ``out``, every rank started together."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    dist.all_gather_into_tensor(out, local)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def gather_floor_ms(total_bytes: int, repeats: int = 7) -> float:
    """One all_gather_into_tensor whose output is ``total_bytes`` per rank (TP>1's transfer bound)."""
    if dist.get_world_size() == 1:
        return 0.0
    local, out = gather_buffers(total_bytes)
    times = [gather_once_ms(local, out) for _ in range(repeats)]
    del local, out
    return statistics.median(times[1:])


def floor_call(total_bytes: int) -> tuple[Callable[[], float], str]:
    """The floor the README's table holds an export against, as a call that times it once, and its name:
    the all-gather of ``total_bytes`` at world size > 1 (``gather_floor_ms``'s), else their device copy
    (``clone_floor_ms``'s). Its buffers are allocated now and live as long as the call."""
    if dist.get_world_size() > 1:
        local, out = gather_buffers(total_bytes)
        return lambda: gather_once_ms(local, out), "all-gather"
    source, pieces = clone_source(total_bytes)
    return lambda: clone_once_ms(source, total_bytes, pieces), "clone"


def compare_with_stock(stock_stream, refit_stream) -> list[str]:
    """Walk both exports in lockstep; names, dtypes, shapes and bytes must all agree."""
    problems = []
    for (stock_name, expected), (name, got) in zip(stock_stream, refit_stream, strict=True):
        same = stock_name == name and got.dtype == expected.dtype and got.shape == expected.shape
        if not same or not torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)):
            problems.append(f"{stock_name} vs {name}")
    return problems


def quantizer_path() -> str:
    from mbridge_refit.fp8.quantize import quantizer_path as path

    return path()


def check_fp8_export(fp8_stream, bf16_stream, cpu_checks: int = 8) -> list[str]:
    """The FP8 export's bytes and scales (what the export's kernels wrote) against the torch
    reference path on the GPU for every quantized tensor, and against the CPU torch path for the
    first ``cpu_checks``: names of mismatches. ``bf16_stream`` must own its tensors (cache off)."""
    from mbridge_refit.fp8.format import SCALE_SUFFIX
    from mbridge_refit.fp8.quantize import quantize_blockwise
    from mbridge_refit.fp8.reference import quantize_reference

    def same(a, b):
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))

    sources = dict(bf16_stream)
    problems, checked, data = [], 0, {}
    for name, tensor in fp8_stream:
        if tensor.dtype == torch.float8_e4m3fn:
            data[name] = tensor
            continue
        weight = name.removesuffix(SCALE_SUFFIX)
        if not name.endswith(SCALE_SUFFIX) or weight not in data:
            continue
        source = sources[weight]
        ref_q = torch.empty(source.shape, dtype=torch.float8_e4m3fn, device=source.device)
        ref_s = torch.empty_like(tensor)
        quantize_reference(source, out=ref_q, scale_out=ref_s)
        ok = same(data.pop(weight), ref_q) and same(tensor, ref_s)
        if ok and checked < cpu_checks:
            cpu_q, cpu_s = quantize_blockwise(source.cpu())
            ok = same(ref_q.cpu(), cpu_q) and same(ref_s.cpu(), cpu_s)
        checked += 1
        if not ok:
            problems.append(weight)
    if checked == 0:
        problems.append("no quantized tensor was checked")
    return problems


def fp8_breakdown(bridge, chunks, repeats: int = 5) -> dict:
    """Where the FP8 export's time goes (TP=1): the host time to run the cached FP8 export
    generator to its end before the final synchronize, and the export's own bucket quantizers
    alone on the exported buckets (device time by CUDA events, host time to launch them): as the
    export runs them (grouped launches prepared once), and one launch per job
    (``quantize_blockwise``; a job is a weight, or a run of q/k/v rows in the fused QKV)."""
    from mbridge_refit.fp8 import kernels as fp8_kernels
    from mbridge_refit.fp8.format import BlockwiseFP8Config
    from mbridge_refit.fp8.quantize import BucketQuantizer, quantize_blockwise
    from mbridge_refit.runtime.buffers import ExportBuffers

    def median_of(fn) -> tuple[float, float]:
        hosts, devices = [], []
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            fn()
            end.record()
            hosts.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
            devices.append(begin.elapsed_time(end))
        return statistics.median(hosts[1:]), statistics.median(devices[1:])

    def export_host_only():
        for _ in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise"):
            pass

    fp8 = bridge.fp8_export(chunks, BlockwiseFP8Config())
    scales = {e.scale_of: e for e in fp8.plan.entries if e.scale_of is not None}
    buffers = ExportBuffers(persistent=False)  # every bucket keeps its own outputs
    quantizers = []
    for bucket in fp8.weights.export_buckets(buffers, select_rows_lazily=True, bucket_sizes=fp8.bucket_sizes):
        quantizer = BucketQuantizer.build(bucket, scales, buffers)
        if quantizer.positions:
            quantizers.append((quantizer, [bucket[i][1] for i in quantizer.positions]))
    jobs = [job for quantizer, sources in quantizers for job in quantizer.jobs(sources)]

    def as_exported():
        for quantizer, sources in quantizers:
            quantizer.run(sources, buffers)

    def per_job():
        for source, q, scale in jobs:
            quantize_blockwise(source, out=q, scale_out=scale)

    as_exported()  # plans each bucket's launches
    export_host, export_device = median_of(export_host_only)
    per_host, per_device = median_of(per_job)
    grouped_host, grouped_device = median_of(as_exported)
    quantized = sum(source.numel() * (source.element_size() + 1) for source, _, _ in jobs)
    return dict(
        fp8_export_host_ms=export_host,
        fp8_export_device_ms=export_device,
        quantize_per_weight_host_ms=per_host,
        quantize_per_weight_device_ms=per_device,
        quantize_grouped_host_ms=grouped_host,
        quantize_grouped_device_ms=grouped_device,
        quantize_launches_per_weight=len(jobs),
        quantize_launches_grouped=sum(quantizer.launches for quantizer, _ in quantizers),
        quantize_bytes_moved=quantized,
        quantize_grouped_gb_s=quantized / grouped_device / 1e6,
        quantize_per_weight_gb_s=quantized / per_device / 1e6,
        quantizer_launch=fp8_kernels.DEFAULT_CONFIG.label,
    )


def interleaved_rounds(
    calls: dict[str, Callable[[], float]], rounds: int, ratios: dict[str, tuple[str, str]], warmup: int = 1
) -> dict:
    """``warmup`` rounds, then ``rounds`` recorded ones; each round calls every entry of ``calls`` once, in the
    dict's order, each call timing one run of its side in ms. Per side ``<name>_ms``: its recorded times; per
    ratio ``name: (numerator, denominator)`` whose sides are both called, the per-round ratios; ``median`` of
    each list."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for index in range(warmup + rounds):
        for name, call in calls.items():
            elapsed = call()
            if index >= warmup:
                times[name].append(elapsed)
    lists = {f"{name}_ms": values for name, values in times.items()}
    for ratio, (numerator, denominator) in ratios.items():
        if numerator in times and denominator in times:
            lists[ratio] = [a / b for a, b in zip(times[numerator], times[denominator])]
    median = {key: statistics.median(values) for key, values in lists.items()}
    return dict(rounds=rounds, warmup_rounds=warmup, order=list(calls), **lists, median=median)


TABLE_RATIOS = {"speedup": ("stock", "ours"), "ours_over_floor": ("ours", "floor"), "fp8_over_floor": ("fp8", "floor")}


def table_rounds(make_stock, make_ours, make_fp8, total_bytes: int, rounds: int) -> dict:
    """The README table's numbers (the result's ``interleaved`` field): rounds of stock's export, our cached
    export, our cached FP8 export (when ``make_fp8`` is given) and the floor (``floor_call``), in that order,
    so that drift of the host's speed during the run hits every side alike."""
    floor_once, floor = floor_call(total_bytes)
    calls = {"stock": lambda: timed_export(make_stock)[0], "ours": lambda: timed_export(make_ours)[0]}
    if make_fp8 is not None:
        calls["fp8"] = lambda: timed_export(make_fp8)[0]
    calls["floor"] = floor_once
    return dict(interleaved_rounds(calls, rounds, TABLE_RATIOS), floor=floor)


def interleaved(make_bf16, make_fp8, pairs: int) -> dict:
    """The cached BF16 and FP8 exports timed alternately (after a warm-up of each), so that drift
    of the host's speed during the run hits both alike: medians, the median per-pair ratio, and
    the ratio of the minima (each export's least disturbed run; on this GPU host the host side
    of an export varies up to 2x between minutes)."""
    calls = {"bf16": lambda: timed_export(make_bf16)[0], "fp8": lambda: timed_export(make_fp8)[0]}
    times = interleaved_rounds(calls, pairs, {"fp8_over_bf16": ("fp8", "bf16")})
    bf16, fp8 = times["bf16_ms"], times["fp8_ms"]
    return dict(
        bf16_ms=times["median"]["bf16_ms"],
        fp8_ms=times["median"]["fp8_ms"],
        fp8_over_bf16=times["median"]["fp8_over_bf16"],
        pairs=pairs,
        bf16_min_ms=min(bf16),
        fp8_min_ms=min(fp8),
        fp8_over_bf16_min=min(fp8) / min(bf16),
    )


def device_timeline(make_stream) -> dict:
    """One pass over an export stream with the device's kernels recorded (torch.profiler, CUDA
    activity only, so the host runs as unprofiled as possible), read on the device's clock: a
    one-element marker kernel is launched just before the stream starts, so ``lead_in_us`` is
    the device's idle time from the export's start to its first kernel (the host work before
    the first launch); ``busy_us`` the export's kernels; ``gaps_us`` the idle time between
    them; ``span_us`` from the marker to the end of the last kernel."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    marker = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        marker.add_(1)
        for _ in make_stream():
            pass
        torch.cuda.synchronize()
    kernels = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda k: k[0],
    )
    if len(kernels) < 2:
        return {"kernels": 0, "events": len(prof.events())}
    (_, marker_end, _), export = kernels[0], kernels[1:]
    gaps = sum(max(0.0, start - end) for (_, end, _), (start, _, _) in zip(export, export[1:]))
    names: dict[str, int] = {}
    for _, _, name in export:
        names[name[:60]] = names.get(name[:60], 0) + 1
    return dict(
        kernels=len(export),
        lead_in_us=export[0][0] - marker_end,
        busy_us=sum(end - start for start, end, _ in export),
        gaps_us=gaps,
        span_us=export[-1][1] - marker_end,
        kernel_names=names,
    )


def host_profile(make_stream, top: int = 14) -> list[str]:
    """cProfile of one pass over an export stream (host side; no synchronize): the ``top``
    functions by own time, in microseconds (profiling inflates the per-call costs)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in make_stream():
        pass
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, _, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [
        f"{own * 1e6:8.0f} us own {cumulative * 1e6:8.0f} us cum {calls:6d} calls  {Path(file).name}:{line}({function})"
        for (file, line, function), (_, calls, own, cumulative, _) in rows
    ]


def python_process_state() -> dict:
    """What in this process can slow every Python step down: a trace or profile hook, ``sys.monitoring``
    tools, a torch function mode, other threads (their GIL hand-offs), the collector's state and the heap's
    size in objects it tracks. Recorded beside the host figures, to tell a slow process from a slow exporter."""
    monitoring = getattr(sys, "monitoring", None)
    return dict(
        trace=repr(sys.gettrace()),
        profile=repr(sys.getprofile()),
        monitoring_tools=[monitoring.get_tool(i) for i in range(6)] if monitoring else None,
        torch_function_mode=torch._C._is_torch_function_mode_enabled(),
        threads=sorted(t.name for t in threading.enumerate()),
        switch_interval_s=sys.getswitchinterval(),
        gc_enabled=gc.isenabled(),
        gc_thresholds=list(gc.get_threshold()),
        gc_tracked_objects=len(gc.get_objects()),
        python=sys.version,
        python_cflags=sysconfig.get_config_var("PY_CFLAGS"),
    )


def set_fp8_launch(text: str) -> None:
    """Make the launch config described by ``text`` (``field=value`` pairs) the export's."""
    from mbridge_refit.fp8 import kernels as fp8_kernels

    values = {
        name: None if value.lower() == "none" else int(value)
        for name, value in (item.split("=", 1) for item in text.split(",") if item)
    }
    fp8_kernels.DEFAULT_CONFIG = fp8_kernels.LaunchConfig(**values)


def allocations() -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


def run(args) -> dict:
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model

    layout = layout_from_flags(args)
    device = torch.device("cuda")
    with (
        distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=10)) as env,
        tempfile.TemporaryDirectory(prefix="bench-export-") as work_dir,
    ):
        bridge, stock_bridge = bridges(args, Path(work_dir), env.rank)  # stock: the unmodified upstream class
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        steady = args.steady

        def stock():
            return stock_bridge.export_hf_weights(chunks, cpu=False, show_progress=False)

        def refit(cache):
            return lambda: bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=cache)

        plan_start = time.perf_counter()
        plan = bridge.export_plan(chunks)
        plan_ms = (time.perf_counter() - plan_start) * 1e3
        results = {}

        def refit_fp8():
            return bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise")

        def with_bucket(mib: int, make_stream=refit(True)):
            """The same cached export (default BF16) with another bucket size: 0 is one gather
            group per parameter; for the FP8 export at TP=1, the bucket is the layers per launch."""

            def export():
                default = bridge.bucket_bytes
                bridge.bucket_bytes = mib << 20
                try:
                    yield from make_stream()
                finally:
                    bridge.bucket_bytes = default

            return export

        def without_handshake():
            """The cached export without the collective-contract check (``runtime.handshake``: store round trips at world > 1)."""
            timeout = bridge.collective_timeout_s
            bridge.collective_timeout_s = None
            try:
                yield from refit(True)()
            finally:
                bridge.collective_timeout_s = timeout

        def after_registration():
            """The cached export after a parameter registration (``module.weight = module.weight``): the
            freshness check (``runtime.live_params``) then looks every parameter up again; without one
            it is one integer comparison."""
            module = next(m for m in chunks[0].modules() if isinstance(getattr(m, "weight", None), torch.nn.Parameter))
            module.weight = module.weight
            return refit(True)()

        variants = [
            ("stock", stock),
            ("refit", refit(False)),
            ("refit_cached", refit(True)),
            ("refit_cached_after_registration", after_registration),
        ]
        if env.world_size > 1:
            variants.append(("refit_cached_without_handshake", without_handshake))
        if args.tp > 1:
            variants.append(("refit_cached_per_parameter", with_bucket(0)))
            variants.extend((f"refit_cached_bucket{mib}", with_bucket(mib)) for mib in args.compare_bucket_mib)
        if args.fp8:
            variants.append(("refit_cached_fp8", refit_fp8))
            variants.extend(
                (f"refit_cached_fp8_bucket{mib}", with_bucket(mib, refit_fp8)) for mib in args.fp8_compare_bucket_mib
            )
        control_items = [param for chunk in chunks for param in chunk.parameters()]  # host_control_us's loop
        for label, make in variants:
            bridge.release_export_buffers()  # each variant starts cold and keeps only its own buffers
            first = timed_export(make)
            runs, control = [], []
            for _ in range(steady):
                runs.append(timed_export(make))
                control.append(host_control_us(control_items))
            results[label] = dict(
                first_ms=first[0],
                steady_ms=statistics.median(r[0] for r in runs),
                peak_extra_bytes=max(r[1] for r in [first, *runs]),
                tensors=first[2],
                new_allocations_after_first=sum(r[3] for r in runs),
                **host_figures([r[4] for r in runs], control, first[2]),
                buffer_bytes=bridge.export_diagnostics().buffer_bytes,
            )
        mismatches = compare_with_stock(stock(), refit(True)())
        host_floor = host_floor_rounds(refit(True), args.rounds)
        floor, floor_pieces = clone_floor_ms(plan.total_bytes)
        gather_floor = gather_floor_ms(plan.total_bytes)
        bridge.release_export_buffers()  # the rounds' first (warm-up) round allocates ours anew
        table = table_rounds(stock, refit(True), refit_fp8 if args.fp8 else None, plan.total_bytes, args.rounds)
        row = dict(
            device=torch.cuda.get_device_name(),
            world_size=env.world_size,
            model=args.model if args.layers is None else f"{args.model}-{args.layers}layers",
            layout=layout.name,
            from_checkpoint=args.from_checkpoint,
            tensors=len(plan.entries),
            bytes=plan.total_bytes,
            plan_build_ms=plan_ms,
            clone_floor_ms=floor,
            clone_floor_pieces=floor_pieces,
            gather_floor_ms=gather_floor,
            stock_first_ms=results["stock"]["first_ms"],
            stock_steady_ms=results["stock"]["steady_ms"],
            refit_steady_ms=results["refit"]["steady_ms"],
            refit_first_ms=results["refit"]["first_ms"],
            refit_cached_first_ms=results["refit_cached"]["first_ms"],
            refit_cached_steady_ms=results["refit_cached"]["steady_ms"],
            refit_cached_host_us_per_tensor=results["refit_cached"]["host_us_per_tensor"],
            refit_cached_host_us_per_tensor_range=results["refit_cached"]["host_us_per_tensor_range"],
            stock_host_us_per_tensor=results["stock"]["host_us_per_tensor"],
            refit_cached_host_control_us_per_item=results["refit_cached"]["host_control_us_per_item"],
            refit_cached_host_over_control=results["refit_cached"]["host_over_control"],
            stock_host_over_control=results["stock"]["host_over_control"],
            stock_host_control_us_per_item=results["stock"]["host_control_us_per_item"],
            stock_peak_extra_bytes=results["stock"]["peak_extra_bytes"],
            refit_peak_extra_bytes=results["refit"]["peak_extra_bytes"],
            refit_cached_peak_extra_bytes=results["refit_cached"]["peak_extra_bytes"],
            refit_cached_buffer_bytes=results["refit_cached"]["buffer_bytes"],
            refit_cached_per_parameter_steady_ms=results.get("refit_cached_per_parameter", {}).get("steady_ms"),
            refit_cached_without_handshake_steady_ms=results.get("refit_cached_without_handshake", {}).get("steady_ms"),
            refit_cached_after_registration_steady_ms=results["refit_cached_after_registration"]["steady_ms"],
            bucket_bytes=bridge.bucket_bytes,
            bucket_variants={
                label: {k: v for k, v in result.items() if k in ("steady_ms", "peak_extra_bytes", "buffer_bytes")}
                for label, result in results.items()
                if label.startswith("refit_cached_bucket")
            },
            cached_new_allocations_after_first=results["refit_cached"]["new_allocations_after_first"],
            stock_tensors=results["stock"]["tensors"],
            steady_runs=steady,
            interleaved=table,
            host_floor=host_floor,
            python_process=python_process_state(),
            mismatches_vs_stock=mismatches,
            torch=torch.__version__,
            date=datetime.date.today().isoformat(),
        )
        row["speedup_vs_stock_steady"] = row["stock_steady_ms"] / row["refit_cached_steady_ms"]
        row["freshness_lookup_ms"] = row["refit_cached_after_registration_steady_ms"] - row["refit_cached_steady_ms"]
        row["cached_steady_over_floor"] = row["refit_cached_steady_ms"] / floor
        row["first_over_steady"] = row["refit_cached_first_ms"] / row["refit_cached_steady_ms"]
        if args.fp8:
            fp8 = results["refit_cached_fp8"]
            row.update(
                fp8_tensors=fp8["tensors"],
                fp8_first_ms=fp8["first_ms"],
                fp8_steady_ms=fp8["steady_ms"],
                fp8_peak_extra_bytes=fp8["peak_extra_bytes"],
                fp8_new_allocations_after_first=fp8["new_allocations_after_first"],
                fp8_over_bf16_cached=fp8["steady_ms"] / row["refit_cached_steady_ms"],
                fp8_over_clone_floor=fp8["steady_ms"] / floor,
                fp8_interleaved=interleaved(refit(True), refit_fp8, args.steady),
                fp8_kernel_mismatches=check_fp8_export(refit_fp8(), refit(False)()),
                fp8_quantizer=quantizer_path(),
            )
            row["fp8_bucket_variants"] = {
                label: {
                    k: v
                    for k, v in result.items()
                    if k in ("steady_ms", "peak_extra_bytes", "buffer_bytes", "new_allocations_after_first")
                }
                for label, result in results.items()
                if label.startswith("refit_cached_fp8_bucket")
            }
            for mib in args.fp8_compare_bucket_mib:
                bridge.release_export_buffers()
                row["fp8_bucket_variants"][f"refit_cached_fp8_bucket{mib}"]["interleaved"] = interleaved(
                    refit(True), with_bucket(mib, refit_fp8), args.steady
                )
            if env.world_size == 1:
                bridge.release_export_buffers()
                timed_export(refit(True)), timed_export(refit_fp8)  # buffers and launch tables in place
                row["device_timeline"] = {
                    "bf16_cached": device_timeline(refit(True)),
                    "fp8_cached": device_timeline(refit_fp8),
                }
                for mib in args.fp8_compare_bucket_mib:
                    timed_export(with_bucket(mib, refit_fp8))
                    row["device_timeline"][f"fp8_cached_bucket{mib}"] = device_timeline(with_bucket(mib, refit_fp8))
                row["fp8_breakdown"] = fp8_breakdown(bridge, chunks)
                row["host_profile"] = {"bf16_cached": host_profile(refit(True)), "fp8_cached": host_profile(refit_fp8)}
        elif env.world_size == 1:  # where a BF16 export's host time goes (the FP8 run records both)
            bridge.release_export_buffers()
            timed_export(refit(True))
            row["device_timeline"] = {"bf16_cached": device_timeline(refit(True))}
            row["host_profile"] = {"bf16_cached": host_profile(refit(True))}
        return row if env.rank == 0 else {}


def _ratio(value: float | None) -> str:
    """A host ratio as printed (``host_figures`` gives None where the control read 0)."""
    return "n/a" if value is None else f"{value:.2f}"


def print_table(row: dict) -> None:
    gb, floor = 1e9, row["host_floor"]["median"]
    lines = [
        f"device {row['device']} x{row['world_size']}  model {row['model']}  layout {row['layout']}  "
        f"{row['tensors']} tensors, {row['bytes'] / gb:.2f} GB",
        f"{'':28s}{'first ms':>10s}{'steady ms':>11s}{'peak extra GB':>15s}",
        f"{'stock AutoBridge':28s}{row['stock_first_ms']:10.1f}{row['stock_steady_ms']:11.2f}{row['stock_peak_extra_bytes'] / gb:15.3f}",
        f"{'RefitBridge, cache off':28s}{row['refit_first_ms']:10.1f}{row['refit_steady_ms']:11.2f}{row['refit_peak_extra_bytes'] / gb:15.3f}",
        f"{'RefitBridge, cache on':28s}{row['refit_cached_first_ms']:10.1f}{row['refit_cached_steady_ms']:11.2f}{row['refit_cached_peak_extra_bytes'] / gb:15.3f}",
        *(
            [f"{'  same, per-parameter groups':28s}{'':10s}{row['refit_cached_per_parameter_steady_ms']:11.2f}"]
            if row["refit_cached_per_parameter_steady_ms"] is not None
            else []
        ),
        f"{'  same, after a registration':28s}{'':10s}{row['refit_cached_after_registration_steady_ms']:11.2f}",
        f"{'clone floor (same bytes)':28s}{'':10s}{row['clone_floor_ms']:11.2f}",
        f"{'all-gather floor (same out)':28s}{'':10s}{row['gather_floor_ms']:11.2f}",
        f"speedup vs stock (steady): {row['speedup_vs_stock_steady']:.1f}x   cached/floor: {row['cached_steady_over_floor']:.2f}x   "
        f"first/steady: {row['first_over_steady']:.2f}x   new allocations after first cached call: {row['cached_new_allocations_after_first']}",
        f"bitwise vs stock: {row['tensors'] - len(row['mismatches_vs_stock'])}/{row['tensors']} tensors equal",
        f"host CPU per yielded tensor, cached steady: {row['refit_cached_host_us_per_tensor']:.2f} us "
        f"(range {row['refit_cached_host_us_per_tensor_range'][0]:.2f}-{row['refit_cached_host_us_per_tensor_range'][1]:.2f}); "
        f"stock {row['stock_host_us_per_tensor']:.2f} us; a control loop {row['refit_cached_host_control_us_per_item']:.3f} us "
        f"per item beside them: cached / control {_ratio(row['refit_cached_host_over_control'])}, stock / control "
        f"{_ratio(row['stock_host_over_control'])}",
        f"host CPU per tensor in alternating rounds: cached {floor['ours_us_per_tensor']:.2f} us, the yield floor "
        f"(the same pairs yielded from a list) {floor['yield_floor_us_per_tensor']:.2f} us, cached / floor "
        f"{_ratio(floor['ours_over_yield_floor'])}",
        *(
            [
                f"{'RefitBridge, cache on, FP8':28s}{row['fp8_first_ms']:10.1f}{row['fp8_steady_ms']:11.2f}{row['fp8_peak_extra_bytes'] / gb:15.3f}",
                f"FP8/BF16 cached steady (medians of separate phases): {row['fp8_over_bf16_cached']:.2f}x   FP8/clone floor: {row['fp8_over_clone_floor']:.2f}x   new allocations after first FP8 call: "
                f"{row['fp8_new_allocations_after_first']}   quantizer: {row['fp8_quantizer']}   mismatches vs torch path: "
                f"{len(row['fp8_kernel_mismatches'])}",
                "interleaved ({pairs} pairs): BF16 cached {bf16_ms:.2f} ms, FP8 {fp8_ms:.2f} ms, FP8/BF16 per pair (median) "
                "{fp8_over_bf16:.2f}x; minima {fp8_min_ms:.2f} / {bf16_min_ms:.2f} ms = {fp8_over_bf16_min:.2f}x".format(
                    **row["fp8_interleaved"]
                ),
            ]
            if "fp8_steady_ms" in row
            else []
        ),
        *(
            [
                f"FP8, cached, {label.removeprefix('refit_cached_fp8_')}: steady {v['steady_ms']:.2f} ms, interleaved FP8/BF16 "
                f"{v['interleaved']['fp8_over_bf16']:.2f}x ({v['interleaved']['fp8_ms']:.2f} / {v['interleaved']['bf16_ms']:.2f} ms; "
                f"minima {v['interleaved']['fp8_over_bf16_min']:.2f}x), "
                f"peak extra {v['peak_extra_bytes'] / gb:.3f} GB, new allocations after first {v['new_allocations_after_first']}"
                for label, v in row.get("fp8_bucket_variants", {}).items()
            ]
        ),
        *(
            [
                f"device timeline, {label}: lead-in {t['lead_in_us']:.0f} us, kernels {t['busy_us']:.0f} us in {t['kernels']}, "
                f"gaps {t['gaps_us']:.0f} us, span {t['span_us']:.0f} us"
                for label, t in row.get("device_timeline", {}).items()
                if t.get("kernels")
            ]
        ),
        *(
            [
                "FP8 breakdown (ms, host / device): export {fp8_export_host_ms:.2f} / {fp8_export_device_ms:.2f}; "
                "quantize one launch per job ({quantize_launches_per_weight}) {quantize_per_weight_host_ms:.2f} / "
                "{quantize_per_weight_device_ms:.2f}; as exported ({quantize_launches_grouped} launches) "
                "{quantize_grouped_host_ms:.2f} / {quantize_grouped_device_ms:.2f} = {quantize_grouped_gb_s:.0f} GB/s".format(
                    **row["fp8_breakdown"]
                )
            ]
            if "fp8_breakdown" in row
            else []
        ),
    ]
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a shape in recipes/shapes/ (default: %(default)s)")
    parser.add_argument(
        "--layers", type=int, default=None, help="keep only this many layers of the shape (default: all)"
    )
    add_layout_flags(parser)
    parser.add_argument(
        "--from-checkpoint",
        action="store_true",
        help="build both bridges from a checkpoint shell of the shape (names and shapes in the published layout) instead of its "
        "config: what a bridge whose mappings depend on the checkpoint (packed experts) exports",
    )
    parser.add_argument("--steady", type=int, default=5, help="steady-state calls to take the median of")
    parser.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="recorded rounds of stock, ours (and FP8 with --fp8) and the floor in turn, after one warm-up round "
        "(the README's table; default: %(default)s)",
    )
    parser.add_argument(
        "--compare-bucket-mib",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[],
        help="TP>1: also time the cached export with these gather bucket sizes, e.g. 128,1024",
    )
    parser.add_argument("--fp8", action="store_true", help="also time the BF16 -> blockwise FP8 cached export")
    parser.add_argument(
        "--fp8-compare-bucket-mib",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[],
        help="with --fp8: also time the cached FP8 export with these bucket sizes, e.g. 1024 (two Qwen3-8B layers per launch)",
    )
    parser.add_argument(
        "--fp8-launch",
        default="",
        metavar="FIELD=VALUE,...",
        help="launch config of the FP8 kernel (fp8_kernels.LaunchConfig fields, e.g. chunk_blocks=256,num_warps=8; "
        "default: fp8_kernels.DEFAULT_CONFIG)",
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.fp8_launch:
        set_fp8_launch(args.fp8_launch)
    logging.basicConfig(level=logging.WARNING)
    row = run(args)
    if row:
        print_table(row)
        variant = "_" + args.fp8_launch.replace("=", "").replace(",", "_") if args.fp8_launch else ""
        name = f"export_{row['model']}_{row['layout']}{'_fp8' if args.fp8 else ''}{'_from_checkpoint' if args.from_checkpoint else ''}{variant}.json"
        path = write_result(args.out_dir or results_dir(), name, row)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
