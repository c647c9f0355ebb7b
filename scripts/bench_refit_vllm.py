"""Benchmark: a colocated refit into vLLM, ours against vLLM's native IPC backend fed by the stock export.

    python3 scripts/bench_refit_vllm.py --model qwen3-8b --steps 5 [--fp8] --out-dir DIR

One trainer process (a Megatron model of the shape, random weights, TP1) and one vLLM engine
(its own process, same GPU, started with dummy weights from the shape's config; with ``--fp8``
from the FP8-blockwise config ``convert --fp8-blockwise`` writes). Side by side in one run (our
steady steps first, then the baseline's: its layerwise reload may reallocate engine parameters,
after which our next apply records the loader again):

* ``ours_ms``: ``VLLMRefit.refit`` (the export of what is not live, one RPC, the engine replays
  its recorded copies from the trainer's memory, the prefix-cache reset while they run); export
  and apply are also reported apart, the apply split into the engine worker's own time
  (``ours_engine_ms``: launching the copies) and the rest, vLLM's RPC (``ours_rpc_overhead_ms``),
  then the reset with the wait for the copies (``ours_reset_wait_ms``). The apply RPC leaves before
  the export and its worker waits for the trainer's go-ahead (``early_apply``: steps and how many went
  early); from the go-ahead on are the apply and the engine's time, and the export's time runs up to
  it. ``ours_late_ms``: the same session with ``early_apply=False`` (the RPC sent after the export),
  ``ours_serial_ms``: with ``overlap_follow_up=False`` (the worker waits for its copies, then the
  reset), ``ours_gc_on_ms``: with ``defer_gc=False`` (the garbage collector left on through the export
  and the apply), ``ours_check_first_ms``: with ``check_after_word=False`` (the live parameters' addresses read
  before the go-ahead, not while the worker copies), each variant's steps alternated with ``ours_ms``'s; ``variant_parts_ms``: each variant's export,
  apply and reset-and-wait, and for early applies the go-ahead's way from the trainer's sending to the
  worker's reading it (``wake``, one host's monotonic clock; asked for after the step). ``live_tensors``: tensors the engine reads straight from the
  trainer's parameters (never exported after the first step).
* ``vllm_native_stock_ms`` (BF16 only): ``AutoBridge.export_hf_weights`` (stock) into vLLM's
  native ``ipc`` weight-transfer backend: ``start_weight_update``, ``trainer_send_weights``
  (one handle per tensor, not packed), ``finish_weight_update``.
* ``floor_ms``: one device copy of the same number of bytes (memcpy kernels, no per-tensor cost;
  over a buffer of at most 4 GiB, copied as often as moves that many bytes), the least any refit that
  lands the bytes in the engine's parameters once must spend.
* ``vllm_load_weights_ms``: the engine's own ``load_weights`` on the same tensors, already on
  its GPU (timed inside the engine); ``engine_replay_ms``: our recorded copies, timed the same way.
  ``engine_check_host_ms`` and ``engine_launch_host_ms``: the worker's host time in an apply before
  its copies run (the look for replaced parameters; the replay's calls returning, not waited for).
* ``trainer_alone``: the trainer's side of a steady refit into an engine stand-in whose workers only
  answer (``profile_ipc_trainer.py``'s), wall and this thread's CPU time per step, taken before the
  engine starts and again beside it (idle), to tell what the engine's presence costs the trainer's
  export from what its steps do; ``gc_during_steps``: the garbage collections (count and time per
  generation) during each variant's steady steps, wherever in the step they ran; ``ours_export_thread_cpu_ms``: the trainer thread's CPU time
  in our steps' export up to its device wait (``RefitStep.export_cpu_ms``; against ``ours_export_ms``, its
  wall time: work, or waiting for the CPU). ``trainer_alone`` runs the first export, so ``first_refit_ms``
  is the first refit after a warm export (not comparable with results before it);
  ``trainer_profile_top``: cProfile's top functions by own time over 5 more of our steps;
  ``live_pointer_reads_ms``: reading every live parameter's data pointer (the export's look for
  ``.data`` swaps) right after an RPC to the engine, as our steps do, and at once again (caches warm).
* ``new_allocations_after_first``: CUDA caching-allocator allocations during our steady steps,
  trainer and engine. ``engine_extra_bytes``: engine memory allocated by opening the refit.
  ``peak_extra_bytes``: the trainer's peak allocated memory beyond what it held before, during
  our first refit (the open), our steady steps (the largest), and the native baseline's steps
  (the stock export and vLLM's ipc backend; BF16 only).

Timings from CUDA events/synchronized wall clock on this host; medians and minima of the
steady steps. Writes DIR/bench_refit_vllm_<model>[_fp8].json with a manifest.
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import logging
import pstats
import time
from dataclasses import asdict

import torch

from mbridge_refit.testing.vllm_harness import (
    dummy_engine,
    engine_config,
    floor_ms,
    parser_with_engine_arguments,
    prefix_cache_reset,
    summary,
    timed,
    tp1_trainer,
)

logger = logging.getLogger("bench_refit_vllm")


def allocations() -> int:
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


class PeakExtra:
    """The trainer's largest peak of allocated memory beyond what it held when each measured call began."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, fn):
        """``fn``, with its peak over the memory held before it taken into ``bytes``."""
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            return fn()
        finally:
            self.bytes = max(self.bytes, torch.cuda.max_memory_allocated() - held)


