"""A colocated refit whose sender refuses a step keeps its ranks' exports in step: run under torchrun
(2 CPU ranks, gloo, TP 2) by tests/test_ipc_session.py.

Usage: ipc_refused_step_check.py --hf CKPT --result DIR --tp 2

Rank 0 is the ``IpcSession``'s sender into an engine stand-in (``testing.copy_engine``, early applies
on, ``timeout_s`` 1 s); rank 1 calls ``refit(sender=False)``. Before each step every parameter
shard on every rank is filled with the step's number k, so every HF tensor the export yields is k
throughout: the oracle, independent of the export. Step 2's apply RPC stalls past the timeout once
(the sender raises ``TimeoutError``); step 3 comes while that RPC still runs, so the sender refuses it
(``TransportError``), and must still run the step's export, which is collective, to its end. Steps 4
and 5 must leave the engine holding k in every tensor, with no rank waiting on another: a sender that
skipped step 3's export pairs its next one with rank 1's step 3 and mixes the two steps' shards.
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from oracle import read_checkpoint  # noqa: E402
from rank_checks import checker_parser, checkpoint_session, fail  # noqa: E402

from mbridge_refit.convert.flags import layout_from_flags  # noqa: E402
from mbridge_refit.engines.ipc.sharing import LocalTransport  # noqa: E402
from mbridge_refit.engines.ipc.trainer import IpcSession  # noqa: E402
from mbridge_refit.errors import TransportError  # noqa: E402
from mbridge_refit.testing.copy_engine import CopyEngine, CopyEngineWorker  # noqa: E402

STALL_S = 3.0


def main() -> None:
    args = checker_parser().parse_args()
    with checkpoint_session(args.hf, layout_from_flags(args)) as (bridge, chunks):
        rank = dist.get_rank()
        engine = CopyEngine(read_checkpoint(args.hf)) if rank == 0 else None
        worker, stall = (CopyEngineWorker(engine) if engine is not None else None), []

        def call_workers(method, *rpc_args):
            if method == "mbridge_refit_apply" and stall:
                stall.clear()
                time.sleep(STALL_S)  # the engine's RPC path stalls once
            return pickle.loads(pickle.dumps([getattr(worker, method)(*pickle.loads(pickle.dumps(rpc_args)))]))

        session = IpcSession(call_workers, transport=LocalTransport(), early_apply=True, timeout_s=1.0)
        report = {"steps": []}
        for k in range(1, 6):
            with torch.no_grad():
                for chunk in chunks:
                    for param in chunk.parameters():
                        param.fill_(float(k))
            if rank == 0 and k == 2:
                stall.append(True)
            if k == 4:
                time.sleep(STALL_S)  # the stalled RPC has returned: the sender may apply again
            started = time.monotonic()
            try:
                step = session.refit(bridge, chunks, sender=rank == 0)
                outcome = "none" if step is None else ("opened" if step.opened else "applied")
            except (TimeoutError, TransportError) as err:
                outcome = type(err).__name__
            seconds = time.monotonic() - started
            report["steps"].append({"step": k, "outcome": outcome, "seconds": round(seconds, 2)})
            if seconds > 2 * STALL_S:
                fail(f"step {k} took {seconds:.1f} s: a rank waited on another's export")
            if engine is not None and outcome in ("opened", "applied"):
                wrong = [n for n, t in engine.state().items() if not bool((t == k).all())]
                if wrong:
                    fail(f"step {k}: the engine does not hold {k} in {wrong[:4]} ({len(wrong)} tensors)")
        expected = ["opened", "TimeoutError", "TransportError", "opened", "applied"] if rank == 0 else ["none"] * 5
        if [s["outcome"] for s in report["steps"]] != expected:
            fail(f"outcomes {report['steps']}, expected {expected}")
        session.close()
        args.result.mkdir(parents=True, exist_ok=True)
        (args.result / f"rank{rank}.json").write_text(json.dumps({"ok": True, **report}))


if __name__ == "__main__":
    main()
