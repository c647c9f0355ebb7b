"""GPU check: FP8 export of a model that keeps Transformer Engine FP8 parameters.

    torchrun --nproc-per-node 2 scripts/check_te_fp8_params.py --model qwen3-8b --layers 2 --tp 2
    torchrun --nproc-per-node 2 scripts/check_te_fp8_params.py --model qwen3-30b-a3b --layers 2 --ep 2

Builds the shape (``--layers`` decoder layers) with Megatron's TE layer spec and
``fp8="e4m3", fp8_recipe="blockwise", fp8_param=True``: every linear weight is a TE
``Float8BlockwiseQTensor``. Then checks, failing with exit 1:

1. ``RefitBridge.export_hf_weights(model, fp8="blockwise", reuse_buffer_from_cache=True)``
   yields, for every quantized HF weight, bytes and ``weight_scale_inv`` equal to TE's own
   row-wise data and scale_inv of the trainer's shards, split and joined *here* by an
   independent reading of Megatron's layouts (fused QKV by query group, gate/up halves,
   row-parallel columns, grouped-GEMM experts ``weight{i}`` on their EP rank);
2. dequantized, they equal stock ``AutoBridge.export_hf_weights`` of the same model (which
   dequantizes each shard with TE), bit for bit; and RefitBridge's BF16 export equals stock too;
3. with ``--check-refusal``: a model built with the ``tensorwise`` recipe (TE ``Float8Tensor``)
   is refused with ``FP8FormatError`` before any tensor is exported.

Also times the cached FP8 export against the cached BF16 export of the same model. Writes
``te_fp8_params_<model>_<layout>.json`` with its manifest to --out-dir (default benchmarks/results/<date>-<device>/).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from provenance import results_dir, write_result

BLOCK = 128


def build(args, recipe: str):
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.models.builder import BuildOptions, build_model
    from mbridge_refit.models.recipes import full_size_config
    from mbridge_refit.plan.layout import ParallelLayout

    config = full_size_config(args.model)
    config.num_hidden_layers = args.layers
    if args.experts:
        config.num_experts = args.experts
    bridge = RefitBridge.from_hf_config(config)
    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    options = BuildOptions(device=torch.device("cuda"), params_dtype=torch.bfloat16, fp8_param_recipe=recipe)
    return config, bridge, build_model(bridge, layout, options)


def local_fp8_params(chunks) -> dict:
    """This rank's TE FP8 weights by the module's own parameter name (``decoder.layers.0.mlp.
    experts.linear_fc1.weight3``: expert numbers are *local* to the EP rank, layer numbers are
    global as long as PP is 1): row-wise e4m3 data as uint8 and scale_inv with TE's padding
    trimmed, on CPU. Read from ``named_parameters`` directly, not through Megatron-Bridge's
    conversion tasks (whose global names renumber experts), so the oracle shares no naming code
    with the export under test."""
    from megatron.core import parallel_state as ps

    found = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if not hasattr(param, "get_metadata"):
                continue
            meta = param.get_metadata()
            if not meta.get("is_2D_scaled") or meta.get("rowwise_data") is None:
                continue
            data = meta["rowwise_data"].cpu()
            cols = math.ceil(data.shape[1] / BLOCK)
            while name.startswith("module."):
                name = name.removeprefix("module.")
            found[name] = (data, meta["rowwise_scale_inv"][:, :cols].cpu().contiguous())
    return {"tp": ps.get_tensor_model_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(), "params": found}


def expected_hf_fp8(config, per_rank: list[dict], tp: int, ep: int) -> dict[str, torch.Tensor]:
    """HF name -> uint8 data or fp32 scale, joined from every rank's TE shards (this file's own
    reading of Megatron's layouts: fused QKV grouped by query group, fc1 = [gate; up], row-parallel
    weights split by columns, TE grouped-GEMM experts ``weight{i}`` numbered per EP rank)."""
    heads, groups, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_group = heads // groups
    experts_per_rank = (getattr(config, "num_experts", 0) or 0) // ep
    by_tp = {}
    for rank in per_rank:
        if rank["ep"] == 0 or experts_per_rank == 0:
            by_tp.setdefault(rank["tp"], rank["params"])
    out: dict[str, torch.Tensor] = {}

    def put(hf: str, data: torch.Tensor, scale: torch.Tensor) -> None:
        out[hf + ".weight"], out[hf + ".weight_scale_inv"] = data, scale

    for layer in range(config.num_hidden_layers):
        prefix, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        for kind, index in (("data", 0), ("scale", 1)):
            unit = 1 if kind == "data" else BLOCK
            qkv = [by_tp[r][prefix + "self_attention.linear_qkv.weight"][index] for r in range(tp)]
            parts = {"q": [], "k": [], "v": []}
            for shard in qkv:
                grouped = shard.reshape(groups // tp, (per_group + 2) * head_dim // unit, shard.shape[1])
                rows = head_dim // unit
                parts["q"].append(grouped[:, : per_group * rows].reshape(-1, shard.shape[1]))
                parts["k"].append(grouped[:, per_group * rows : (per_group + 1) * rows].reshape(-1, shard.shape[1]))
                parts["v"].append(grouped[:, (per_group + 1) * rows :].reshape(-1, shard.shape[1]))
            suffix = ".weight" if kind == "data" else ".weight_scale_inv"
            for name, pieces in parts.items():
                out[f"{hf}self_attn.{name}_proj{suffix}"] = torch.cat(pieces, 0)
            out[f"{hf}self_attn.o_proj{suffix}"] = torch.cat(
                [by_tp[r][prefix + "self_attention.linear_proj.weight"][index] for r in range(tp)], 1
            )
            if experts_per_rank == 0:
                fc1 = [by_tp[r][prefix + "mlp.linear_fc1.weight"][index] for r in range(tp)]
                out[f"{hf}mlp.gate_proj{suffix}"] = torch.cat([s[: s.shape[0] // 2] for s in fc1], 0)
                out[f"{hf}mlp.up_proj{suffix}"] = torch.cat([s[s.shape[0] // 2 :] for s in fc1], 0)
                out[f"{hf}mlp.down_proj{suffix}"] = torch.cat(
                    [by_tp[r][prefix + "mlp.linear_fc2.weight"][index] for r in range(tp)], 1
                )
                continue
            for rank in per_rank:
                for local in range(experts_per_rank):
                    expert = rank["ep"] * experts_per_rank + local
                    fc1 = rank["params"][f"{prefix}mlp.experts.linear_fc1.weight{local}"][index]
                    fc2 = rank["params"][f"{prefix}mlp.experts.linear_fc2.weight{local}"][index]
                    base = f"{hf}mlp.experts.{expert}."
                    out[f"{base}gate_proj{suffix}"] = fc1[: fc1.shape[0] // 2]
                    out[f"{base}up_proj{suffix}"] = fc1[fc1.shape[0] // 2 :]
                    out[f"{base}down_proj{suffix}"] = fc2
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def timed(make, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _name, _tensor in make():
            pass
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


_START = time.perf_counter()


@contextlib.contextmanager
def _report_first():
    """Print a failure's traceback before the session tears down: teardown can block while the
    other rank still waits in a collective, and the error would then never reach the log."""
    try:
        yield
    except Exception:
        phase("failed:\n" + traceback.format_exc())
        raise


@contextlib.contextmanager
def _recorded(problems: list[str], doing: str):
    """Record an exception in a rank-0-only check as a problem instead of raising: the other
    ranks are about to enter collectives that rank 0 must join."""
    try:
        yield
    except Exception as err:
        problems.append(f"error while {doing}: {type(err).__name__}: {err}")
        phase(f"error while {doing}:\n" + traceback.format_exc())


def phase(what: str) -> None:
    """Progress on stderr with the elapsed time, so a stuck step is visible in the log."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    print(f"[rank{rank} {time.perf_counter() - _START:7.1f}s] {what}", file=sys.stderr, flush=True)


