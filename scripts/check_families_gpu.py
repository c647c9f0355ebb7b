"""Every architecture Megatron-Bridge registers, at TP1 on one GPU with the Transformer Engine
spec: RefitBridge's export against stock ``export_hf_weights`` bit for bit, and its FP8 export
against the reference quantizer applied to stock's tensors.

    torchrun --nproc-per-node 1 scripts/check_families_gpu.py [--only Qwen3ForCausalLM,...]

The architectures come from ``AutoBridge.list_supported_models()`` (not a hand-written list).
Each gets a tiny config: transformers' own config class for its model type, with the size fields
it has set small (2 layers, hidden 256, 8 experts, ...), random weights from Megatron's GPU
initialisation. Each ends in one state:

* ``fast path, exact``: the plan covers the model and every tensor equals stock's;
* ``stock fallback, exact``: the plan cannot describe the model (the reason is recorded), the
  fallback is stock itself;
* ``cannot be built here``: building the config, the bridge or the model failed (the error);
* ``upstream broken``: stock's export itself failed;
* ``different``: a tensor differs from stock's (names the first ones), or ``our export failed``:
  both are bugs of ours until shown otherwise.

Writes ``families_tp1.json`` with its manifest (``scripts/provenance.py``).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import traceback
from pathlib import Path
from typing import Any

import torch

from provenance import results_dir, write_result

logger = logging.getLogger("check_families_gpu")

TEXT_SIZES = {
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 4096,
    "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128, "num_experts": 8, "num_local_experts": 8,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "n_group": 1, "topk_group": 1, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1,
}
VISION_SIZES = {"depth": 2, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4,
                "num_attention_heads": 4, "out_hidden_size": 256, "embed_dim": 256}


def tiny_config(architecture: str) -> Any:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    model_type = None
    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
                    modeling_auto.MODEL_MAPPING_NAMES):
        model_type = next((t for t, arch in mapping.items() if arch == architecture), None)
        if model_type:
            break
    if model_type is None or model_type not in CONFIG_MAPPING:
        raise LookupError(f"transformers {__import__('transformers').__version__} has no config class for {architecture}")
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    kwargs = _small(defaults, TEXT_SIZES)
    for nested, sizes in (("text_config", TEXT_SIZES), ("vision_config", VISION_SIZES)):
        sub = getattr(defaults, nested, None)
        if sub is not None:
            kwargs[nested] = {**sub.to_dict(), **_small(sub, sizes)}
    config = config_class(**kwargs)
    config.architectures = [architecture]
    config.torch_dtype = torch.bfloat16
    return config


def _small(config: Any, sizes: dict) -> dict:
    """The size fields ``config`` has, set small; hybrid models keep their first 4 layer types
    (a period of 4 holds one of each kind for the hybrids registered today)."""
    small = {k: v for k, v in sizes.items() if hasattr(config, k)}
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        small.update(num_hidden_layers=4, layer_types=list(layer_types[:4]))
    return small


def check(architecture: str) -> dict:
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.fp8.reference import quantize_reference
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.tools.model_builder import BuildOptions, build_model

    row: dict[str, Any] = {"architecture": architecture}
    try:
        bridge = RefitBridge.from_hf_config(tiny_config(architecture))
        chunks = build_model(bridge, ParallelLayout(), BuildOptions(device=torch.device("cuda"), params_dtype=torch.bfloat16))
    except Exception as err:  # recorded, the run goes on with the next architecture
        return {**row, "state": "cannot be built here", "reason": _reason(err)}
    try:
        stock = {name: tensor.clone() for name, tensor in bridge.export_hf_weights_stock(chunks, show_progress=False)}
    except Exception as err:
        return {**row, "state": "upstream broken", "reason": _reason(err)}
    try:
        ours = [(name, _same(tensor, stock.get(name)))
                for name, tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True)]
    except Exception as err:  # a bug of ours: recorded as such
        return {**row, "state": "our export failed", "reason": _reason(err)}
    differing = [name for name, same in ours if not same]
    names_equal = [name for name, _ in ours] == list(stock)
    fallback = bridge.export_diagnostics().fallback_reason
    row.update(tensors=len(stock), differing=differing[:10], same_names_in_order=names_equal, fallback_reason=fallback)
    if differing or not names_equal:
        return {**row, "state": "different"}
    row["state"] = "stock fallback, exact" if fallback else "fast path, exact"
    if not fallback:
        row.update(_check_fp8(bridge, chunks, stock, quantize_reference))
    return row


def _same(tensor: torch.Tensor, expected: torch.Tensor | None) -> bool:
    return (expected is not None and tensor.dtype == expected.dtype and tensor.shape == expected.shape
            and torch.equal(tensor.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)))


def _check_fp8(bridge, chunks, stock: dict, quantize_reference) -> dict:
    try:
        plan = bridge.export_plan(chunks, fp8="blockwise")
    except Exception as err:
        return {"fp8": "refused", "fp8_reason": _reason(err)}
    scales = {e.hf_name: e.scale_of for e in plan.entries if e.scale_of is not None}
    quantized, bad = set(scales.values()), []
    try:
        for name, tensor in bridge.export_hf_weights(chunks, show_progress=False, reuse_buffer_from_cache=True, fp8="blockwise"):
            if name in scales:
                expected = quantize_reference(stock[scales[name]])[1]
            elif name in quantized:
                expected = quantize_reference(stock[name])[0]
            else:
                expected = stock[name]
            if not _same(tensor, expected):
                bad.append(name)
    except Exception as err:
        return {"fp8": "failed", "fp8_reason": _reason(err)}
    return {"fp8": "exact" if not bad else "different", "fp8_quantized": len(quantized), "fp8_differing": bad[:10]}


def _reason(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    where = f" (at {frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {str(err)[:300]}{where}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated architectures (default: every registered one)")
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from megatron.bridge import AutoBridge

    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.tools.launch import distributed_session

    architectures = [a for a in args.only.split(",") if a] or sorted(AutoBridge.list_supported_models())
    rows = []
    with distributed_session(ParallelLayout(), device=torch.device("cuda"), timeout=datetime.timedelta(minutes=5)):
        for architecture in architectures:
            row = check(architecture)
            rows.append(row)
            print(f"{architecture:48s} {row['state']:24s} {row.get('fp8', '')} {row.get('reason') or row.get('fallback_reason') or ''}"[:400], flush=True)
            torch.cuda.empty_cache()
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    print(counts)
    path = write_result(args.out_dir or results_dir(), "families_tp1.json", {
        "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "counts": counts, "rows": rows,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
