"""GPU host: a LoRA adapter refit into vLLM equals vLLM loading the same adapter from disk.

    python3 scripts/check_vllm_lora_refit_gpu.py --model qwen3-1.7b --layers 8 [--lora-rank 16] --out-dir DIR

One process is the trainer (a Megatron model of a full-size shape, random weights, TP1 on this GPU);
two vLLM engines run in their own processes on the same GPU. Steps, each checked:

1. The trainer writes the base HF checkpoint (``check_vllm_refit_gpu.write_checkpoint``), then wraps the
   model with Megatron-Bridge's ``LoRA`` (rank ``--lora-rank`` on q/k/v, o, gate/up, down) and gives
   every factor random nonzero values (B included, which LoRA zero-initialises).
2. A vLLM engine starts from the base checkpoint with ``enable_lora`` (two slots: the refit adapter and
   the oracle) and records every base parameter's fingerprint.
3. ``engines.vllm.VLLMAdapterRefit`` refits the adapter (CUDA IPC, vLLM's own adapter construction). The
   oracle: the same adapter written by ``save_hf_adapter`` (what ``convert export-adapter`` writes) and
   given to the engine as a ``LoRARequest`` from that directory. Prompt logprobs with the refit adapter
   must equal the oracle's bit for bit (``VLLM_BATCH_INVARIANT=1``) and differ from the base's.
4. The adapter changes in place (an optimizer step): the logprobs with the refit adapter change; the
   next refit equals the changed adapter from disk again. The base fingerprints never change.
5. Timing: the adapter refit's steady step against the merged full refit of the same model
   (``VLLMRefit``, adapters merged by the export) into a second engine without LoRA.

Writes DIR/vllm_lora_refit_<model>.json (fields device, model, lora_rank, adapter_bytes,
adapter_refit_ms, merged_refit_ms, checks) with DIR/manifest.json; exits 1 when a check fails.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
from provenance import write_result

from mbridge_refit.testing.vllm_harness import (
    model_config,
    parser_with_engine_arguments,
    prompts,
    start_engine,
    tp1_trainer,
    write_checkpoint,
)

logger = logging.getLogger("check_vllm_lora_refit")

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def seed_adapters(chunks, step: int) -> None:
    """Random nonzero factors, seeded by name and ``step`` (a changed adapter is another step)."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".adapter." in name:
                generator = torch.Generator().manual_seed(zlib.crc32(f"{step}/{name}".encode()))
                with torch.no_grad():
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def disk_request(bridge, chunks, lora, folder: Path, lora_int_id: int):
    """The oracle: the adapter as ``save_hf_adapter`` writes it, as vLLM loads it from a directory."""
    from vllm.lora.request import LoRARequest

    bridge.save_hf_adapter(chunks, folder, peft_config=lora, show_progress=False)
    return LoRARequest(lora_name=f"disk-{lora_int_id}", lora_int_id=lora_int_id, lora_path=str(folder))


def slots_differ(llm, lora_int_id: int, other_id: int) -> list[str]:
    """The LoRA modules whose GPU slots differ between two active adapters, on every worker."""
    differ = llm.collective_rpc("mbridge_refit_lora_slots_differ", args=(lora_int_id, other_id))
    if any(differ):
        logger.error("slots differ: %s", differ)
    return [name for worker in differ for name in worker]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1e3


def steady_ms(step, count: int = 5) -> float:
    return round(statistics.median(step() for _ in range(count)), 3)


