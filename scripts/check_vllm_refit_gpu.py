"""GPU host: a colocated refit into vLLM equals loading the same weights from disk.

    python3 scripts/check_vllm_refit_gpu.py --model qwen3-1.7b [--layers N] [--fp8] [--expect-refusal] --out-dir DIR

One process is the trainer (a Megatron model of a full-size shape, random weights, TP1 on this
GPU); the vLLM engine runs in its own process on the same GPU. Steps, each checked:

1. The trainer writes the HF checkpoint ``convert`` writes (``convert.writing.write_hf_checkpoint``;
   with ``--fp8`` the blockwise FP8 one, with its ``quantization_config``).
2. A vLLM engine starts *from that checkpoint* (vLLM's own loader reads the files) and
   records every parameter's exact fingerprint and its prompt logprobs on a fixed batch. This
   is the oracle.
3. Every engine parameter is overwritten with noise (the fingerprints must change), then the
   trainer refits through ``engines.vllm.VLLMRefit`` (CUDA IPC): every fingerprint and every
   prompt logprob must equal the oracle's, bit for bit.
4. A weight perturbed on its way (one exported tensor replaced by a copy with one element
   changed) must show in exactly the engine parameters it feeds; a clean refit afterwards is
   exact again. A second clean refit replays without reopening.
5. The refit verifier against the engine itself (``convert.refit_verifier.verify_vllm_refit``), its
   two answers apart: the weights (the engine's fingerprints against the disk-loaded engine's,
   exact) and the numerics (the engine's own prompt logprobs against the trainer's Megatron
   forward, within ``tolerance_from_reference`` of the disk-loaded engine's own comparison with
   Megatron: the reference run, which an exact refit reproduces). It must pass after a clean
   refit (BF16 and FP8) and fail, in its weights check, after a refit with a perturbed weight
   that every token uses (an attention output projection: a perturbed expert a prompt never
   routes to moves no logprob, but its fingerprint).

6. Memory moved under an early apply (``IpcSession.check_after_word``): one live parameter's ``.data``
   swapped for a copy, another's storage offloaded the way trainers free it (``resize_(0)``,
   ``torch.cuda.empty_cache()``, then resized and written back: new memory), then a refit. The
   worker copies the old memory before the trainer finds the move, so the step must open anew, equal the
   disk-loaded engine bit for bit, and raise no CUDA error; the next refit replays, exactly.

DeepGEMM (``engines.vllm.deep_gemm``): the script leaves vLLM's DeepGEMM settings to the environment
and records what the engine does (``deep_gemm``: the variables, its DeepGEMM linear and MoE layers, E8M0).
With DeepGEMM at its default on Hopper, a block-FP8 engine requantizes its linear layers to power-of-two
scales after loading; the refit must then have them processed again after its copies
(``deep_gemm_layers_processed_again``: each such layer in the open's ``recomputed``) and still equal the
disk-loaded engine in every check above. ``--expect-refusal``: an engine whose DeepGEMM work a refit cannot
redo (DeepGEMM's MoE experts: ``VLLM_USE_DEEP_GEMM=1`` set on a MoE model; Blackwell's packed scales) must
refuse the first refit by name (``open_refused_naming_deep_gemm``) before any weight moves
(``refused_open_moved_no_weight``: the scrambled fingerprints unchanged), and the script stops there.

The result file is written after each phase (``"ok": null`` until the end); a first refit that fails
records its error (``open_error``) and ends the run.

The prompt-logprob oracle is bitwise stable only with vLLM's batch-invariant kernels: the script runs
with ``VLLM_BATCH_INVARIANT=1`` unless the environment sets it (``batch_invariant`` in the result; on an
H200, a broadcast check run with it off had every fingerprint equal and the logprobs not).

Writes DIR/vllm_refit_<model>[_fp8].json; exits 1 when a check fails.
"""

from __future__ import annotations

import logging
import time

import torch

from mbridge_refit.testing.vllm_harness import (
    batch_invariant,
    model_config,
    parser_with_engine_arguments,
    progress,
    prompts,
    report,
    start_engine,
    tp1_trainer,
    write_checkpoint,
)

logger = logging.getLogger("check_vllm_refit")


def perturbed(stream, victim: str):
    """The stream with ``victim`` replaced by a copy whose first element is changed."""
    for name, tensor in stream:
        if name == victim:
            tensor = tensor.clone()
            flat = tensor.view(-1).view(torch.uint8)
            flat[0] ^= 0x01
        yield name, tensor


