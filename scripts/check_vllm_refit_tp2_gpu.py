"""GPU host, 2 GPUs: a sharded colocated refit into vLLM at tensor_parallel_size=2 equals loading
the same weights from disk, and its speed against vLLM's own load_weights fed by the gathering export.

    torchrun --nproc-per-node 2 scripts/check_vllm_refit_tp2_gpu.py --model qwen3-1.7b [--fp8] --out-dir DIR

The trainer is a Megatron model of a full-size shape (random weights) at TP2, rank r on GPU r. Trainer
rank 0 starts the engine (``LLM(tensor_parallel_size=2)``, vLLM's multi-process executor): its worker r
runs on GPU r, beside trainer rank r, so engine rank r's shards are trainer rank r's (the transfer
plan's default placement; ``CudaIpcTransport`` refuses a worker on another GPU by name). Steps, each
checked on rank 0 and shared:

1. The trainer writes the HF checkpoint (``convert.writing``; with ``--fp8`` the blockwise FP8 one that
   ``convert --fp8-blockwise`` writes, with its ``quantization_config``); the engine starts from it (vLLM's
   own loader: with ``--fp8`` a block-FP8 engine) and every worker's parameter fingerprints and the prompt
   logprobs of a fixed batch are read: the oracle. Every engine parameter is then overwritten with noise
   (the fingerprints must change).
2. ``VLLMShardedRefit`` (``engines.ipc.sharded``; with ``--fp8``, ``fp8=BlockwiseFP8Config()``): the
   sharded transfer fills each trainer rank's shard buffers (with FP8, each rank then quantizes its
   shards of the quantized weights into kept FP8 and scale buffers), each worker maps those of the
   trainer rank on its GPU, records vLLM's ``load_weights`` (FP8: through vLLM's layerwise reload)
   against full-size tensors around them, moves the reads into the shards and proves it against the
   loader. Every worker's fingerprints and the prompt logprobs must equal the oracle's, bit for bit.
3. A second refit replays without reopening, exact. One trainer weight element changed on every rank
   (layer 0's attention ``linear_proj``, row-parallel: each rank's own columns; dense and MoE alike)
   shows in exactly ``model.layers.0.self_attn.o_proj.weight`` on both workers (with FP8 in that module's
   weight and, as the element's block scale changes, its ``weight_scale_inv``); put back, the next refit
   is exact again.
4. Timing, same GPUs, same engine: steady sharded refits (transfer [+ quantization] + replay,
   ``ours_ms``) against one device copy of a worker's bytes (``floor_ms``) and, in BF16, the baseline
   (``vllm_load_weights_gather_ms``), each trainer rank's gathering export (``export_hf_weights``, full
   tensors) shared with the worker on its GPU and loaded by vLLM's own ``load_weights``
   (``testing.vllm_worker``); the baseline's engine must equal the oracle too. With ``--fp8`` the
   baseline is not run: vLLM's block-FP8 layers refuse a plain ``load_weights`` once processed.

A layout off the FP8 block grid is refused by name before any transfer; that is proven on CPU
(``tests/test_sharded_engine_refit.py``), not here: every shape this check runs is on the grid at TP2.

Rank 0 writes DIR/vllm_refit_tp2_<model>[_fp8].json with DIR/manifest.json before any rank exits (each
check is also logged as it is decided); exits 1 on every rank when a check fails.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import write_result

from mbridge_refit.testing.vllm_harness import (
    KV_BLOCKS,
    floor_ms,
    model_config,
    parser_with_engine_arguments,
    prompts,
    write_checkpoint,
)
from mbridge_refit.testing.vllm_harness import start_engine as start_checked_engine

logger = logging.getLogger("check_vllm_refit_tp2")
TORCHRUN_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


@contextlib.contextmanager
def without_torchrun_environment():
    """vLLM's workers are started from trainer rank 0: they must not read its torchrun rank, nor
    ``TORCHELASTIC_USE_AGENT_STORE``: with it set, torch's ``tcp://`` rendezvous makes every worker a
    client of a store that nobody hosts, and vLLM's workers wait for it forever (seen on 2x H200)."""
    names = [n for n in os.environ if n in TORCHRUN_VARIABLES or n.startswith("TORCHELASTIC_")]
    saved = {name: os.environ.pop(name) for name in names}
    try:
        yield
    finally:
        os.environ.update(saved)


class Checks(dict):
    """The run's checks, each logged as it is decided: a run cut short still shows how far it got."""

    def __setitem__(self, name: str, passed: bool) -> None:
        logger.info("check %s: %s", name, "passed" if passed else "FAILED")
        super().__setitem__(name, bool(passed))


def start_engine(checkpoint: Path, args):
    """vLLM at ``tensor_parallel_size=2`` from ``checkpoint`` (``check_vllm_refit_gpu.start_engine``)."""
    with without_torchrun_environment():
        # a bounded KV cache: every refit resets the prefix cache, which visits every block (the timing)
        return start_checked_engine(checkpoint, args, tensor_parallel_size=2, num_gpu_blocks_override=KV_BLOCKS)