def trainer_alone(bridge, chunks, fp8, engine_quantizes: bool, steps: int = 10) -> dict:
    """The trainer's side of a steady refit with no engine behind it: wall and thread CPU ms per step."""
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.ipc.trainer import IpcSession
    from mbridge_refit.testing.silent_engine import answering_workers

    session = IpcSession(answering_workers, transport=LocalTransport(), engine_quantizes=engine_quantizes)
    walls, cpus = [], []
    try:
        for step in range(3 + steps):
            wall, cpu = time.perf_counter(), time.thread_time()
            session.refit(bridge, chunks, fp8=fp8)
            if step >= 3:
                walls.append((time.perf_counter() - wall) * 1e3)
                cpus.append((time.thread_time() - cpu) * 1e3)
    finally:
        session.close()
    return {"wall_ms": summary(walls), "thread_cpu_ms": summary(cpus)}


class GcWatch:
    """Garbage collections while ``active`` names a variant: count and ms per variant and generation
    (``gc.callbacks``)."""

    def __init__(self, variants: list[str]) -> None:
        self.count = {variant: {} for variant in variants}
        self.ms = {variant: {} for variant in variants}
        self._began, self.active = 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if self.active is None:
            return
        if phase == "start":
            self._began = time.perf_counter()
            return
        generation, count, ms = str(info["generation"]), self.count[self.active], self.ms[self.active]
        count[generation] = count.get(generation, 0) + 1
        ms[generation] = round(ms.get(generation, 0.0) + (time.perf_counter() - self._began) * 1e3, 3)

    def report(self) -> dict:
        gc.callbacks.remove(self._callback)
        return {variant: {"count": self.count[variant], "ms": self.ms[variant]} for variant in self.count}  # {}: none


def profile_top(fn, steps: int = 5, top: int = 15) -> list[str]:
    """cProfile's ``top`` functions by own time over ``steps`` calls of ``fn``, as text lines."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return [line for line in text.getvalue().splitlines() if line.strip()][-top - 1 :]


def live_pointer_reads(llm, parameters: tuple, rounds: int = 5) -> dict:
    """The export's look for ``.data`` swaps timed after an engine RPC (as in our steps) and right again."""
    from mbridge_refit.engines.ipc.trainer import live_pointers

    after_rpc, again = [], []
    for _ in range(rounds):
        llm.collective_rpc("mbridge_refit_memory")
        torch.cuda.synchronize()
        for times in (after_rpc, again):
            started = time.perf_counter()
            live_pointers(parameters)
            times.append((time.perf_counter() - started) * 1e3)
    return {"parameters": len(parameters), "after_rpc": summary(after_rpc), "again": summary(again)}


