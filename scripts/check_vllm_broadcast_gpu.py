"""GPU host: a broadcast refit into vLLM equals loading the same weights from disk.

    python3 scripts/check_vllm_broadcast_gpu.py --model qwen3-1.7b [--layers N] [--fp8] [--engine-gpu 1] --out-dir DIR

One process is the trainer (a Megatron model of a full-size shape, random weights, TP1 on GPU 0);
the vLLM engine runs in its own process, on ``--engine-gpu`` (default: the trainer's GPU). The
refit is ``engines.vllm_broadcast.VLLMBroadcastRefit``: the packed broadcast over a ``StoreGroup``
the engine's worker joins by address; NCCL when the engine has a GPU of its own, gloo (CUDA
tensors through host memory) when it shares the trainer's, since NCCL refuses two members on one
GPU. Steps, each checked:

1. The trainer writes the HF checkpoint ``convert`` writes (with ``--fp8`` the blockwise FP8 one).
2. A vLLM engine starts from that checkpoint; its exact parameter fingerprints and prompt
   logprobs on a fixed batch are the oracle.
3. Every engine parameter is overwritten with noise; a broadcast refit must bring back every
   fingerprint and every prompt logprob, bit for bit; a second refit too.
4. One element of one trainer weight changed: the next refit changes exactly the engine parameter
   it feeds; restored, the next refit is exact again.
5. Steady refit times (ms, from the start of the export until the engine has loaded), with the
   group's backend named: on one GPU over gloo they measure the protocol, not NCCL.

Writes DIR/vllm_broadcast_<model>[_fp8].json; exits 1 when a check fails.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_vllm_refit_gpu import (  # noqa: E402
    model_config, parser_with_engine_arguments, prompts, report, start_engine, write_checkpoint,
)

logger = logging.getLogger("check_vllm_broadcast")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fingerprints(llm) -> dict:
    return {name: tuple(fp) for name, fp in llm.collective_rpc("mbridge_refit_fingerprints")[0].items()}


def first_weight(chunks, part: str) -> torch.Tensor:
    return next(p for chunk in chunks for name, p in chunk.named_parameters() if part in name)


def run(args) -> dict:
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.engines.fingerprint import differing
    from mbridge_refit.engines.vllm import prompt_logprobs
    from mbridge_refit.engines.vllm_broadcast import VLLMBroadcastRefit
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.sinks.packed_broadcast import PackedBroadcastConfig
    from mbridge_refit.tools.launch import distributed_session
    from mbridge_refit.tools.model_builder import BuildOptions, build_model

    own_gpu = args.engine_gpu is not None and args.engine_gpu != 0
    backend = "nccl" if own_gpu else "gloo"
    result: dict = {"model": args.model if args.layers is None else f"{args.model}-{args.layers}layers", "fp8": args.fp8,
                    "device": torch.cuda.get_device_name(), "engine_gpu": args.engine_gpu or 0, "backend": backend, "checks": {}}
    checks = result["checks"]
    config = model_config(args)
    fp8 = "blockwise" if args.fp8 else None
    device = torch.device("cuda", 0)
    layout = ParallelLayout(tp=1, pp=1, ep=1)
    with distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=10)), \
            tempfile.TemporaryDirectory(dir=args.work) as work:
        bridge = RefitBridge.from_hf_config(config)
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        checkpoint = Path(work) / "hf"
        write_checkpoint(bridge, chunks, config, checkpoint, bridge.fp8_config(fp8))

        if own_gpu:  # the engine process sees only its GPU (the trainer's CUDA context already exists)
            os.environ["CUDA_VISIBLE_DEVICES"] = str(args.engine_gpu)
        llm = start_engine(checkpoint, args)
        batch = prompts(config.vocab_size)
        disk, disk_logprobs = fingerprints(llm), prompt_logprobs(llm, batch)
        llm.collective_rpc("mbridge_refit_scramble", args=(7,))
        checks["scramble_changed_every_parameter"] = len(differing(disk, fingerprints(llm))) == len(disk)

        refit = VLLMBroadcastRefit(llm, host="127.0.0.1", port=free_port(), backend=backend, device=device, timeout_s=300,
                                   config=PackedBroadcastConfig(bucket_bytes=args.bucket_mib << 20, num_buffers=2))
        started = time.perf_counter()
        refit.open(bridge, chunks, fp8=fp8)
        result["open_s"] = round(time.perf_counter() - started, 2)
        step = refit.refit(bridge, chunks, fp8=fp8)
        result["first"] = {"tensors": step.tensors, "bytes": step.bytes, "ms": round(step.ms, 1), "worker": step.workers[0]}
        checks["engine_loaded_every_tensor_sent"] = step.workers[0]["tensors"] == step.tensors and not step.workers[0]["unloaded"]
        wrong = differing(disk, fingerprints(llm))
        result["different_after_refit"] = wrong[:10]
        checks["refit_fingerprints_equal_disk"] = not wrong
        checks["prompt_logprobs_equal_disk"] = prompt_logprobs(llm, batch) == disk_logprobs
        refit.refit(bridge, chunks, fp8=fp8)
        checks["second_refit_fingerprints_equal_disk"] = not differing(disk, fingerprints(llm))

        weight = first_weight(chunks, "linear_fc2.weight")  # layer 0's MLP (its first expert in a MoE)
        kept = weight.data[0, 0].clone()
        weight.data[0, 0] += 1.0
        refit.refit(bridge, chunks, fp8=fp8)
        caught = differing(disk, fingerprints(llm))
        result["perturbed"] = {"trainer_parameter": "layer 0 linear_fc2.weight[0, 0]", "engine_parameters_changed": caught}
        # its down projection (with FP8 also its block scales), nothing else
        checks["perturbed_weight_caught_in_its_parameter"] = 0 < len(caught) <= 2 and all("layers.0.mlp." in c for c in caught)
        weight.data[0, 0] = kept
        refit.refit(bridge, chunks, fp8=fp8)
        checks["clean_refit_after_perturbation_equal_disk"] = not differing(disk, fingerprints(llm))
        checks["prompt_logprobs_equal_disk_at_end"] = prompt_logprobs(llm, batch) == disk_logprobs

        times = [refit.refit(bridge, chunks, fp8=fp8).ms for _ in range(args.repeats)]
        result["steady_ms"] = {"median": round(statistics.median(times), 1), "all": [round(t, 1) for t in times]}
        refit.close()
    result["ok"] = all(checks.values())
    return result


def main() -> None:
    parser = parser_with_engine_arguments(__doc__)
    parser.add_argument("--engine-gpu", type=int, default=None, help="the engine's GPU (default: the trainer's, over gloo)")
    parser.add_argument("--bucket-mib", type=int, default=256, help="packed-broadcast bucket size in MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="steady refits timed (default 3)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    report(run(args), args, prefix="vllm_broadcast")


if __name__ == "__main__":
    main()
