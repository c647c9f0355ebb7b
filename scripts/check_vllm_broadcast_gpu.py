"""GPU host: a broadcast refit into vLLM equals loading from disk; a failure on either side raises on both.

    python3 scripts/check_vllm_broadcast_gpu.py --model qwen3-1.7b [--layers N] [--fp8] [--engine-gpu 1]
        [--inject-fault receiver-load,receiver-handshake,trainer-export] --out-dir DIR

One process is the trainer (a Megatron model of a full-size shape, random weights, TP1 on GPU 0);
the vLLM engine runs in its own process, on ``--engine-gpu`` (default: the trainer's GPU). The
refit is ``engines.vllm.VLLMBroadcastRefit``: the packed broadcast over a ``StoreGroup``
the engine's worker joins by address; NCCL when the engine has a GPU of its own, gloo (CUDA
tensors through host memory) when it shares the trainer's, since NCCL refuses two members on one
GPU. Steps, each checked:

0. NCCL settings (own GPU). vLLM's worker runs NCCL with what its batch-invariant mode sets
   (``VLLM_BATCH_INVARIANT=1``: one channel, the Simple protocol, ...); before its first NCCL call
   the trainer takes the same ``NCCL_*`` values, computed by vLLM's own function
   (``engine_nccl_settings``), and they must equal the worker's. A session opened with the
   trainer's own settings instead must be refused on both sides within 30 s, naming the
   variables (``SettingsMismatchError``; in issue #31 this was NCCL's bootstrap failing with
   "Message truncated: received 12288 bytes instead of 512" and the trainer waiting 200 s).
1. The trainer writes the HF checkpoint ``convert`` writes (with ``--fp8`` the blockwise FP8 one).
2. A vLLM engine starts from that checkpoint; its exact parameter fingerprints and prompt
   logprobs on a fixed batch are the oracle.
3. Every engine parameter is overwritten with noise; a broadcast refit must bring back every
   fingerprint and every prompt logprob, bit for bit; overwritten again, a second refit too (BF16:
   the first records the engine's loader, the second replays it, ``engine_modes``).
4. One element of one trainer weight changed: the next refit changes exactly the engine parameter
   it feeds; restored, the next refit is exact again.
5. Injected faults (``--inject-fault``; default all three with NCCL, ``receiver-load`` alone over
   gloo, where a failed group's pending operations would hold both processes until the timeout),
   each raising on both sides within 30 s, then a refit that is exact again:
   ``receiver-load`` the engine's loader raises at its first tensor (a replaced loader is
   recorded again; the trainer raises that error; the same session goes on); ``receiver-handshake`` the engine's first broadcast of the
   refit raises, as NCCL did in the issue (the trainer raises it; a new session); ``trainer-export``
   the trainer's export raises after 3 tensors (the trainer raises it, with the engine's
   ``PeerFailedError`` in its notes; a new session).
6. Steady refit times (ms, from the start of the export until the engine has loaded), with the
   group's backend named: on one GPU over gloo they measure the protocol, not NCCL; with vLLM's
   batch-invariant NCCL settings they measure one NCCL channel.

Writes DIR/vllm_broadcast_<model>[_fp8].json; exits 1 when a check fails.
"""

from __future__ import annotations

import inspect
import logging
import os
import statistics
import time

import torch
from torch.distributed.elastic.utils.distributed import get_free_port as free_port

from mbridge_refit.testing.vllm_harness import (
    batch_invariant,
    inject_load_fault,
    model_config,
    parser_with_engine_arguments,
    prompts,
    report,
    start_engine,
    tp1_trainer,
    worker_nccl_env,
    write_checkpoint,
)

logger = logging.getLogger("check_vllm_broadcast")

BOUND_S = 30.0
FAULTS = ("receiver-load", "receiver-handshake", "trainer-export")
# vLLM 0.26's batch-invariant NCCL settings, used only where its own function cannot be called
VLLM_BATCH_INVARIANT_NCCL = {
    "NCCL_LAUNCH_MODE": "GROUP",
    "NCCL_COLLNET_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_P2P_NET_DISABLE": "1",
    "NCCL_MIN_NCHANNELS": "1",
    "NCCL_MAX_NCHANNELS": "1",
    "NCCL_PROTO": "Simple",
    "NCCL_ALGO": "allreduce:tree",
    "NCCL_NTHREADS": "1",
    "NCCL_SOCKET_NTHREADS": "1",
}


def fingerprints(llm) -> dict:
    from mbridge_refit.engines.replay.fingerprint import fingerprints_from_wire

    return fingerprints_from_wire(llm.collective_rpc("mbridge_refit_fingerprints")[0])


