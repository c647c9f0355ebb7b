"""Engine-sharded refit on CPU: each engine rank receives only its own shard, from the trainer's
parameters, checked against the checkpoint on disk cut by the engine rules the test writes itself.

Each case is one torchrun launch of 4 ranks (tests/ranks/sharded_refit_check.py) at one trainer
layout, trying every engine layout the model allows (engine rank i on global rank i). The
transfer plan's byte counts are checked here against what the layouts imply.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, torchrun

pytestmark = pytest.mark.multirank
CHECKER = str(REPO / "tests" / "ranks" / "sharded_refit_check.py")
DENSE_ENGINES = ["tp1", "tp2", "tp4"]
MOE_ENGINES = ["tp1", "tp2", "tp4", "tp2_ep2", "tp4_ep4"]

CASES = {
    "tp1": ("qwen3-tiny", [], DENSE_ENGINES, []),
    "tp2": ("qwen3-tiny", ["--tp", "2"], DENSE_ENGINES, ["--faults"]),
    "tp2_pp2": ("qwen3-tiny", ["--tp", "2", "--pp", "2"], DENSE_ENGINES, []),
    "ep2": ("qwen3-moe-tiny", ["--ep", "2"], MOE_ENGINES, []),
    "tp2_ep2": ("qwen3-moe-tiny", ["--tp", "2", "--ep", "2"], MOE_ENGINES, ["--faults"]),
    # Megatron's default expert-TP at TP2: each expert's halves on the two ranks of its expert-TP group
    "tp2_ep2_etp2": ("qwen3-moe-tiny", ["--tp", "2", "--ep", "2", "--etp", "2"], MOE_ENGINES, []),
}


def _run(case, source_checkpoints, tmp_path) -> list[dict]:
    recipe, flags, engines, extra = CASES[case]
    run = torchrun(
        4,
        [
            CHECKER,
            "--hf",
            str(source_checkpoints(recipe)),
            "--result",
            str(tmp_path),
            "--engines",
            *engines,
            *flags,
            *extra,
        ],
    )
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] for r in reports)
    assert all(r["plans"] == reports[0]["plans"] for r in reports)  # the same plan on every rank
    return reports


@pytest.mark.parametrize("case", list(CASES))
def test_every_engine_rank_gets_its_slices_of_the_checkpoint(case, source_checkpoints, tmp_path):
    reports = _run(case, source_checkpoints, tmp_path)
    plans = reports[0]["plans"]
    assert set(plans) == set(CASES[case][2])
    for engine, summary in plans.items():
        assert summary["bytes_moved"] + summary["bytes_local"] == summary["shard_bytes"], engine
        assert summary["bytes_moved"] <= summary["full_gather_bytes"], engine
    if "--faults" in CASES[case][3]:  # copies of a replicated tensor that differ: refused on every rank
        assert all("tensor(s) that several trainer ranks hold differ" in r["faults"]["replica_error"] for r in reports)
    if case == "tp1":  # four replicas of the whole model: every engine rank's bytes are on its own rank
        assert all(s["bytes_moved"] == 0 and s["full_gather_bytes"] == 0 for s in plans.values())
    if case == "tp2":  # the trainer's TP2 ranks are the engine's TP2 ranks: nothing crosses ranks
        assert plans["tp2"]["bytes_moved"] == 0 and plans["tp2"]["full_gather_bytes"] > 0
        assert 0 < plans["tp4"]["bytes_moved"] < plans["tp4"]["full_gather_bytes"]


def test_benchmark_runs_exactly_on_cpu(tmp_path):
    """scripts/bench_sharded_refit.py as the GPU host runs it, here on gloo with a tiny model: its
    engine shards equal the stock export's tensors cut to their boxes, and it allocates nothing
    after the first run (on CPU the allocation count is not observable: only exactness counts)."""
    run = torchrun(
        4,
        [
            str(REPO / "scripts" / "bench_sharded_refit.py"),
            "--model",
            "qwen3-tiny",
            "--tp",
            "2",
            "--engine",
            "tp4",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--out-dir",
            str(tmp_path),
        ],
    )
    assert run.returncode == 0, run.output[-4000:]
    result = json.loads((tmp_path / "sharded_refit_qwen3-tiny_tp2_to_tp4.json").read_text())
    assert result["mismatches_vs_stock"] == 0 and result["bytes_moved"] > 0
    assert result["layout"] == "tp2->tp4" and result["full_gather_bytes"] > result["bytes_moved"]
