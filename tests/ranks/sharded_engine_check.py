"""Per-rank checks of the sharded colocated refit into a tensor-parallel engine, without vLLM; run
under torchrun by tests/test_sharded_engine_refit.py (CPU, gloo, 2 ranks).

Usage: sharded_engine_check.py --hf CKPT --result DIR [--engine-tp N] [--tp N --ep N]

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
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

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


def loaded_by_its_loader(shapes, config, rank: int, tp: int, tensors: dict[str, torch.Tensor]) -> TPEngine:
    engine = TPEngine(shapes, config, rank=rank, tp=tp)
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
    args = parser.parse_args()
    tp = args.engine_tp
    layout = layout_from_flags(args)

    from mbridge_refit.engines.sharded_ipc import ShardedRefitError
    from mbridge_refit.engines.sharing import LocalTransport
    from mbridge_refit.engines.vllm import VLLMShardedRefit

    read = oracle(args.hf)
    with checkpoint_session(args.hf, layout) as (bridge, chunks):
        rank = dist.get_rank()
        config = bridge.hf_pretrained.config
        entries = bridge.export_plan(chunks).entries
        shapes = {e.hf_name: tuple(e.shape) for e in entries}
        on_disk = {name: read(name) for name in shapes}

        engine = TPEngine(shapes, config, rank=rank, tp=tp)
        llm = worker_llm(engine, rank)
        refit = VLLMShardedRefit(llm, engine=f"tp{tp}", transport=LocalTransport())
        first = refit.refit(bridge, chunks)
        report = first.report or {}
        if not first.opened or report.get("missing") or report.get("unexpected"):
            fail(f"first refit: expected a clean open, got {report}")
        if report["shards"] != len(shapes) or not all(n.endswith("norm.weight") for n in report["via_loader"]):
            fail(f"first refit: expected {len(shapes)} shards and only norms via the loader, got {report}")
        engine_equals(
            engine, loaded_by_its_loader(shapes, config, rank, tp, on_disk), "first refit vs checkpoint on disk"
        )

        changed = change_weights(bridge, chunks)
        second = refit.refit(bridge, chunks)
        if second.opened:
            fail("second refit reopened although nothing changed but the weights")
        engine_equals(
            engine, loaded_by_its_loader(shapes, config, rank, tp, changed), "second refit vs the changed model"
        )
        if llm.prefix_cache_resets != 2:
            fail(f"each refit resets the engine's prefix cache once: 2 refits, {llm.prefix_cache_resets} resets")
        moved = refit.plan.bytes_moved
        refit.close()

        other = TPEngine(shapes, config, rank=rank, tp=tp, full_size=(".self_attn.o_proj.",))
        other_llm = worker_llm(other, rank)
        mismatched = VLLMShardedRefit(other_llm, engine=f"tp{tp}", transport=LocalTransport())
        try:
            mismatched.refit(bridge, chunks)
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
            "copies": report["copies"],
            "via_loader": len(report["via_loader"]),
            "bytes_moved": moved,
            "refusal": message[:300],
        }
        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