def first_weight(chunks, part: str) -> torch.Tensor:
    return next(p for chunk in chunks for name, p in chunk.named_parameters() if part in name)


# --- step 0: the NCCL settings of vLLM's workers ----------------------------------------------------


def engine_nccl_settings() -> tuple[dict[str, str], str]:
    """The ``NCCL_*`` values vLLM's workers set for themselves (none unless ``VLLM_BATCH_INVARIANT``),
    computed by vLLM's own function on this environment and then undone; and where they came from."""
    if os.environ.get("VLLM_BATCH_INVARIANT", "0").strip().lower() in ("", "0", "false"):
        return {}, "VLLM_BATCH_INVARIANT is off"
    try:
        override = _vllm_invariance_override()  # importing vLLM sets its own variables: those stay
    except ImportError as err:
        logger.warning("vLLM's batch-invariant override not found (%s): using vLLM 0.26's NCCL values", err)
        return dict(VLLM_BATCH_INVARIANT_NCCL), f"vLLM 0.26's values ({err})"
    saved = dict(os.environ)
    try:
        override(*[None] * sum(p.default is p.empty for p in inspect.signature(override).parameters.values()))
        changed = {k: v for k, v in os.environ.items() if k.startswith("NCCL_") and saved.get(k) != v}
        return changed, f"{override.__module__}.{override.__qualname__}"
    except Exception as err:  # noqa: BLE001 - another vLLM version: the values vLLM 0.26 sets
        logger.warning("vLLM's batch-invariant override could not be called (%s): using vLLM 0.26's NCCL values", err)
        return dict(VLLM_BATCH_INVARIANT_NCCL), f"vLLM 0.26's values ({type(err).__name__}: {err})"
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _vllm_invariance_override():
    import importlib

    for module in ("vllm.model_executor.layers.batch_invariant", "vllm.model_executor.determinism.batch_invariant"):
        try:
            return importlib.import_module(module).override_envs_for_invariance
        except (ImportError, AttributeError):
            continue
    raise ImportError("no override_envs_for_invariance in this vLLM")


def error_text(err: BaseException) -> str:
    return " | ".join([f"{type(err).__name__}: {err}", *getattr(err, "__notes__", [])])


def settings_refused(llm, bridge, chunks, fp8, config, device, matched: dict) -> dict:
    """Step 0's negative check: a session opened with the trainer's own NCCL settings."""
    from mbridge_refit.engines.vllm import VLLMBroadcastRefit

    saved = {name: os.environ.pop(name) for name in matched if name in os.environ}
    started = time.monotonic()
    try:
        probe = VLLMBroadcastRefit(
            llm, host="127.0.0.1", port=free_port(), backend="nccl", device=device, timeout_s=120, config=config
        )
        probe.open(bridge, chunks, fp8=fp8)
        probe.close()
        return {"error": None, "seconds": round(time.monotonic() - started, 2)}
    except Exception as err:  # noqa: BLE001 - the outcome checked
        return {"error": error_text(err), "seconds": round(time.monotonic() - started, 2)}
    finally:
        os.environ.update(saved)


# --- step 5: faults -----------------------------------------------------------------------------------


def inject_handshake_fault(worker) -> None:
    """Runs on the engine's worker: its next broadcast (the refit's handshake header) raises."""
    group = worker._mbridge_broadcast_target.group

    def failing(tensor, src, *, async_op=False):
        raise RuntimeError(
            "injected receiver-handshake: the engine's first broadcast failed, as NCCL's bootstrap did in issue #31"
        )

    group.broadcast = failing


def failing_export(bridge, after: int):
    """``bridge.export_hf_weights`` for one call: the stream raises after ``after`` tensors."""
    export = type(bridge).export_hf_weights

    def export_hf_weights(*args, **kwargs):
        del bridge.export_hf_weights  # once
        for index, item in enumerate(export(bridge, *args, **kwargs)):
            if index == after:
                raise RuntimeError(f"injected trainer-export: the trainer's export failed after {after} tensors")
            yield item

    return export_hf_weights


