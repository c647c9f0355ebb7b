"""The harness the vLLM GPU checks and benchmarks of ``scripts/`` share: their options, the trainer,
the engines, the timings and the result files.

``parser_with_engine_arguments`` (the options every check and benchmark takes), ``model_config``
(the HF config of a full-size shape, cut to some layers), ``prompts``, ``batch_invariant``;
``tp1_trainer`` (a TP1 session and a Megatron model of random bf16 weights on one GPU),
``write_checkpoint`` (what ``convert export`` writes for those weights); ``start_engine`` (a vLLM
engine loaded from a checkpoint) and ``dummy_engine`` (one of dummy weights, of a config written
by ``engine_config``), both with the checks' worker extension (``testing.vllm_worker``);
``prefix_cache_reset``, ``timed``, ``summary`` and ``floor_ms`` (one memcpy of the refit's bytes:
the floor a refit is measured against); functions run on the engine's workers through
``collective_rpc`` (``worker_nccl_env``, ``inject_load_fault``), importable there by their module's
name; ``result_name``, ``progress`` and ``report`` (a check's JSON result). Test support: production
code never imports this module (``tests/test_package.py``); vLLM is imported only inside the
functions that start an engine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "FLOOR_BUFFER_BYTES",
    "KV_BLOCKS",
    "batch_invariant",
    "dummy_engine",
    "engine_config",
    "floor_ms",
    "inject_load_fault",
    "model_config",
    "parser_with_engine_arguments",
    "prefix_cache_reset",
    "progress",
    "prompts",
    "report",
    "result_name",
    "start_engine",
    "summary",
    "timed",
    "tp1_trainer",
    "worker_nccl_env",
    "write_checkpoint",
]


# about what a full-depth 8B-30B model's engine holds at half of an 80 GB GPU (e.g. Qwen3-8B: 36 layers x
# 8 kv heads x 128 x 2 (K, V) x 2 bytes x 16 tokens = 2.4 MB a block; 40 GB / 2.4 MB = 17k blocks)
KV_BLOCKS = 16384


def parser_with_engine_arguments(
    description: str, *, model: str = "qwen3-1.7b", results: bool = False
) -> argparse.ArgumentParser:
    """The options every vLLM check and benchmark shares: the model shape (default ``model``), FP8, the
    engine's memory, the folders (``results``: ``--out-dir`` defaults to benchmarks/results/<date>-<device>/,
    for the benchmarks, instead of being required)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=model, help=f"full-size shape of recipes/shapes/ (default {model})")
    parser.add_argument("--layers", type=int, default=None, help="keep only this many layers (default: all)")
    parser.add_argument("--fp8", action="store_true", help="blockwise FP8 checkpoint, engine and refit")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of its GPU (default 0.3)"
    )
    parser.add_argument(
        "--work", default=os.environ.get("TMPDIR", "/tmp"), help="folder for the checkpoint (deleted after)"
    )
    if results:
        parser.add_argument(
            "--out-dir", type=Path, default=None, help="results folder (default benchmarks/results/<date>-<device>/)"
        )
        parser.add_argument(
            "--kv-blocks",
            type=int,
            default=KV_BLOCKS,
            help=f"the engine's KV cache in blocks (default {KV_BLOCKS}; 0: what the memory share gives). Every "
            "refit resets vLLM's prefix cache, which visits every block in Python: a cut model given a GPU's "
            "share holds far more blocks than the full model would, and its reset would dominate the step",
        )
    else:
        parser.add_argument("--out-dir", type=Path, required=True, help="folder for the JSON result")
    return parser


def model_config(args: argparse.Namespace):
    """The HF config of ``args.model``, cut to ``args.layers`` layers (per-layer lists cut too)."""
    from mbridge_refit.models.recipes import full_size_config

    config = full_size_config(args.model)
    if args.layers is not None:
        config.num_hidden_layers = args.layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: args.layers]
    return config


def prompts(vocab: int, count: int = 4, length: int = 48) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def batch_invariant() -> str:
    """Turn vLLM's batch-invariant mode on unless the environment says otherwise (before vLLM starts):
    the checks' logprob oracles need it (module docstring). Returns the setting, for the result."""
    return os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")


@contextlib.contextmanager
def tp1_trainer(config, work: str, device: torch.device | None = None) -> Iterator[tuple]:
    """The trainer of every vLLM check on one GPU: a TP1 session on ``device`` (default GPU 0) and a
    Megatron model of ``config`` with Megatron's random bf16 weights; yields ``(bridge, chunks, a
    temporary directory under work)``, the session and the directory ended after."""
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.plan.layout import ParallelLayout

    device = device or torch.device("cuda", 0)
    layout = ParallelLayout(tp=1, pp=1, ep=1)
    with (
        distributed_session(layout, device=device, timeout=datetime.timedelta(minutes=10)),
        tempfile.TemporaryDirectory(dir=work) as directory,
    ):
        bridge = RefitBridge.from_hf_config(config)
        chunks = build_model(bridge, layout, BuildOptions(device=device, params_dtype=torch.bfloat16))
        yield bridge, chunks, Path(directory)


def write_checkpoint(bridge, chunks, config, out: Path, fp8) -> None:
    """What ``convert export`` writes for these weights (same function)."""
    from mbridge_refit.convert.writing import write_hf_checkpoint

    source = out.parent / (out.name + "-config")
    distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
    if not distributed or torch.distributed.get_rank() == 0:
        config.save_pretrained(source)  # one writer: the other ranks read it
    if distributed:
        torch.distributed.barrier()
    dtypes = {e.hf_name: e.torch_dtype for e in bridge.export_plan(chunks).entries}
    write_hf_checkpoint(
        bridge,
        chunks,
        out=out,
        source_dtypes=dtypes,
        fp8=fp8,
        only_source_names=False,
        copy_files_from=source,
        max_shard_bytes=4 << 30,
        overwrite=True,
        show_progress=False,
    )


