"""Host work of a steady cached export, per yielded tensor, counted (not timed): run by
tests/test_host_work.py in a process of its own (one CPU rank, TP1).

Usage: host_work_check.py --experts N [N ...] --result FILE

For each expert count, builds the tiny Qwen3-MoE recipe with that many routed experts, exports
it twice (the plan, the buffers and the reused views settle), then counts the Python function
calls and the calls into C (torch operators among them) that a third export makes, through
``sys.setprofile``. Counts do not depend on the machine's load, so the test can bound them.
Writes {experts: {"tensors", "python_calls", "c_calls"}} to FILE.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from mbridge_refit.convert.session import distributed_session
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.testing.many_experts import many_expert_model


def count_calls(export) -> dict[str, int]:
    counts = {"python_calls": 0, "c_calls": 0}

    def probe(frame, event, arg):
        if event == "call":
            counts["python_calls"] += 1
        elif event == "c_call":
            counts["c_calls"] += 1

    sys.setprofile(probe)
    try:
        tensors = export()
    finally:
        sys.setprofile(None)
    return {"tensors": tensors, **counts}


def measure(experts: int) -> dict[str, int]:
    bridge, chunks = many_expert_model(experts)

    def export() -> int:
        count = 0
        for _name, _tensor in bridge.export_hf_weights(chunks, reuse_buffer_from_cache=True, show_progress=False):
            count += 1
        return count

    export()
    export()
    return count_calls(export)


def main(measure_one=measure, description: str = __doc__) -> None:
    """``--experts N [N ...] --result FILE``: ``measure_one(experts)`` for each, on one CPU rank, into FILE."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", required=True)
    parser.add_argument("--result", type=Path, required=True)
    args = parser.parse_args()
    with distributed_session(ParallelLayout(), device=torch.device("cpu"), timeout=datetime.timedelta(minutes=5)):
        results = {experts: measure_one(experts) for experts in args.experts}
    args.result.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