def run_fault(fault: str, session, llm, bridge, chunks, fp8, disk: dict) -> tuple[dict, object]:
    """One fault: the refit must raise within ``BOUND_S`` naming it (and the engine's side); then a
    refit (in a new session where the group failed) must equal the disk-loaded engine again."""
    from mbridge_refit.engines.replay.fingerprint import differing

    if fault == "receiver-load":
        llm.collective_rpc(inject_load_fault)
    elif fault == "receiver-handshake":
        llm.collective_rpc(inject_handshake_fault)
    else:
        bridge.export_hf_weights = failing_export(bridge, 3)
    started = time.monotonic()
    try:
        session.refit(bridge, chunks, fp8=fp8)
        outcome = {"error": None}
    except Exception as err:  # noqa: BLE001 - the outcome checked
        outcome = {"error": error_text(err)}
    outcome["seconds"] = round(time.monotonic() - started, 2)
    # the trainer's error; the engine's: raised by the trainer (receiver faults) or in its notes, naming the trainer's
    needles = ["injected " + fault] + (
        ["the engine's workers:", "member 0 failed"] if fault == "trainer-export" else []
    )
    outcome["raised_on_both_within_30s"] = (
        outcome["error"] is not None
        and outcome["seconds"] < BOUND_S
        and all(needle in outcome["error"] for needle in needles)
    )
    if fault != "receiver-load":  # the group failed: a new session
        session.close()
        session = open_session(llm, bridge, chunks, fp8, session.backend, session.device, session.config)
    session.refit(bridge, chunks, fp8=fp8)
    outcome["next_refit_equals_disk"] = not differing(disk, fingerprints(llm))
    return outcome, session


def open_session(llm, bridge, chunks, fp8, backend, device, config):
    from mbridge_refit.engines.vllm import VLLMBroadcastRefit

    session = VLLMBroadcastRefit(
        llm, host="127.0.0.1", port=free_port(), backend=backend, device=device, timeout_s=300, config=config
    )
    session.open(bridge, chunks, fp8=fp8)
    return session


# --- the run ----------------------------------------------------------------------------------------