def reference_numerics(llm, bridge, chunks, tokens):
    """The reference run of step 5: the disk-loaded engine's own logprobs against the trainer's."""
    from mbridge_refit.convert.refit_verifier import (
        compare_logprobs,
        hf_config,
        megatron_logprobs,
        vllm_logprobs,
    )

    return compare_logprobs(megatron_logprobs(chunks, tokens, hf_config(bridge).vocab_size), vllm_logprobs(llm, tokens))


def verify_against_trainer(
    refit, bridge, chunks, tokens, fp8, victim: str, disk: dict, reference, checks: dict
) -> dict:
    """Step 5: the verifier's two answers after a clean and after a perturbed refit."""
    from dataclasses import asdict

    from mbridge_refit.convert.refit_verifier import (
        tolerance_from_reference,
        verify_vllm_refit,
    )

    tolerance = tolerance_from_reference(reference)
    common = dict(sender=True, fp8=fp8, tolerance=tolerance, reference_fingerprints=disk, check=False)
    clean = verify_vllm_refit(refit, bridge, chunks, tokens, **common)
    perturbed_result = verify_vllm_refit(refit, bridge, chunks, tokens, perturb=victim, **common)
    refit.refit(bridge, chunks, fp8=fp8)
    checks["verifier_passes_after_clean_refit"] = clean.passed
    checks["verifier_weights_check_fails_after_perturbed_refit"] = not perturbed_result.weights.exact
    return {
        "reference": asdict(reference),
        "tolerance": tolerance,
        "clean": asdict(clean),
        "perturbed": asdict(perturbed_result),
    }


def moved_memory_refit(refit, bridge, chunks, fp8, disk: dict, checks: dict) -> dict:
    """Step 6 (module docstring): the values stay the disk's, only where they live changes."""
    from mbridge_refit.engines.replay.fingerprint import differing

    live = refit.live_parameters
    swapped, offloaded = live[0], live[-1]
    storage = offloaded.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=offloaded.device).set_(storage)
    saved, old = whole.cpu(), (swapped.data_ptr(), storage.data_ptr())
    with torch.no_grad():
        swapped.data = swapped.detach().clone()
        storage.resize_(0)
        torch.cuda.empty_cache()
        storage.resize_(saved.numel())
        torch.empty(0, dtype=torch.uint8, device=offloaded.device).set_(storage).copy_(saved)
    torch.cuda.synchronize()
    moved = (swapped.data_ptr(), storage.data_ptr())
    found = _LogLines("mbridge_refit.engines.ipc.trainer")
    with found:
        step = refit.refit(bridge, chunks, fp8=fp8)
    checks["moved_memory_found_after_the_word"] = any("data moved" in line for line in found.lines)
    checks["moved_memory_refit_opens_anew"] = step.opened
    checks["moved_memory_refit_equal_disk"] = not differing(disk, refit.fingerprints())
    again = refit.refit(bridge, chunks, fp8=fp8)
    checks["after_moved_memory_replays_exactly"] = not again.opened and not differing(disk, refit.fingerprints())
    return {"moved": [a != b for a, b in zip(old, moved)], "log": found.lines[-3:]}


