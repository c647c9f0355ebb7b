"""Per-rank checks of the broadcast refit into an engine, without vLLM; run under torchrun by
tests/test_engine_refit.py (CPU, gloo).

Usage: engine_broadcast_check.py --hf CKPT --result DIR --port PORT [--tp N --pp N --ep N]

Every rank is a trainer rank; rank 0 is the source and holds the engine: ``EngineModel`` of
``engine_refit_check`` (laid out like vLLM, its own narrow-and-copy loader) behind
``RefitWorkerExtension``, called through an in-process ``collective_rpc`` (pickled arguments) from
``VLLMBroadcastRefit``'s thread. The engine worker joins a ``StoreGroup`` at ``--port`` with the
source, so it is in no ``torch.distributed`` world the trainer ranks share. Checks, failing with
exit 1:
  * the first refit: the engine equals the checkpoint on disk fused by ``expected_engine_state``;
  * the first refit records the engine's loader (``mode`` "recorded"); after the trainer's
    parameters change in place, each of the next two refits replays the recorded copies
    (``mode`` "replayed") and the engine equals the stock export of the changed model, fused the
    same way; norms (loaded through a temporary) go through the loader every step;
  * the engine's loader replaced after those refits by the GPU check's ``inject_load_fault`` (one
    that raises at its first tensor and puts the old one back): the next refit records it again
    and fails on every rank; the one after records the restored loader and is exact;
  * an engine whose loader changes a parameter where the recorder cannot see it: the first refit
    fails on the engine (the check against the loader) and on every trainer rank;
  * an engine whose loader reports the names it loaded and has one parameter no tensor reaches:
    the refit fails on the engine naming it, and on every trainer rank, without a hang;
  * an engine whose loader raises at the 5th tensor: that error on the source, RefitStatusError
    on the other trainer ranks, and the next refit is exact again (the group is still in step);
  * a worker holding another plan: PlanMismatchError on the source and the engine, no weight sent.
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_refit_check import (  # noqa: E402
    EngineModel,
    InProcessLLM,
    engine_equals,
    expected_engine_state,
)
from oracle import read_checkpoint  # noqa: E402
from rank_checks import change_weights, fail  # noqa: E402

from mbridge_refit.convert.flags import add_layout_flags, layout_from_flags  # noqa: E402
from mbridge_refit.testing.vllm_harness import inject_load_fault  # noqa: E402

SOURCE = 0


class ReportingEngine(EngineModel):
    """``EngineModel`` whose loader returns the parameter names it loaded (as vLLM's do), with one
    parameter (``extra``) that no HF tensor reaches."""

    def __init__(self, hf, *, extra: bool = False) -> None:
        super().__init__(hf)
        if extra:
            self.extra = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()

        def seen():
            from engine_refit_check import engine_name

            for name, tensor in weights:
                target, _, _ = engine_name(name)
                loaded.add("params." + target.replace(".", "__"))
                yield name, tensor

        super().load_weights(seen())
        return loaded


class FailingEngine(EngineModel):
    """A loader that raises at the 5th tensor it is given, counted over its calls (the broadcast
    target records it one tensor per call)."""

    def __init__(self, hf) -> None:
        super().__init__(hf)
        self.seen = 0

    def load_weights(self, weights):
        def until_fifth():
            for item in weights:
                self.seen += 1
                if self.seen == 5:
                    raise ValueError("test loader rejects the 5th tensor")
                yield item

        super().load_weights(until_fifth())


def outcome(action) -> dict:
    started = time.monotonic()
    try:
        action()
        return {"ok": True, "error": None, "seconds": round(time.monotonic() - started, 2)}
    except Exception as err:  # recorded; main decides whether it was expected
        return {"ok": False, "error": f"{type(err).__name__}: {err}", "seconds": round(time.monotonic() - started, 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    add_layout_flags(parser)
    args = parser.parse_args()
    layout = layout_from_flags(args)

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.convert.session import distributed_session
    from mbridge_refit.engines.broadcast.packed import PackedBroadcastConfig
    from mbridge_refit.engines.vllm import VLLMBroadcastRefit
    from mbridge_refit.models.builder import BuildOptions, build_model

    cpu = torch.device("cpu")
    on_disk = read_checkpoint(args.hf)
    config = PackedBroadcastConfig(bucket_bytes=64 * 1024, num_buffers=2, checksum=True)
    with distributed_session(layout, device=cpu, timeout=datetime.timedelta(minutes=5)):
        rank = dist.get_rank()
        source = rank == SOURCE
        bridge = RefitBridge.from_hf_pretrained(args.hf)
        chunks = build_model(bridge, layout, BuildOptions(device=cpu, params_dtype=torch.bfloat16))
        bridge.load_hf_shards(chunks, args.hf)
        sessions = iter(range(args.port, args.port + 16))

        def session(engine):
            refit = VLLMBroadcastRefit(
                InProcessLLM(engine) if source else None,
                host="127.0.0.1",
                port=next(sessions),
                source=source,
                trainer_group=dist.group.WORLD,
                trainer_src=SOURCE,
                config=config,
                backend="gloo",
                device=cpu,
                timeout_s=60.0,
            )
            refit.open(bridge, chunks)
            return refit

        results = {}
        engine = ReportingEngine(on_disk)
        refit = session(engine)
        first = refit.refit(bridge, chunks)
        if source:
            engine_equals(engine, expected_engine_state(on_disk), "first refit vs checkpoint on disk")
            if first.workers[0]["unloaded"] or first.workers[0]["tensors"] != first.tensors:
                fail(f"first refit: engine report {first.workers[0]} against {first.tensors} tensors sent")

        steps = [first]
        for step in (2, 3):  # replayed: each change of the trainer's weights shows in the engine
            changed = change_weights(bridge, chunks)
            steps.append(refit.refit(bridge, chunks))
            if source:
                engine_equals(
                    engine, expected_engine_state(changed), f"refit {step} vs stock export of the changed model"
                )
        if source:
            results["modes"] = [step.workers[0]["mode"] for step in steps]
            results["via_loader"] = [step.workers[0]["via_loader"] for step in steps]
            inject_load_fault(refit.llm.worker)  # as the GPU check does
        results["replaced_loader"] = outcome(lambda: refit.refit(bridge, chunks))
        after = refit.refit(bridge, chunks)
        if source:
            engine_equals(engine, expected_engine_state(changed), "the refit after the replaced loader failed")
            results["mode_after_replaced_loader"] = after.workers[0]["mode"]
        refit.close()

        results["sneaky"] = outcome(lambda: session(EngineModel(on_disk, sneaky=True)).refit(bridge, chunks))

        results["unloaded"] = outcome(lambda: session(ReportingEngine(on_disk, extra=True)).refit(bridge, chunks))

        failing = session(FailingEngine(on_disk))
        results["loader"] = outcome(lambda: failing.refit(bridge, chunks))
        failing.close()

        mismatched = session(ReportingEngine(on_disk))
        if source:  # the worker now holds a plan with one entry renamed
            target = mismatched.llm.worker._mbridge_broadcast_target
            plan = json.loads(target.plan_json)
            entries = plan["entries"]
            entries[3] = {**entries[3], "hf_name": entries[3]["hf_name"] + ".renamed"}
            target.plan_json = json.dumps(plan)
        results["mismatch"] = outcome(lambda: mismatched.refit(bridge, chunks))

        again = ReportingEngine(on_disk)
        final = session(again)
        final.refit(bridge, chunks)
        if source:
            engine_equals(again, expected_engine_state(changed), "a refit after the failures")
        results["rank"], results["ok"] = rank, True
        (args.result / f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