def fingerprints(llm) -> list[dict]:
    """Every worker's exact parameter fingerprints, in worker order."""
    from mbridge_refit.engines.replay.fingerprint import fingerprints_from_wire

    return [fingerprints_from_wire(worker) for worker in llm.collective_rpc("mbridge_refit_fingerprints")]


def differing_per_worker(expected: list[dict], actual: list[dict]) -> list[list[str]]:
    from mbridge_refit.engines.replay.fingerprint import differing

    return [differing(e, a) for e, a in zip(expected, actual)]


def shared_checkpoint_dir(work: str) -> Path:
    """One folder for both ranks (rank 0's, broadcast)."""
    folder = [tempfile.mkdtemp(dir=work) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return Path(folder[0]) / "hf"


def attention_output_weight(chunks) -> torch.nn.Parameter:
    """Layer 0's attention output projection (row-parallel: this rank's columns of ``o_proj``)."""
    return next(
        p for c in chunks for n, p in c.named_parameters() if n.endswith("layers.0.self_attention.linear_proj.weight")
    )


def gathering_baseline(llm, bridge, chunks, steps: int) -> list[dict]:
    """Each step: every rank's gathering export (held, full tensors), shared once with the worker on
    its GPU, loaded there by vLLM's own ``load_weights``; milliseconds of the whole step and of the load."""
    from mbridge_refit.engines.ipc.sharing import CudaIpcTransport, LayoutRecorder
    from mbridge_refit.engines.vllm import ignored_by_engine

    transport, ignored, shared, out = CudaIpcTransport(), ignored_by_engine(bridge), None, []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        recorder = LayoutRecorder()
        for name, tensor in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, hold_outputs=True):
            if name not in ignored:
                recorder.add(name, tensor)
        torch.cuda.synchronize()
        if shared is None or shared[0] != recorder.key:
            layout, storages = recorder.layout()
            entries = [None] * dist.get_world_size()
            dist.all_gather_object(entries, (layout.to_wire(), transport.share(storages)))
            shared = (recorder.key, [e[0] for e in entries], [e[1] for e in entries], storages)
        dist.barrier()
        load_ms = (
            llm.collective_rpc("mbridge_refit_load_shared", args=(shared[1], shared[2], transport.name))
            if llm is not None
            else []
        )
        dist.barrier()
        out.append({"ms": round((time.perf_counter() - started) * 1e3, 2), "load_ms": [round(t, 2) for t in load_ms]})
    return out


def caught_in_o_proj(names: list[str], fp8) -> bool:
    """A worker's changed parameters after the perturbation: layer 0's ``o_proj`` weight alone (BF16), or
    that module's parameters, its weight among them (FP8: the changed element is its block's new
    maximum, so the block scale changes too, under whatever name vLLM keeps it)."""
    prefix = "model.layers.0.self_attn.o_proj."
    if fp8 is None:
        return names == [prefix + "weight"]
    return prefix + "weight" in names and all(n.startswith(prefix) for n in names)


def result_name(result: dict) -> str:
    return f"vllm_refit_tp2_{result['model']}{'_fp8' if result['fp8'] else ''}.json"