def run(args) -> dict:
    own_gpu = args.engine_gpu is not None and args.engine_gpu != 0
    backend = "nccl" if own_gpu else "gloo"
    matched, matched_from = engine_nccl_settings()
    os.environ.update(matched)  # before the trainer's first NCCL call: NCCL reads them once per process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of this script's functions

    from mbridge_refit.engines.broadcast.packed import PackedBroadcastConfig
    from mbridge_refit.engines.replay.fingerprint import differing
    from mbridge_refit.engines.vllm import prompt_logprobs

    faults = (
        [f for f in args.inject_fault.split(",") if f]
        if args.inject_fault != "auto"
        else (list(FAULTS) if own_gpu else ["receiver-load"])
    )
    result: dict = {
        "model": args.model if args.layers is None else f"{args.model}-{args.layers}layers",
        "fp8": args.fp8,
        "device": torch.cuda.get_device_name(),
        "engine_gpu": args.engine_gpu or 0,
        "backend": backend,
        "trainer_nccl_set": matched,
        "trainer_nccl_from": matched_from,
        "checks": {},
    }
    checks = result["checks"]
    config = model_config(args)
    fp8 = "blockwise" if args.fp8 else None
    device = torch.device("cuda", 0)
    buffers = PackedBroadcastConfig(bucket_bytes=args.bucket_mib << 20, num_buffers=2)
    with tp1_trainer(config, args.work, device) as (bridge, chunks, work):
        checkpoint = work / "hf"
        write_checkpoint(bridge, chunks, config, checkpoint, bridge.fp8_config(fp8))

        if own_gpu:  # the engine process sees only its GPU (the trainer's CUDA context already exists)
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args.engine_gpu)
        llm = start_engine(checkpoint, args)
        if own_gpu:
            from mbridge_refit.engines.broadcast.group import (
                group_settings,
                settings_differences,
            )

            engine_env = llm.collective_rpc(worker_nccl_env)[0]
            # what vLLM's worker set beyond its invariance function (seen: NCCL_COLLNET_ENABLE=0), before
            # the trainer's first communicator of the group
            adopted = {k: v for k, v in engine_env.items() if os.environ.get(k) != v}
            os.environ.update(adopted)
            matched.update(adopted)
            result["trainer_nccl_adopted_from_engine"] = adopted
            trainer_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
            result["engine_nccl_env"], result["trainer_nccl_env"] = engine_env, trainer_env
            result["nccl_settings_differences"] = settings_differences(
                {0: group_settings("nccl", trainer_env), 1: group_settings("nccl", engine_env)}
            )
            checks["trainer_nccl_settings_equal_the_engines"] = not result["nccl_settings_differences"]
            if matched:
                refused = settings_refused(llm, bridge, chunks, fp8, buffers, device, matched)
                result["unmatched_settings"] = refused
                checks[
                    "unmatched_nccl_settings_refused_on_both_within_30s"
                ] = (  # the trainer's error, the engine's in a note
                    refused["error"] is not None
                    and refused["seconds"] < BOUND_S
                    and refused["error"].startswith("SettingsMismatchError")
                    and "the engine's workers:" in refused["error"]
                    and refused["error"].count("NCCL_MAX_NCHANNELS") >= 2
                )
        batch = prompts(config.vocab_size)
        disk, disk_logprobs = fingerprints(llm), prompt_logprobs(llm, batch)
        llm.collective_rpc("mbridge_refit_scramble", args=(7,))
        checks["scramble_changed_every_parameter"] = len(differing(disk, fingerprints(llm))) == len(disk)

        started = time.perf_counter()
        refit = open_session(llm, bridge, chunks, fp8, backend, device, buffers)
        result["open_s"] = round(time.perf_counter() - started, 2)
        step = refit.refit(bridge, chunks, fp8=fp8)
        result["first"] = {
            "tensors": step.tensors,
            "bytes": step.bytes,
            "ms": round(step.ms, 1),
            "worker": step.workers[0],
        }
        checks["engine_loaded_every_tensor_sent"] = (
            step.workers[0]["tensors"] == step.tensors and not step.workers[0]["unloaded"]
        )
        wrong = differing(disk, fingerprints(llm))
        result["different_after_refit"] = wrong[:10]
        checks["refit_fingerprints_equal_disk"] = not wrong
        checks["prompt_logprobs_equal_disk"] = prompt_logprobs(llm, batch) == disk_logprobs
        llm.collective_rpc("mbridge_refit_scramble", args=(8,))  # the next refit must write everything again
        second = refit.refit(bridge, chunks, fp8=fp8)
        checks["second_refit_fingerprints_equal_disk"] = not differing(disk, fingerprints(llm))
        result["engine_modes"] = [step.workers[0]["mode"], second.workers[0]["mode"]]
        # BF16: the first refit records the engine's loader, the next ones replay it; FP8: its loader every step
        checks["engine_recorded_then_replayed"] = result["engine_modes"] == (
            ["loader", "loader"] if fp8 else ["recorded", "replayed"]
        )

        weight = first_weight(chunks, "linear_fc2.weight")  # layer 0's MLP (its first expert in a MoE)
        kept = weight.data[0, 0].clone()
        weight.data[0, 0] += 1.0
        refit.refit(bridge, chunks, fp8=fp8)
        caught = differing(disk, fingerprints(llm))
        result["perturbed"] = {
            "trainer_parameter": "layer 0 linear_fc2.weight[0, 0]",
            "engine_parameters_changed": caught,
        }
        # its down projection (with FP8 also its block scales), nothing else
        checks["perturbed_weight_caught_in_its_parameter"] = 0 < len(caught) <= 2 and all(
            "layers.0.mlp." in c for c in caught
        )
        weight.data[0, 0] = kept
        refit.refit(bridge, chunks, fp8=fp8)
        checks["clean_refit_after_perturbation_equal_disk"] = not differing(disk, fingerprints(llm))
        checks["prompt_logprobs_equal_disk_at_end"] = prompt_logprobs(llm, batch) == disk_logprobs

        result["faults"] = {}
        for fault in faults:
            outcome, refit = run_fault(fault, refit, llm, bridge, chunks, fp8, disk)
            result["faults"][fault] = outcome
            checks[f"fault_{fault}_raised_on_both_within_30s"] = outcome["raised_on_both_within_30s"]
            checks[f"fault_{fault}_next_refit_equals_disk"] = outcome["next_refit_equals_disk"]

        times = [refit.refit(bridge, chunks, fp8=fp8).ms for _ in range(args.repeats)]
        result["steady_ms"] = {"median": round(statistics.median(times), 1), "all": [round(t, 1) for t in times]}
        refit.close()
    result["ok"] = all(checks.values())
    return result


def parse_args(argv=None):
    parser = parser_with_engine_arguments(__doc__)
    parser.add_argument(
        "--engine-gpu", type=int, default=None, help="the engine's GPU (default: the trainer's, over gloo)"
    )
    parser.add_argument("--bucket-mib", type=int, default=256, help="packed-broadcast bucket size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="steady refits timed (default 3)")
    parser.add_argument(
        "--inject-fault",
        default="auto",
        metavar="FAULTS",
        help=f"comma-separated faults of {', '.join(FAULTS)} (default 'auto': all three over NCCL, "
        "receiver-load over gloo; '' none)",
    )
    args = parser.parse_args(argv)
    if args.inject_fault != "auto":
        unknown = sorted({f for f in args.inject_fault.split(",") if f} - set(FAULTS))
        if unknown:
            parser.error(f"--inject-fault: unknown {unknown}; choose from {', '.join(FAULTS)}")
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    setting = batch_invariant()  # the logprob oracle needs it (check_vllm_refit_gpu's docstring)
    report({**run(args), "batch_invariant": setting}, args, prefix="vllm_broadcast")


if __name__ == "__main__":
    main()
