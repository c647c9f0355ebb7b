"""Per-rank checks of the sharded colocated refit into a tensor-parallel engine, without vLLM; run
under torchrun by tests/test_sharded_engine_refit.py (CPU, gloo, 2 ranks).

Usage: sharded_engine_check.py --hf CKPT --result DIR [--engine-tp N] [--tp N --ep N] [--fp8 | --fp8-refused]

Trainer rank r hosts engine rank r of an engine at TP N (default 2; ``tp_engine.TPEngine``: vLLM's
Qwen3 layout and loaders at ``tensor_parallel_size=N``, as many ranks as the engine) in its own process; the session is ``VLLMShardedRefit`` over an
in-process RPC (arguments pickled) with ``LocalTransport``, each rank reaching its own worker (as
vLLM's ``external_launcher`` would). Checks, failing with exit 1:
  * the first refit opens: nothing missing or unexpected, every tensor a shard, exactly the norms
    through the loader; the engine equals a ``TPEngine`` of the same rank loaded by its own loader
    from the checkpoint on disk, parameter by parameter, bit for bit;
  * after every trainer parameter changes in place, the next refit replays without reopening and
    the engine equals one loaded by its own loader from the stock export of the changed model;
  * an engine that keeps ``o_proj`` whole (its loader reads the whole tensor, the shard holds half
    of its columns) is refused on every rank, naming ``o_proj`` and the box.

``--fp8``: the engine holds blockwise FP8 weights (``TPEngine(quantized=...)``: every 2-D linear
weight but embeddings, output layer, norms and routers, the Qwen3 FP8 checkpoints' choice, written
here) and the refit runs with ``fp8="blockwise"``. The oracle of each refit is the HF tensors (the
checkpoint on disk, then the stock export of the changed model) quantized whole by the reference
quantizer (``fp8.reference.quantize_reference``) and loaded by the engine's own loaders, which cut
the weight and its ``weight_scale_inv`` to the rank's partition. ``--fp8-refused``: a model whose
engine boxes are off the 128-element block grid; the FP8 refit must be refused on every rank by
name (the tensor, the engine rank's box, the fix) before any shard is allocated or any worker called.
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import fnmatch
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_refit_check import InProcessLLM  # noqa: E402
from rank_checks import change_weights, checker_parser, checkpoint_session, fail, oracle, same_bytes  # noqa: E402
from tp_engine import TPEngine  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402


def worker_llm(engine: TPEngine, rank: int) -> InProcessLLM:
    """``collective_rpc`` into this rank's worker, which knows its engine rank as vLLM's does."""
    llm = InProcessLLM(engine)
    llm.worker.parallel_config = SimpleNamespace(rank=rank, world_size=engine.tp, data_parallel_index=0)
    return llm


# What Qwen3 / Qwen3-MoE FP8 checkpoints keep in BF16, written here independently of fp8.keep.
KEPT_IN_BF16 = ("*embed_tokens.weight", "lm_head.weight", "*norm.weight", "*.mlp.gate.weight")


def quantized_names(shapes: dict[str, tuple[int, ...]]) -> frozenset[str]:
    return frozenset(
        name
        for name, shape in shapes.items()
        if len(shape) == 2 and name.endswith(".weight") and not any(fnmatch.fnmatch(name, p) for p in KEPT_IN_BF16)
    )


def quantized_whole(tensors: dict[str, torch.Tensor], quantized: frozenset[str]) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of ``tensors``: each quantized weight by the reference quantizer, applied to
    the whole HF tensor, and its ``weight_scale_inv``; the rest as it is."""
    from mbridge_refit.fp8.reference import quantize_reference

    out = {}
    for name, tensor in tensors.items():
        if name in quantized:
            out[name], out[name + "_scale_inv"] = quantize_reference(tensor)
        else:
            out[name] = tensor
    return out


def loaded_by_its_loader(
    shapes, config, rank: int, tp: int, tensors: dict[str, torch.Tensor], quantized=()
) -> TPEngine:
    engine = TPEngine(shapes, config, rank=rank, tp=tp, quantized=quantized)
    if quantized:
        tensors = quantized_whole(tensors, frozenset(quantized))
    with torch.no_grad():
        engine.load_weights(tensors.items())
    return engine


def engine_equals(engine: TPEngine, reference: TPEngine, what: str) -> None:
    actual, expected = engine.named_engine_parameters(), reference.named_engine_parameters()
    wrong = [n for n in expected if not same_bytes(actual[n], expected[n])]
    if wrong or set(actual) != set(expected):
        fail(f"{what}: {len(wrong)} engine parameter(s) differ from the engine's own load, e.g. {wrong[:4]}")


