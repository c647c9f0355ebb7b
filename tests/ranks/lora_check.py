"""Per-rank checks of LoRA refit; run under torchrun by tests/test_lora.py (CPU, gloo).

Usage: lora_check.py --hf CKPT --result DIR [--tp N --pp N --ep N] [--targets a,b] [--expect-fallback TEXT]

Every rank loads the checkpoint into its shard of the model and wraps it with Megatron-Bridge's own
``LoRA`` (``megatron.bridge.peft.lora``), as a PEFT training run does, then gives every adapter
parameter random values (B included, which LoRA zero-initialises: a merge that dropped it would
pass), seeded by name and by the ranks that hold different shards, so replicas agree. The oracle is
a plain Megatron-Bridge ``AutoBridge`` on the same model: ``export_hf_weights(merge_adapter_weights=
True)`` and ``export_adapter_weights``, compared name by name, in order, bit for bit. Checks:

  * merged export, cache on, twice: equal to stock's merged export, on the plan (no fallback) unless
    ``--expect-fallback`` names the reason; adapted weights differ from stock's unmerged ones; no
    buffer allocated by the second export;
  * the adapters changed in place (an optimizer step): the next cached export equals stock's export
    of the changed model, and differs from the previous one where adapters are;
  * merge_adapter_weights=False: the stock path (named), equal to stock;
  * adapter export: equal to stock's, names in PEFT's layout; ``adapter_facts`` equal to what
    Megatron-Bridge infers for adapter_config.json from stock's tensors;
  * NeMo-RL's ``conversion_tasks`` (all and a part) and the bucket API: equal to stock's merged export;
  * ``live_rows`` names no adapted weight; a transfer plan is refused;
  * FP8 on top: the merged weights quantized as the reference quantizer quantizes stock's merged
    tensors (refused by name where the adapters have no plan);
  * stock's ``save_hf_adapter`` through RefitBridge writes stock's PEFT checkpoint (config and tensors).
Writes DIR/rank<R>.json with each check's verdict.
"""

from __future__ import annotations

import json
import sys
import traceback
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rank_checks import checker_parser, checkpoint_session, same_bytes  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402

RANK, ALPHA = 4, 8


class CheckFailed(AssertionError):
    pass


def snapshot(stream) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.detach().cpu().clone()) for name, tensor in stream]


def expect_same(ours, stock, what: str) -> None:
    names, stock_names = [n for n, _ in ours], [n for n, _ in stock]
    if names != stock_names:
        first = next(
            (i for i, (a, b) in enumerate(zip(names, stock_names)) if a != b), min(len(names), len(stock_names))
        )
        raise CheckFailed(f"{what}: {len(names)} names vs stock's {len(stock_names)}; first difference at {first}")
    different = [name for (name, a), (_, b) in zip(ours, stock) if not same_bytes(a, b)]
    if different:
        raise CheckFailed(f"{what}: {len(different)} tensor(s) differ from stock's, e.g. {different[:3]}")


def adapter_params(chunks) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"{stage}/{n}", p) for stage, c in enumerate(chunks) for n, p in c.named_parameters() if ".adapter." in n]