def run(args) -> dict:

    from mbridge_refit.engines.vllm import VLLMRefit
    from mbridge_refit.fp8.format import BlockwiseFP8Config
    from mbridge_refit.models.recipes import full_size_config

    config = full_size_config(args.model)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    fp8 = BlockwiseFP8Config() if args.fp8 else None
    device = torch.device("cuda")
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "model": args.model if args.layers is None else f"{args.model}-{args.layers}layers",
        "format": "fp8-blockwise" if fp8 else "bf16",
        "torch": torch.__version__,
    }
    with tp1_trainer(config, args.work, device) as (bridge, chunks, work):
        import vllm

        result["vllm"] = vllm.__version__
        quantization = bridge.fp8_config(fp8).quantization_config(bridge.export_plan(chunks, fp8=fp8)) if fp8 else None
        directory = engine_config(config, work / "engine", quantization)
        alone = {"before_engine": trainer_alone(bridge, chunks, fp8, not args.trainer_quantizes)}
        llm = dummy_engine(directory, args, transfer_backend=None if fp8 else "ipc")
        alone["beside_engine"] = trainer_alone(bridge, chunks, fp8, not args.trainer_quantizes)
        result["trainer_alone"] = alone
        refit = VLLMRefit(llm, timeout_s=300, engine_quantizes=not args.trainer_quantizes)
        result["engine_quantizes"] = bool(fp8) and not args.trainer_quantizes

        before_open = llm.collective_rpc("mbridge_refit_memory")[0]
        peaks = {"ours_first": PeakExtra(), "ours_steady": PeakExtra(), "stock_native": PeakExtra()}
        first = peaks["ours_first"](lambda: refit.refit(bridge, chunks, fp8=fp8))
        after_open = llm.collective_rpc("mbridge_refit_memory")[0]
        result["bytes"], result["tensors"] = first.bytes, first.tensors
        result["first_refit_ms"] = round(first.export_ms + first.apply_ms, 1)
        result["engine_extra_bytes"] = after_open["allocated_bytes"] - before_open["allocated_bytes"]
        result["engine_reserved_extra_bytes"] = after_open["reserved_bytes"] - before_open["reserved_bytes"]
        result["open_report"] = {k: (v if not isinstance(v, list) else v[:5]) for k, v in (first.report or {}).items()}
        result["live_tensors"] = len(bridge.live_rows(chunks, fp8=fp8))
        result["floor_ms"] = round(floor_ms(first.bytes), 3)
        result["prefix_cache_reset"] = prefix_cache_reset(llm, args)

        stock = None
        if not fp8:
            from megatron.bridge import AutoBridge
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerSendWeightsArgs,
                IPCWeightTransferEngine,
            )

            stock_bridge = AutoBridge.from_hf_config(config)
            llm.init_weight_transfer_engine({"init_info": {}})

            def stock():
                llm.start_weight_update()
                IPCWeightTransferEngine.trainer_send_weights(
                    stock_bridge.export_hf_weights(chunks, cpu=False, show_progress=False),
                    IPCTrainerSendWeightsArgs(send_mode=lambda info: llm.update_weights({"update_info": asdict(info)})),
                )
                llm.finish_weight_update()

            try:
                result["vllm_native_stock_first_ms"] = round(timed(stock), 1)
            except Exception as err:  # the baseline's failure is a result, not the end of the run
                logger.exception("vLLM's native ipc backend failed")
                result["vllm_native_stock_error"] = f"{type(err).__name__}: {err}"[:2000]
                stock = None

        engine, stock_times = [], []
        trainer_new, engine_new = 0, 0
        collections, export_cpu, early = GcWatch([variant for variant, *_ in VARIANTS]), [], []
        times = {variant: [] for variant, *_ in VARIANTS}
        parts = {variant: {"export": [], "apply": [], "reset_wait": [], "wake": []} for variant in times}
        for _ in range(args.steps):
            # alternated: ours; its apply RPC sent after the export; the reset after the copies
            for variant, early_apply, overlap, defer_gc, check_after_word in VARIANTS:
                refit.early_apply, refit.overlap_follow_up, refit.defer_gc = early_apply, overlap, defer_gc
                refit.check_after_word = check_after_word
                trainer_before = allocations()
                engine_before = llm.collective_rpc("mbridge_refit_memory")[0]["allocations"]
                step = None

                def ours_step():
                    nonlocal step
                    step = refit.refit(bridge, chunks, fp8=fp8)

                collections.active = variant
                times[variant].append(peaks["ours_steady"](lambda: timed(ours_step)))
                collections.active = None
                trainer_new += allocations() - trainer_before
                engine_new += llm.collective_rpc("mbridge_refit_memory")[0]["allocations"] - engine_before
                if step.opened:
                    raise RuntimeError("a steady refit reopened its layout: the export's storages changed")
                for part, value in (
                    ("export", step.export_ms),
                    ("apply", step.apply_ms),
                    ("reset_wait", step.reset_ms),
                ):
                    parts[variant][part].append(value)
                if step.early:
                    parts[variant]["wake"].append(llm.collective_rpc("mbridge_refit_last_go_ahead")[0]["wake_ms"])
                if variant == "ours":
                    early.append(step.early)
                    export_cpu.append(step.export_cpu_ms)
                    engine.append(step.engine_ms)
        refit.early_apply, refit.overlap_follow_up, refit.defer_gc, refit.check_after_word = True, True, True, True
        result["variant_parts_ms"] = {
            variant: {part: summary(values) for part, values in split.items() if values}
            for variant, split in parts.items()
        }
        result["early_apply"] = {
            "steps": len(early),
            "early": sum(early),
            "line": bool((first.report or {}).get("go_ahead")),
        }
        result["gc_during_steps"] = collections.report()
        result["ours_export_thread_cpu_ms"] = summary(export_cpu)
        result["trainer_profile_top"] = profile_top(lambda: refit.refit(bridge, chunks, fp8=fp8))
        result["live_pointer_reads_ms"] = live_pointer_reads(llm, refit.live_parameters)
        # the native backend's layerwise reload may reallocate engine parameters, which makes our next
        # apply record the loader again: its steps run after ours, not interleaved
        for _ in range(args.steps if stock is not None else 0):
            stock_times.append(peaks["stock_native"](lambda: timed(stock)))
        apply = parts["ours"]["apply"]
        result["ours_ms"] = summary(times["ours"])
        result["ours_export_ms"] = summary(parts["ours"]["export"])
        result["ours_apply_rpc_ms"] = summary(apply)
        result["ours_engine_ms"] = summary(engine)
        result["ours_rpc_overhead_ms"] = summary([a - e for a, e in zip(apply, engine)])
        result["ours_reset_wait_ms"] = summary(parts["ours"]["reset_wait"])
        result["ours_late_ms"] = summary(times["late"])
        result["ours_serial_ms"] = summary(times["serial"])
        result["ours_gc_on_ms"] = summary(times["gc_on"])
        result["ours_check_first_ms"] = summary(times["check_first"])
        result["vllm_native_stock_ms"] = summary(stock_times) if stock_times else None
        if fp8:
            result["ours_fp8_ms"] = result["ours_ms"]
        result["new_allocations_after_first"] = {"trainer": trainer_new, "engine": engine_new}
        result["peak_extra_bytes"] = {
            side: peak.bytes for side, peak in peaks.items() if side != "stock_native" or stock_times
        }
        refit.refit(bridge, chunks, fp8=fp8)  # the stock update may have reloaded parameters: reopen/replay first
        result["engine_replay_ms"] = summary(llm.collective_rpc("mbridge_refit_time", args=("replay", 3))[0])
        result["engine_check_host_ms"] = summary(llm.collective_rpc("mbridge_refit_time", args=("check", 5))[0])
        result["engine_launch_host_ms"] = summary(llm.collective_rpc("mbridge_refit_time", args=("launch", 5))[0])
        result["vllm_load_weights_ms"] = summary(llm.collective_rpc("mbridge_refit_time", args=("load_weights", 3))[0])
        ours_median = result["ours_ms"]["median"]
        result["ratios"] = {
            "ours_over_floor": round(ours_median / result["floor_ms"], 2),
            "ours_late_over_floor": round(result["ours_late_ms"]["median"] / result["floor_ms"], 2),
            "ours_serial_over_floor": round(result["ours_serial_ms"]["median"] / result["floor_ms"], 2),
            "ours_gc_on_over_floor": round(result["ours_gc_on_ms"]["median"] / result["floor_ms"], 2),
            "ours_check_first_over_floor": round(result["ours_check_first_ms"]["median"] / result["floor_ms"], 2),
            "stock_native_over_ours": round(result["vllm_native_stock_ms"]["median"] / ours_median, 2)
            if stock_times
            else None,
            "load_weights_over_floor": round(result["vllm_load_weights_ms"]["median"] / result["floor_ms"], 2),
        }
        refit.close()
    return result