def run(args) -> dict:
    from megatron.bridge.peft.lora import LoRA

    from mbridge_refit.engines.replay.fingerprint import differing
    from mbridge_refit.engines.vllm import VLLMAdapterRefit, VLLMRefit, prompt_logprobs
    from mbridge_refit.engines.vllm.trainer import reset_prefix_cache

    result: dict = {
        "device": torch.cuda.get_device_name(),
        "model": args.model if args.layers is None else f"{args.model}-{args.layers}layers",
        "lora_rank": args.lora_rank,
        "checks": {},
    }
    checks = result["checks"]
    config = model_config(args)
    device = torch.device("cuda")
    with tp1_trainer(config, args.work, device) as (bridge, chunks, work):
        checkpoint = work / "hf"
        write_checkpoint(bridge, chunks, config, checkpoint, None)
        lora = LoRA(dim=args.lora_rank, alpha=2 * args.lora_rank, target_modules=TARGETS)
        chunks = lora(chunks, training=True)
        # the wrap replaced modules of the model the checkpoint write planned: the bridge refuses the
        # stale plan by name (ModelChangedError) until it is told to plan anew
        bridge.forget_model()
        seed_adapters(chunks, 0)

        llm = start_engine(
            checkpoint, args, enable_lora=True, max_lora_rank=args.lora_rank, max_loras=2, max_cpu_loras=2
        )
        refit = VLLMAdapterRefit(llm, timeout_s=300)
        batch = prompts(config.vocab_size)
        base = VLLMRefit(llm).fingerprints()
        base_logprobs = prompt_logprobs(llm, batch)

        step = refit.refit(bridge, chunks)
        result["adapter_bytes"], result["adapter_tensors"] = step.bytes, step.tensors
        disk = prompt_logprobs(llm, batch, disk_request(bridge, chunks, lora, work / "adapter0", 2))
        refit_logprobs = prompt_logprobs(llm, batch, refit.lora_request)
        checks["refit_adapter_logprobs_equal_disk_adapter"] = refit_logprobs == disk
        checks["refit_slots_equal_disk_slots"] = not slots_differ(llm, refit.lora_int_id, 2)
        result["first_load"] = {key: step.workers[0][key] for key in ("path", "why", "ms", "phases_ms")}
        checks["adapter_changes_logprobs"] = disk != base_logprobs
        result["logprob_sample"] = [base_logprobs[0][:3], disk[0][:3], refit_logprobs[0][:3]]

        seed_adapters(chunks, 1)  # the adapter changed in place
        checks["stale_until_refit"] = prompt_logprobs(llm, batch, refit.lora_request) == refit_logprobs
        second = refit.refit(bridge, chunks)
        checks["second_refit_reuses_the_mapping"] = not second.opened
        changed = prompt_logprobs(llm, batch, refit.lora_request)
        checks["changed_adapter_changes_logprobs"] = changed != refit_logprobs
        disk_changed = prompt_logprobs(llm, batch, disk_request(bridge, chunks, lora, work / "adapter1", 3))
        checks["next_refit_equals_disk_again"] = changed == disk_changed
        checks["refilled_slots_equal_disk_slots"] = not slots_differ(llm, refit.lora_int_id, 3)
        result["second_load"] = {key: second.workers[0].get(key) for key in ("path", "why", "ms")}
        checks["base_parameters_untouched"] = not differing(base, VLLMRefit(llm).fingerprints())
        checks["base_logprobs_untouched"] = prompt_logprobs(llm, batch) == base_logprobs

        steps = [refit.refit(bridge, chunks) for _ in range(5)]
        result["adapter_refit_ms"] = round(statistics.median(s.ms for s in steps), 3)
        result["adapter_engine_ms"] = round(statistics.median(s.engine_ms for s in steps), 3)
        result["adapter_engine_paths"] = [s.workers[0]["path"] for s in steps]
        result["adapter_export_ms"] = round(statistics.median(s.export_ms for s in steps), 3)
        result["adapter_apply_ms"] = round(statistics.median(s.apply_ms for s in steps), 3)
        # what any step into this engine pays whatever it carries: one RPC to the workers, one prefix-cache reset
        result["rpc_round_trip_ms"] = steady_ms(lambda: timed(lambda: llm.collective_rpc("mbridge_refit_memory")))
        result["prefix_cache_reset_ms"] = steady_ms(lambda: timed(lambda: reset_prefix_cache(llm, "adapter")))
        result["adapter_engine_phases_ms"] = {  # where the engine's time goes (engines.vllm.lora.AdapterSlot)
            phase: round(statistics.median(s.workers[0]["phases_ms"][phase] for s in steps), 3)
            for phase in steps[0].workers[0]["phases_ms"]
        }
        refit.close()

        plain = start_engine(checkpoint, args)
        merged = VLLMRefit(plain, timeout_s=300)
        first = merged.refit(bridge, chunks)
        result["merged_bytes"] = first.bytes
        result["merged_refit_ms"] = steady_ms(lambda: merged.refit(bridge, chunks).ms)
        merged.close()
    result["bytes_ratio"] = round(result["merged_bytes"] / result["adapter_bytes"], 1)
    result["time_ratio"] = round(result["merged_refit_ms"] / result["adapter_refit_ms"], 4)  # merged / adapter
    result["ok"] = all(checks.values())
    return result


def main() -> None:
    parser = parser_with_engine_arguments(__doc__)
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16; the engine's max_lora_rank)")
    parser.set_defaults(gpu_memory_utilization=0.25)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    result = run(args)
    name = f"vllm_lora_refit_{result['model']}.json"
    write_result(args.out_dir, name, result, device=result["device"])
    logger.info("checks %s", result["checks"])
    logger.info("%s %s", "OK" if result["ok"] else "FAILED", name)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