def main() -> None:
    parser = checker_parser()
    parser.add_argument("--engine-tp", type=int, default=2)
    fp8_mode = parser.add_mutually_exclusive_group()
    fp8_mode.add_argument("--fp8", action="store_true", help="an FP8 engine, refit with fp8='blockwise'")
    fp8_mode.add_argument("--fp8-refused", action="store_true", help="expect the FP8 refit refused by name")
    args = parser.parse_args()
    tp = args.engine_tp
    layout = layout_from_flags(args)
    if args.fp8_refused:
        return refused_fp8(args, layout)

    from mbridge_refit.engines.ipc.sharded import ShardedRefitError
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.vllm import VLLMShardedRefit

    read = oracle(args.hf)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        rank = dist.get_rank()
        config = bridge.hf_pretrained.config
        entries = bridge.export_plan(chunks).entries
        shapes = {e.hf_name: tuple(e.shape) for e in entries}
        on_disk = {name: read(name) for name in shapes}
        quantized = quantized_names(shapes) if args.fp8 else frozenset()
        fp8 = "blockwise" if args.fp8 else None

        engine = TPEngine(shapes, config, rank=rank, tp=tp, quantized=quantized)
        llm = worker_llm(engine, rank)
        refit = VLLMShardedRefit(llm, engine=f"tp{tp}", transport=LocalTransport())
        first = refit.refit(bridge, chunks, fp8=fp8)
        report = first.report or {}
        if not first.opened or report.get("missing") or report.get("unexpected"):
            fail(f"first refit: expected a clean open, got {report}")
        expected_shards = len(shapes) + len(quantized)  # with FP8, each quantized weight's scale is a shard too
        if report["shards"] != expected_shards or not all(n.endswith("norm.weight") for n in report["via_loader"]):
            fail(f"first refit: expected {expected_shards} shards and only norms via the loader, got {report}")
        if args.fp8 and not quantized:
            fail("the FP8 check quantizes nothing")
        engine_equals(
            engine,
            loaded_by_its_loader(shapes, config, rank, tp, on_disk, quantized),
            "first refit vs checkpoint on disk",
        )

        changed = change_weights(bridge, chunks)
        second = refit.refit(bridge, chunks, fp8=fp8)
        if second.opened:
            fail("second refit reopened although nothing changed but the weights")
        engine_equals(
            engine,
            loaded_by_its_loader(shapes, config, rank, tp, changed, quantized),
            "second refit vs the changed model",
        )
        if llm.prefix_cache_resets != 2:
            fail(f"each refit resets the engine's prefix cache once: 2 refits, {llm.prefix_cache_resets} resets")
        moved = refit.plan.bytes_moved
        refit.close()

        other = TPEngine(shapes, config, rank=rank, tp=tp, full_size=(".self_attn.o_proj.",), quantized=quantized)
        other_llm = worker_llm(other, rank)
        mismatched = VLLMShardedRefit(other_llm, engine=f"tp{tp}", transport=LocalTransport())
        try:
            mismatched.refit(bridge, chunks, fp8=fp8)
            fail("an engine whose o_proj loader reads outside the shard was not refused")
        except ShardedRefitError as err:
            message = str(err)
        if "o_proj" not in message or "holds" not in message:
            fail(f"the refusal does not name o_proj and the shard's box: {message}")
        if other_llm.prefix_cache_resets:
            fail("a refused open reset the prefix cache as if it had written the weights")

        result = {
            "rank": rank,
            "ok": True,
            "tensors": first.tensors,
            "quantized": len(quantized),
            "copies": report["copies"],
            "via_loader": len(report["via_loader"]),
            "bytes_moved": moved,
            "refusal": message[:300],
        }
        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(json.dumps(result))


def refused_fp8(args, layout) -> None:
    """An FP8 refit into a layout off the block grid: refused by name on every rank, nothing allocated
    or sent, no worker called, the engine untouched."""
    from mbridge_refit.engines.ipc.sharing import LocalTransport
    from mbridge_refit.engines.vllm import VLLMShardedRefit
    from mbridge_refit.errors import InputError

    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        rank = dist.get_rank()
        shapes = {e.hf_name: tuple(e.shape) for e in bridge.export_plan(chunks).entries}
        engine = TPEngine(shapes, bridge.hf_pretrained.config, rank=rank, tp=args.engine_tp)
        llm = worker_llm(engine, rank)
        refit = VLLMShardedRefit(llm, engine=f"tp{args.engine_tp}", transport=LocalTransport())
        try:
            refit.refit(bridge, chunks, fp8="blockwise")
            fail("an FP8 refit into boxes off the 128-element block grid was not refused")
        except InputError as err:
            message = str(err)
        named = [
            "layers.0.mlp.gate_proj.weight (128, 64): engine rank 1 keeps [[64, 128], [0, 64]]",
            "smaller tensor-parallel size",
            "refit this engine with full tensors",
            "keep these weights in bf16 (keep_patterns)",
        ]
        if not all(needle in message for needle in named):
            fail(f"the refusal does not name the tensor, the box and the fix ({named}): {message}")
        if refit.shards or llm.timeouts or llm.prefix_cache_resets:
            fail("the refused FP8 refit allocated shards or called the engine before refusing")
        if any(p.count_nonzero() for p in engine.named_engine_parameters().values()):
            fail("the refused FP8 refit wrote into the engine")
        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "ok": True, "refusal": message[:600]}))


if __name__ == "__main__":
    main()