# (name, early apply, the follow-up while the copies run, the collector held off until the apply)
VARIANTS = (  # name, early_apply, overlap_follow_up, defer_gc, check_after_word
    ("ours", True, True, True, True),
    ("late", False, True, True, True),
    ("serial", True, False, True, True),
    ("gc_on", True, True, False, True),
    ("check_first", True, True, True, False),
)


def main() -> None:
    parser = parser_with_engine_arguments(__doc__, model="qwen3-8b", results=True)
    parser.add_argument("--steps", type=int, default=5, help="steady-state steps per side (default 5)")
    parser.add_argument(
        "--trainer-quantizes",
        action="store_true",
        help="with --fp8: the trainer quantizes every weight into its export buffers and the engine copies them "
        "(VLLMRefit(engine_quantizes=False)); by default the engine quantizes the trainer's live rows itself",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from provenance import results_dir, write_result

    result = run(args)
    name = f"bench_refit_vllm_{result['model']}{'_fp8' if args.fp8 else ''}{'_trainerq' if args.trainer_quantizes else ''}.json"
    path = write_result(args.out_dir or results_dir(), name, result)
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "device",
                    "model",
                    "format",
                    "bytes",
                    "ours_ms",
                    "ours_export_ms",
                    "ours_engine_ms",
                    "ours_rpc_overhead_ms",
                    "ours_reset_wait_ms",
                    "ours_late_ms",
                    "ours_serial_ms",
                    "ours_gc_on_ms",
                    "ours_check_first_ms",
                    "floor_ms",
                    "vllm_native_stock_ms",
                    "vllm_load_weights_ms",
                    "engine_replay_ms",
                    "engine_check_host_ms",
                    "engine_launch_host_ms",
                    "trainer_alone",
                    "gc_during_steps",
                    "ours_export_thread_cpu_ms",
                    "live_pointer_reads_ms",
                    "new_allocations_after_first",
                    "engine_extra_bytes",
                    "peak_extra_bytes",
                    "ratios",
                )
            },
            indent=1,
        )
    )
    print("wrote", path)


if __name__ == "__main__":
    main()