def run(args) -> dict:
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.vllm import VLLMShardedRefit, prompt_logprobs
    from mbridge_refit.fp8.format import BlockwiseFP8Config
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout

    config = model_config(args)
    fp8 = BlockwiseFP8Config() if args.fp8 else None
    device = torch.device("cuda")
    layout = ParallelLayout(tp=2, pp=1, ep=1)
    result: dict = {
        "model": args.model if args.layers is None else f"{args.model}-{args.layers}layers",
        "fp8": args.fp8,
        "checks": Checks(),
    }
    checks = result["checks"]
    with (
        contextlib.ExitStack() as cleanup,
        distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=10)),
    ):
        rank = dist.get_rank()
        result["device"] = torch.cuda.get_device_name()
        bridge = RefitBridge.from_hf_config(config)
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        checkpoint = shared_checkpoint_dir(args.work)
        if rank == 0:
            cleanup.callback(shutil.rmtree, checkpoint.parent, True)  # after the session
        write_checkpoint(bridge, chunks, config, checkpoint, fp8)
        dist.barrier()
        started = time.perf_counter()
        llm = start_engine(checkpoint, args) if rank == 0 else None
        dist.barrier()  # rank 1 waits here while rank 0 starts the engine
        result["engine_start_s"] = round(time.perf_counter() - started, 1)
        batch = prompts(config.vocab_size)
        disk = fingerprints(llm) if llm is not None else None
        disk_logprobs = prompt_logprobs(llm, batch) if llm is not None else None
        if llm is not None:
            repeatable = prompt_logprobs(llm, batch) == disk_logprobs
            result["engine_logprobs_repeatable_on_disk_weights"] = repeatable
            llm.collective_rpc("mbridge_refit_scramble", args=(7,))
            checks["scramble_changed_every_parameter"] = all(
                len(d) == len(w) for d, w in zip(differing_per_worker(disk, fingerprints(llm)), disk)
            )

        refit = VLLMShardedRefit(llm, engine="tp2", timeout_s=300)
        step = refit.refit(bridge, chunks, fp8=fp8)
        result["plan"] = refit.plan.summary()
        if llm is not None:
            result["open"] = [
                {k: r.get(k) for k in ("tensors", "shards", "copies", "via_loader", "open_ms")} for r in step.workers
            ]
            checks["open_reports_no_missing_or_unexpected"] = not any(
                r["missing"] or r["unexpected"] for r in step.workers
            )
            wrong = differing_per_worker(disk, fingerprints(llm))
            result["different_after_refit"] = [w[:10] for w in wrong]
            checks["refit_fingerprints_equal_disk_on_every_worker"] = not any(wrong)
            # logprobs are a second witness only where the engine repeats itself on the same weights
            # (the fingerprints above decide); otherwise the JSON says they were not comparable
            logprobs_equal = prompt_logprobs(llm, batch) == disk_logprobs
            if repeatable:
                checks["prompt_logprobs_equal_disk"] = logprobs_equal
            else:
                result["prompt_logprobs_equal_disk_not_checked"] = {"equal": logprobs_equal, "why": "not repeatable"}
        checks["trainer_tp2_moves_nothing_between_ranks"] = refit.plan.bytes_moved == 0

        second = refit.refit(bridge, chunks, fp8=fp8)
        if llm is not None:
            checks["second_refit_replays_without_reopening"] = not second.opened
            checks["second_refit_equal_disk"] = not any(differing_per_worker(disk, fingerprints(llm)))

        weight = attention_output_weight(chunks)
        with torch.no_grad():
            original = weight[0, 0].clone()
            weight[0, 0] += 1.0
        refit.refit(bridge, chunks, fp8=fp8)
        if llm is not None:
            caught = differing_per_worker(disk, fingerprints(llm))
            result["perturbed"] = caught
            checks["perturbed_element_caught_in_o_proj_of_each_worker"] = (
                all(caught_in_o_proj(names, fp8) for names in caught) and len(caught) == 2
            )
        with torch.no_grad():
            weight[0, 0] = original
        refit.refit(bridge, chunks, fp8=fp8)
        if llm is not None:
            checks["clean_refit_after_perturbation_equal_disk"] = not any(differing_per_worker(disk, fingerprints(llm)))

        steps = [refit.refit(bridge, chunks, fp8=fp8) for _ in range(args.steps)]
        if llm is not None:
            result["sharded_steps"] = [
                {
                    "ms": round(s.ms, 2),
                    "transfer_ms": round(s.export_ms, 2),
                    "apply_ms": round(s.apply_ms, 2),
                    "engine_ms": s.engine_ms,
                }
                for s in steps
            ]
        refit.close()
        if fp8 is None:
            result["gathering_baseline_steps"] = gathering_baseline(llm, bridge, chunks, args.steps)
        else:
            result["gathering_baseline_not_run"] = "vLLM's block-FP8 layers refuse a plain load_weights once processed"
        if llm is not None:
            if fp8 is None:
                checks["baseline_engine_equal_disk"] = not any(differing_per_worker(disk, fingerprints(llm)))
            sharded = sorted(s["ms"] for s in result["sharded_steps"])[len(steps) // 2]
            result["median_ms"] = {"sharded": sharded}
            # the row: ours against one device copy of a worker's bytes (every GPU copies its
            # own shard at once) and, in BF16, against vLLM's own load_weights fed by the gathering export
            result.update(
                engine_tp=2, bytes=steps[0].bytes, ours_ms=sharded, floor_ms=round(floor_ms(steps[0].bytes), 3)
            )
            result["ours_over_floor"] = round(sharded / result["floor_ms"], 2)
            if fp8 is None:
                baseline = sorted(s["ms"] for s in result["gathering_baseline_steps"])[len(steps) // 2]
                result["median_ms"]["gathering_export_and_load_weights"] = baseline
                result["vllm_load_weights_gather_ms"] = baseline
                result["load_weights_gather_over_ours"] = round(baseline / sharded, 2)
        verdict = [all(checks.values())]
        if rank == 0:  # before the verdict reaches rank 1: torchrun stops rank 0 once rank 1 exits 1
            result["ok"] = verdict[0]
            write_result(args.out_dir, result_name(result), result, device=result["device"])
        dist.broadcast_object_list(verdict, src=0)
    result["ok"] = verdict[0]
    return result


def main() -> None:
    parser = parser_with_engine_arguments(__doc__)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each path (default 5)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = run(args)
    logger.info("%s %s", "OK" if result["ok"] else "FAILED", result_name(result))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