def start_engine(checkpoint: Path, args: argparse.Namespace, **overrides):
    """A vLLM engine loaded from ``checkpoint`` (vLLM's own loader) with the refit worker extension
    and the checks' own RPCs (``testing.vllm_worker``: scramble); ``overrides``: more ``LLM`` arguments."""
    from vllm import LLM

    from mbridge_refit.engines.vllm import engine_kwargs
    from mbridge_refit.testing.vllm_worker import TESTING_WORKER_EXTENSION

    return LLM(
        model=str(checkpoint),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=0,
        **engine_kwargs(worker_extension_cls=TESTING_WORKER_EXTENSION),
        **overrides,
    )


def engine_config(config, out: Path, quantization_config: dict | None) -> Path:
    config.save_pretrained(out)
    if quantization_config is not None:
        path = out / "config.json"
        data = json.loads(path.read_text())
        data["quantization_config"] = quantization_config
        path.write_text(json.dumps(data, indent=2))
    return out


def dummy_engine(directory: Path, args, transfer_backend: str | None = None):
    """A vLLM engine of the config in ``directory`` with dummy weights, the refit worker extension and
    the check-only RPCs (``testing.vllm_worker``), and vLLM's own weight transfer of ``transfer_backend``
    (the native baseline; None: none). Its KV cache holds ``args.kv_blocks`` blocks (the prefix-cache reset
    after each refit visits every block)."""
    from vllm import LLM

    from mbridge_refit.engines.vllm import engine_kwargs
    from mbridge_refit.testing.vllm_worker import TESTING_WORKER_EXTENSION

    extra = {}
    if transfer_backend is not None:
        from vllm.config import WeightTransferConfig

        extra["weight_transfer_config"] = WeightTransferConfig(backend=transfer_backend)
    return LLM(
        model=str(directory),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=256,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.kv_blocks or None,
        **engine_kwargs(worker_extension_cls=TESTING_WORKER_EXTENSION, **extra),
    )


def prefix_cache_reset(llm, args, repeats: int = 5) -> dict:
    """What every refit's prefix-cache reset costs on its own (``LLM.reset_prefix_cache``: an engine-core
    call that visits every KV block), with the engine's block count; part of each timed refit."""
    times = [timed(llm.reset_prefix_cache) for _ in range(repeats)]
    return {"kv_blocks": args.kv_blocks or "from the memory share", "reset_ms": summary(times)}


def timed(fn) -> float:
    """Wall ms of ``fn`` with this process's GPU synchronized on both ends (an engine's side is
    inside ``fn`` when it returns only once the engine has its bytes)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def summary(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "all": [round(v, 3) for v in values],
    }


FLOOR_BUFFER_BYTES = 4 << 30  # the floor's own device memory at most: a 24-layer MoE beside its engine leaves no more
# on an 80 GB GPU (2026-11-28, H100: one buffer of the 29 GiB of bytes ran out of memory)


def floor_ms(nbytes: int, repeats: int = 5) -> float:
    """One memcpy of ``nbytes``: half of a buffer into its other half and back, over a buffer of at most
    ``FLOOR_BUFFER_BYTES``, as many times as moves ``nbytes`` in all (copies of this size are bound by the
    memory's bandwidth, not their launches: the time of one copy of every byte)."""
    half = (min(nbytes, FLOOR_BUFFER_BYTES) // 2 + 255) // 256 * 256
    buffer = torch.empty(2 * half, dtype=torch.uint8, device="cuda")
    whole, rest = divmod(nbytes, 2 * half)

    def copies(low: torch.Tensor, high: torch.Tensor) -> None:
        for _ in range(whole):
            high.copy_(low)
            low.copy_(high)
        if rest:
            high[: rest // 2].copy_(low[: rest // 2])
            low[: rest - rest // 2].copy_(high[: rest - rest // 2])

    low, high = buffer[:half], buffer[half:]
    times = [timed(lambda low=low, high=high: copies(low, high)) for _ in range(repeats)]
    del low, high
    del buffer
    torch.cuda.empty_cache()
    return min(times)


def worker_nccl_env(worker) -> dict:
    """Runs on the engine's worker (``collective_rpc``): its ``NCCL_*`` environment."""
    return {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}


def inject_load_fault(worker) -> None:
    """Runs on the engine's worker: its loader raises at the first tensor of the next refit."""
    target = worker._mbridge_broadcast_target
    load = target.load_weights

    def failing(weights):
        target.load_weights = load
        for _ in weights:
            raise RuntimeError("injected receiver-load: the engine's loader failed at its first tensor")

    target.load_weights = failing


def result_name(result: dict, args: argparse.Namespace, prefix: str) -> str:
    return f"{prefix}_{result['model']}{'_fp8' if args.fp8 else ''}.json"


def progress(result: dict, args: argparse.Namespace, prefix: str = "vllm_refit") -> None:
    """The result so far, written where ``report`` writes the final one (``"ok": null``)."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / result_name(result, args, prefix)).write_text(json.dumps({**result, "ok": None}, indent=2) + "\n")


def report(result: dict, args: argparse.Namespace, *, prefix: str) -> None:
    """Write ``result`` to ``args.out_dir``/<prefix>_<model>[_fp8].json, print its checks, exit 1 if one failed."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = result_name(result, args, prefix)
    (args.out_dir / name).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["checks"], indent=2))
    print("OK" if result["ok"] else "FAILED", name)
    sys.exit(0 if result["ok"] else 1)