class _LogLines(logging.Handler):
    """The records one logger emits inside a ``with`` block, as lines."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.INFO)
        self.logger, self.lines = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "_LogLines":
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)


def run(args) -> dict:
    from mbridge_refit.engines.replay.fingerprint import differing
    from mbridge_refit.engines.vllm import VLLMRefit, prompt_logprobs
    from mbridge_refit.fp8.format import BlockwiseFP8Config

    result: dict = {
        "model": args.model if args.layers is None else f"{args.model}-{args.layers}layers",
        "fp8": args.fp8,
        "device": torch.cuda.get_device_name(),
        "checks": {},
    }
    checks = result["checks"]
    config = model_config(args)
    fp8 = BlockwiseFP8Config() if args.fp8 else None
    device = torch.device("cuda")
    with tp1_trainer(config, args.work, device) as (bridge, chunks, work):
        checkpoint = work / "hf"
        started = time.perf_counter()
        write_checkpoint(bridge, chunks, config, checkpoint, fp8)
        result["write_checkpoint_s"] = round(time.perf_counter() - started, 1)

        started = time.perf_counter()
        llm = start_engine(checkpoint, args)
        result["engine_start_s"] = round(time.perf_counter() - started, 1)
        result["deep_gemm"] = deep_gemm = llm.collective_rpc("mbridge_refit_deep_gemm")[0]
        progress(result, args)
        refit = VLLMRefit(llm, timeout_s=300)
        batch = prompts(config.vocab_size)
        disk = refit.fingerprints()
        result["engine_parameters"] = len(disk)
        if not args.expect_refusal:  # a refused open reads no logprob
            disk_logprobs = prompt_logprobs(llm, batch)
            reference = reference_numerics(llm, bridge, chunks, torch.tensor(batch, device=device))
            result["engine_logprobs_repeatable_on_disk_weights"] = prompt_logprobs(llm, batch) == disk_logprobs

        llm.collective_rpc("mbridge_refit_scramble", args=(7,))
        noise = refit.fingerprints()
        checks["scramble_changed_every_parameter"] = len(differing(disk, noise)) == len(disk)
        progress(result, args)

        try:
            step = refit.refit(bridge, chunks, fp8=fp8)
        except Exception as err:  # the verdict, written: refused by name, or the failure the integrator must see
            result["open_error"] = f"{type(err).__name__}: {err}"[-4000:]
            if args.expect_refusal:
                checks["open_refused_naming_deep_gemm"] = "DeepGEMM" in str(err)
                checks["refused_open_moved_no_weight"] = not differing(noise, refit.fingerprints())
            else:
                checks["first_refit_opens"] = False
            refit.close()
            result["ok"] = all(checks.values())
            return result
        if args.expect_refusal:
            checks["open_refused_naming_deep_gemm"] = False  # it opened
            refit.close()
            result["ok"] = False
            return result
        report = step.report or {}
        result["open"] = {
            k: report.get(k)
            for k in ("tensors", "storages", "bytes", "copies", "open_ms", "quantized", "quantized_in_place")
        }
        result["open"]["via_loader"] = report.get("via_loader", [])[:10]
        result["open"]["recomputed"] = report.get("recomputed", [])[
            :10
        ]  # modules whose derived parameters vLLM recomputes
        checks["open_reports_no_missing_or_unexpected"] = not report.get("missing") and not report.get("unexpected")
        requantized = set(deep_gemm["linear"]) if deep_gemm["e8m0"] == [True] else set()
        result["open"]["deep_gemm_processed_again"] = len(requantized & set(report.get("recomputed", [])))
        checks["deep_gemm_layers_processed_again"] = requantized <= set(report.get("recomputed", []))
        after = refit.fingerprints()
        wrong = differing(disk, after)
        result["different_after_refit"] = wrong[:10]
        checks["refit_fingerprints_equal_disk"] = not wrong
        refit_logprobs = prompt_logprobs(llm, batch)
        checks["prompt_logprobs_equal_disk"] = refit_logprobs == disk_logprobs
        result["logprob_sample"] = [disk_logprobs[0][:4], refit_logprobs[0][:4]]
        progress(result, args)

        second = refit.refit(bridge, chunks, fp8=fp8)
        checks["second_refit_replays_without_reopening"] = not second.opened
        checks["second_refit_fingerprints_equal_disk"] = not differing(disk, refit.fingerprints())

        victim = next(
            e.hf_name
            for e in bridge.export_plan(chunks, fp8=fp8).entries
            if e.hf_name.endswith("mlp.down_proj.weight") or e.hf_name.endswith("experts.0.down_proj.weight")
        )
        refit.refit(bridge, chunks, fp8=fp8, through=lambda stream: perturbed(stream, victim))
        caught = differing(disk, refit.fingerprints())
        result["perturbed"] = {"tensor": victim, "engine_parameters_changed": caught}
        # its weight, and its scale where the engine requantizes the block (DeepGEMM's E8M0)
        layer = victim.split(".mlp.")[0]
        checks["perturbed_weight_caught_in_its_parameter"] = 0 < len(caught) <= 2 and all(layer in c for c in caught)
        refit.refit(bridge, chunks, fp8=fp8)
        checks["clean_refit_after_perturbation_equal_disk"] = not differing(disk, refit.fingerprints())
        checks["prompt_logprobs_equal_disk_at_end"] = prompt_logprobs(llm, batch) == disk_logprobs
        progress(result, args)
        result["moved_memory"] = moved_memory_refit(refit, bridge, chunks, fp8, disk, checks)
        every_token = next(
            e.hf_name
            for e in bridge.export_plan(chunks, fp8=fp8).entries
            if e.hf_name.endswith("self_attn.o_proj.weight")
        )
        result["verify"] = verify_against_trainer(
            refit, bridge, chunks, torch.tensor(batch, device=device), fp8, every_token, disk, reference, checks
        )
        result["steady_step_ms"] = [round(refit.refit(bridge, chunks, fp8=fp8).apply_ms, 2) for _ in range(3)]
        refit.close()
    result["ok"] = all(checks.values())
    return result


def main() -> None:
    parser = parser_with_engine_arguments(__doc__)
    parser.add_argument(
        "--expect-refusal",
        action="store_true",
        help="the engine's DeepGEMM work cannot be redone: the first refit must be refused by name, nothing moved",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    setting = batch_invariant()
    report({**run(args), "batch_invariant": setting}, args, prefix="vllm_refit")


if __name__ == "__main__":
    main()