def check_refusal(args) -> str:
    """A non-blockwise FP8 recipe must be refused before any export work."""
    from mbridge_refit.fp8.format import FP8FormatError

    _, bridge, chunks = build(args, "tensorwise")
    try:
        next(iter(bridge.export_hf_weights(chunks, fp8="blockwise", show_progress=False)))
    except FP8FormatError as err:
        return str(err)
    raise SystemExit("a tensorwise-recipe FP8 model was not refused by the blockwise FP8 export")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", help="a shape in recipes/shapes/")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers to build (default: %(default)s)")
    parser.add_argument(
        "--experts", type=int, default=None, help="MoE: override the number of experts (default: the shape's)"
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument(
        "--check-refusal", action="store_true", help="also build a tensorwise-recipe model and expect a refusal"
    )
    parser.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/<date>-<device>/")
    parser.add_argument(
        "--stack-dump-s",
        type=float,
        default=None,
        help="print every thread's Python stack and exit after this many seconds (diagnosing a stuck rank)",
    )
    args = parser.parse_args()
    if args.stack_dump_s:
        import faulthandler

        faulthandler.dump_traceback_later(args.stack_dump_s, exit=True)

    from megatron.bridge import AutoBridge

    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.fp8.reference import dequantize_blockwise
    from mbridge_refit.plan.layout import ParallelLayout
    from mbridge_refit.plan.storage import FP8_BLOCKWISE

    layout = ParallelLayout(tp=args.tp, ep=args.ep)
    # A short collective timeout: a rank stuck in a collective fails with the collective's name.
    with (
        distributed_session(layout, device=torch.device("cuda"), timeout=datetime.timedelta(seconds=120)) as env,
        _report_first(),
    ):
        phase("build the FP8-parameter model")
        config, bridge, chunks = build(args, "blockwise")
        phase("plan")
        plan = bridge.export_plan(chunks, fp8="blockwise")
        shipped = [e for e in plan.entries if e.scale_of is not None and e.source_format == FP8_BLOCKWISE]
        phase("gather TE's shards (oracle)")
        gathered = [None] * env.world_size
        dist.all_gather_object(gathered, local_fp8_params(chunks))
        phase("FP8 export")
        exported = {}
        for name, tensor in bridge.export_hf_weights(
            chunks, fp8="blockwise", reuse_buffer_from_cache=True, show_progress=False
        ):
            if env.rank == 0 and (tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv")):
                exported[name] = tensor.cpu()
        problems, compared = [], 0
        if env.rank == 0:
            with _recorded(problems, "comparing with TE's shards"):  # rank 0 only: must not skip the collectives below
                expected = expected_hf_fp8(config, gathered, args.tp, args.ep)
                missing = sorted(set(exported) ^ set(expected))
                if missing:
                    problems.append(f"names differ between the export and TE's shards: {missing[:6]}")
                for name in sorted(set(exported) & set(expected)):
                    compared += 1
                    if not same_bytes(exported[name], expected[name]):
                        problems.append(f"{name} differs from TE's own data/scale")
        phase("stock BF16 export vs RefitBridge BF16 export")
        stock = AutoBridge.from_hf_config(bridge.hf_pretrained)
        dequant_checked = bf16_checked = 0
        for (name, want), (name2, got) in zip(
            stock.export_hf_weights(chunks, cpu=False, show_progress=False),
            bridge.export_hf_weights(chunks, show_progress=False),
            strict=True,
        ):
            if env.rank != 0:
                continue
            with _recorded(problems, f"comparing {name2} with stock's {name}"):
                bf16_checked += 1
                if name != name2 or not same_bytes(got, want):
                    problems.append(f"BF16 export {name2} differs from stock {name}")
                if name in exported:
                    dequant_checked += 1
                    dequant = dequantize_blockwise(exported[name].cuda(), exported[name + "_scale_inv"].cuda()).to(
                        want.dtype
                    )
                    if not same_bytes(dequant, want):
                        problems.append(f"{name}: dequantized FP8 export differs from stock BF16 export")
        phase("timing")
        fp8_ms = timed(
            lambda: bridge.export_hf_weights(chunks, fp8="blockwise", reuse_buffer_from_cache=True, show_progress=False)
        )
        bf16_ms = timed(lambda: bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False))
        refusal = check_refusal(args) if args.check_refusal else None
        if env.rank == 0:
            row = dict(
                device=torch.cuda.get_device_name(),
                world_size=env.world_size,
                model=args.model,
                layers=args.layers,
                layout=layout.name,
                plan_entries=len(plan.entries),
                scales_from_fp8_params=len(shipped),
                tensors_compared_with_te=compared,
                dequantized_compared_with_stock=dequant_checked,
                bf16_tensors_compared_with_stock=bf16_checked,
                problems=problems[:20],
                passed=not problems and compared > 0,
                fp8_cached_steady_ms=fp8_ms,
                bf16_cached_steady_ms=bf16_ms,
                refusal_message=refusal,
                torch=torch.__version__,
                date=datetime.date.today().isoformat(),
            )
            print(json.dumps(row, indent=1), flush=True)
            write_result(args.out_dir or results_dir(), f"te_fp8_params_{args.model}_{layout.name}.json", row)
            if not row["passed"]:
                sys.exit(1)


if __name__ == "__main__":
    main()