def seed_adapters(chunks) -> None:
    """Random adapter values, the same on replicas: seeded by local name, stage and the ranks whose shards differ."""
    from megatron.core import parallel_state as ps

    for name, param in adapter_params(chunks):
        ep = ps.get_expert_model_parallel_rank() if "experts" in name else 0
        key = f"{ps.get_pipeline_model_parallel_rank()}/{name}/{ps.get_tensor_model_parallel_rank()}/{ep}"
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def check_merged(bridge, stock, chunks, expect_fallback: str | None) -> None:
    reference = snapshot(stock.export_hf_weights(chunks, show_progress=False, cpu=True, merge_adapter_weights=True))
    unmerged = dict(snapshot(stock.export_hf_weights(chunks, show_progress=False, merge_adapter_weights=False)))
    merged_names = [
        n for n, t in reference if not same_bytes(t, unmerged.get(n.replace(".weight", ".base_layer.weight"), t))
    ]
    if not merged_names:
        raise CheckFailed("no adapted weight differs from its base: the adapters change nothing")
    for call in range(2):
        ours = snapshot(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
        reason = bridge.export_diagnostics().fallback_reason
        if expect_fallback is None and reason is not None:
            raise CheckFailed(f"merged export fell back to stock: {reason}")
        if expect_fallback is not None and (reason is None or expect_fallback not in reason):
            raise CheckFailed(f"expected a fallback naming {expect_fallback!r}, got {reason!r}")
        expect_same(ours, reference, f"merged export, call {call + 1}")
        if call == 0:
            allocations = bridge.export_diagnostics().allocations
    if expect_fallback is None and bridge.export_diagnostics().allocations != allocations:
        raise CheckFailed(f"the second cached export allocated {bridge.export_diagnostics().allocations - allocations}")


def check_changed_adapter(bridge, stock, chunks, expect_fallback: str | None) -> None:
    before = snapshot(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
    with torch.no_grad():
        for _, param in adapter_params(chunks):
            param.add_(0.03)
    after = snapshot(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
    reference = snapshot(stock.export_hf_weights(chunks, show_progress=False, cpu=True, merge_adapter_weights=True))
    expect_same(after, reference, "merged export after the adapters changed")
    if all(same_bytes(a, b) for (_, a), (_, b) in zip(before, after)):
        raise CheckFailed("the changed adapters do not show in the next export")


def check_unmerged(bridge, stock, chunks, expect_fallback: str | None) -> None:
    ours = snapshot(bridge.export_hf_weights(chunks, show_progress=False, merge_adapter_weights=False))
    reason = bridge.export_diagnostics().fallback_reason or ""
    if "merge_adapter_weights=False" not in reason and expect_fallback is None:
        raise CheckFailed(f"merge_adapter_weights=False did not run stock: {reason!r}")
    expect_same(
        ours, snapshot(stock.export_hf_weights(chunks, show_progress=False, merge_adapter_weights=False)), "unmerged"
    )


def check_adapter_export(bridge, stock, chunks, expect_fallback: str | None) -> None:
    from megatron.bridge.models.conversion.peft_bridge import (
        infer_rank_pattern_from_adapter_weights,
        infer_target_modules_from_adapter_weights,
    )

    reference = list(stock.export_adapter_weights(chunks, show_progress=False))
    for cached in (False, True):
        ours = snapshot(bridge.export_adapter_weights(chunks, show_progress=False, reuse_buffer_from_cache=cached))
        if expect_fallback is None and bridge.export_diagnostics().fallback_reason is not None:
            raise CheckFailed(f"adapter export fell back: {bridge.export_diagnostics().fallback_reason}")
        expect_same(ours, [(t.param_name, t.weight) for t in reference], f"adapter export (cache {cached})")
    if any(not n.endswith((".lora_A.weight", ".lora_B.weight")) for n, _ in ours):
        raise CheckFailed("adapter names are not PEFT's")
    if expect_fallback is not None:
        return
    facts = bridge.adapter_facts(chunks)
    expected = {
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": infer_target_modules_from_adapter_weights(t.param_name for t in reference),
        "rank_pattern": infer_rank_pattern_from_adapter_weights(reference, default_rank=RANK),
        "alpha_pattern": {},
    }
    if facts != expected:
        raise CheckFailed(f"adapter_facts {facts} != {expected}")


def check_consumers(bridge, stock, chunks, expect_fallback: str | None) -> None:
    """Readers of parameters in place never see an adapted weight as live, and refuse to ship it unmerged."""
    from mbridge_refit.plan.entries import PlanError

    live = bridge.live_rows(chunks)
    adapted = {
        n.replace(".base_layer.weight", ".weight")
        for n, _ in stock.export_hf_weights(chunks, show_progress=False, merge_adapter_weights=False)
        if ".base_layer." in n
    }
    if set(live) & adapted:
        raise CheckFailed(f"live_rows names adapted weights: {sorted(set(live) & adapted)[:3]}")
    if expect_fallback is None:
        try:
            bridge.transfer_plan(chunks, "tp1")
        except PlanError as err:
            if "LoRA" not in str(err):
                raise
        else:
            raise CheckFailed("a transfer plan of an adapted model was not refused")


def check_stock_calls(bridge, stock, chunks, expect_fallback: str | None) -> None:
    """The calls RL frameworks make: NeMo-RL's ``conversion_tasks`` (all, ``None`` dropped, and a part) and the
    bucket API, merged as stock merges them."""
    tasks = [t for t in bridge.get_conversion_tasks(chunks) if t is not None]
    stock_tasks = [t for t in stock.get_conversion_tasks(chunks) if t is not None]
    for part in (slice(None), slice(len(tasks) // 3, 2 * len(tasks) // 3)):
        ours = snapshot(bridge.export_hf_weights(chunks, show_progress=False, conversion_tasks=tasks[part]))
        reason = bridge.export_diagnostics().fallback_reason
        if expect_fallback is None and reason is not None:
            raise CheckFailed(f"conversion_tasks fell back to stock: {reason}")
        reference = stock.export_hf_weights(chunks, show_progress=False, conversion_tasks=stock_tasks[part])
        expect_same(ours, snapshot(reference), f"conversion_tasks[{part.start}:{part.stop}]")
    buckets = bridge.export_hf_weight_buckets(chunks, show_progress=False, reuse_buffer_from_cache=True)
    ours = [(name, tensor.clone()) for bucket in buckets for name, tensor in bucket]
    expect_same(ours, snapshot(stock.export_hf_weights(chunks, show_progress=False, cpu=True)), "bucket API")


def check_fp8_merged(bridge, stock, chunks, expect_fallback: str | None) -> None:
    """FP8 on top: the merged weights quantized, as the reference quantizer quantizes stock's merged tensors."""
    from mbridge_refit.fp8.format import FP8FormatError
    from mbridge_refit.testing.export_comparison import compare_stream, fp8_expected

    config = bridge.fp8_config("blockwise")
    if expect_fallback is not None:
        try:
            list(bridge.export_hf_weights(chunks, show_progress=False, fp8=config))
        except FP8FormatError as err:
            if expect_fallback not in str(err):
                raise CheckFailed(f"the FP8 refusal does not name {expect_fallback!r}: {err}") from err
            return
        raise CheckFailed("an FP8 export of adapters with no merge plan was not refused")
    reference = snapshot(stock.export_hf_weights(chunks, show_progress=False, cpu=True, merge_adapter_weights=True))
    for call in range(2):
        stream = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8=config)
        comparison = compare_stream(fp8_expected(reference, config), stream)
        if comparison.differing or comparison.missing or comparison.unexpected or not comparison.in_order:
            raise CheckFailed(f"FP8 merged export, call {call + 1}: {comparison}")


def check_peft_checkpoint(bridge, stock, chunks, expect_fallback: str | None) -> None:
    """Stock's ``save_hf_adapter`` through RefitBridge's adapter export writes stock's checkpoint."""
    from safetensors.torch import load_file

    out = RESULT / "peft"
    bridge.save_hf_adapter(chunks, out / "ours", peft_config=LORA, show_progress=False)
    stock.save_hf_adapter(chunks, out / "stock", peft_config=LORA, show_progress=False)
    if dist.get_rank() != 0:
        return
    configs = [json.loads((out / side / "adapter_config.json").read_text()) for side in ("ours", "stock")]
    if configs[0] != configs[1]:
        raise CheckFailed(f"adapter_config.json differs: {configs[0]} vs {configs[1]}")
    ours, theirs = (load_file(out / side / "adapter_model.safetensors") for side in ("ours", "stock"))
    if sorted(ours) != sorted(theirs) or not all(same_bytes(ours[k], theirs[k]) for k in ours):
        raise CheckFailed("adapter_model.safetensors differs from stock's")
    if not all(k.startswith("base_model.model.") for k in ours):
        raise CheckFailed(f"not PEFT's names: {sorted(ours)[:2]}")


def check_factors_replaced(bridge, stock, chunks, expect_fallback: str | None) -> None:
    """Factors the model replaced since the last export (``module.weight = Parameter(...)``) are the ones
    the next exports read, merged and adapter-only, after ``release_export_buffers`` too; a factor whose
    dtype changed in place (``.data`` swapped for fp32) is refused by name when the export is called, before any
    collective (so every rank refuses alike), never read as the plan's dtype."""
    from mbridge_refit.runtime.live_params import ModelChangedError

    list(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))  # planned, factors held
    replaced = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if ".adapter." in name and "weight" in module._parameters:
                module.weight = torch.nn.Parameter(module.weight.detach() * 1.5 + 0.01)
                replaced.append(module.weight)
    if not replaced:
        raise CheckFailed("no adapter factor to replace")
    reference = snapshot(stock.export_hf_weights(chunks, show_progress=False, cpu=True, merge_adapter_weights=True))
    merged = snapshot(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
    expect_same(merged, reference, "merged export after the factors were replaced")
    stock_factors = [(t.param_name, t.weight) for t in stock.export_adapter_weights(chunks, show_progress=False)]
    expect_same(snapshot(bridge.export_adapter_weights(chunks, show_progress=False)), stock_factors, "factors replaced")
    bridge.release_export_buffers()
    again = snapshot(bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True))
    expect_same(again, reference, "merged export after release_export_buffers")
    replaced[0].data = replaced[0].data.float()
    try:  # refused by the call itself, before any collective (every rank alike), not by its gathers
        stream = bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)
    except ModelChangedError as err:
        if "float32" not in str(err) or ".adapter." not in str(err):
            raise CheckFailed(f"the refusal does not name the factor and its new dtype: {err}") from err
        return
    try:
        list(stream)
    except ModelChangedError as err:
        raise CheckFailed(f"a factor whose dtype changed in place was refused only while exporting: {err}") from err
    raise CheckFailed("a factor whose dtype changed in place was exported")


CHECKS = {
    "merged": check_merged,
    "changed_adapter": check_changed_adapter,
    "unmerged": check_unmerged,
    "adapter_export": check_adapter_export,
    "consumers": check_consumers,
    "stock_calls": check_stock_calls,
    "fp8_merged": check_fp8_merged,
    "peft_checkpoint": check_peft_checkpoint,
}
ON_REQUEST = {"factors_replaced": check_factors_replaced}  # by --checks only: it leaves a factor in another dtype
LORA = None  # the LoRA the model was wrapped with (its config goes into adapter_config.json)
RESULT = None


def main() -> None:
    parser = checker_parser()
    parser.add_argument("--targets", default="")
    parser.add_argument("--expect-fallback", default=None)
    parser.add_argument("--checks", default=",".join(CHECKS))
    args = parser.parse_args()
    verdicts = {}
    with checkpoint_session(args.hf, layout_from_flags(args)) as (bridge, chunks):
        from megatron.bridge import AutoBridge
        from megatron.bridge.peft.lora import LoRA

        global LORA, RESULT
        targets = {"target_modules": args.targets.split(",")} if args.targets else {}
        LORA, RESULT = LoRA(dim=RANK, alpha=ALPHA, **targets), args.result
        chunks = LORA(chunks, training=True)
        seed_adapters(chunks)
        stock = AutoBridge.from_hf_pretrained(args.hf)
        for name in args.checks.split(","):
            try:
                {**CHECKS, **ON_REQUEST}[name](bridge, stock, chunks, args.expect_fallback)
                verdicts[name] = None
            except CheckFailed as err:
                verdicts[name] = str(err)
            except Exception:
                verdicts[name] = traceback.format_exc()[-3000:]
            (args.result / f"rank{dist.get_rank()}.json").write_text(json.dumps(verdicts, indent=1))


if __name__ == "__main__":
    main()
