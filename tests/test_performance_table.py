"""The README's performance table from its result files (``scripts/render_performance.py``): a row measured
in interleaved rounds shows medians and ranges, an older row one number and a mark; and the rounds
``scripts/bench_export.py`` writes call every side in turn and summarize what they timed (fake timers, CPU).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """A script of scripts/ as a module, registered under its name (its dataclasses look it up there); scripts
    import their neighbours by name, so scripts/ is on the path while it loads."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


render = load_script("render_performance")
bench = load_script("bench_export")

SEQUENTIAL = dict(
    device="NVIDIA H100 80GB HBM3",
    world_size=1,
    layout="tp1",
    clone_floor_ms=10.0,
    gather_floor_ms=0.0,
    stock_steady_ms=80.0,
    refit_cached_steady_ms=4.0,
    fp8_steady_ms=8.0,
    stock_peak_extra_bytes=5e7,
    refit_peak_extra_bytes=1e8,
    refit_cached_peak_extra_bytes=5e7,
    fp8_peak_extra_bytes=4e8,
)
ROUNDS = dict(
    rounds=4,
    warmup_rounds=1,
    order=["stock", "ours", "fp8", "floor"],
    stock_ms=[81.0, 79.5, 90.25, 80.0],
    ours_ms=[4.0, 4.75, 4.25, 5.0],
    fp8_ms=[8.5, 8.0, 9.0, 8.25],
    floor_ms=[10.5, 11.0, 10.75, 10.25],
    floor="clone",
)
ROUNDS.update(
    speedup=[s / o for s, o in zip(ROUNDS["stock_ms"], ROUNDS["ours_ms"])],
    ours_over_floor=[o / f for o, f in zip(ROUNDS["ours_ms"], ROUNDS["floor_ms"])],
    fp8_over_floor=[o / f for o, f in zip(ROUNDS["fp8_ms"], ROUNDS["floor_ms"])],
)


def cells(tmp_path: Path, result: dict, fp8: bool = False) -> list[str]:
    (tmp_path / "run.json").write_text(json.dumps(result))
    line = render.render_row(render.Row("a shape", "run.json", fp8=fp8), results=tmp_path)
    return [cell.strip() for cell in line.strip("|").split("|")]


def spread(values: list[float], digits: int, unit: str) -> str:
    low, high, middle = min(values), max(values), statistics.median(values)
    return f"{middle:.{digits}f}{unit} ({low:.{digits}f}–{high:.{digits}f})"


def test_interleaved_row_shows_median_and_range_of_the_rounds(tmp_path):
    device, _, _, stock, ours, speedup, over_floor, memory = cells(tmp_path, {**SEQUENTIAL, "interleaved": ROUNDS})
    assert device == "[H100 80 GB](benchmarks/results/run.json)"  # no mark
    assert stock == spread(ROUNDS["stock_ms"], 1, " ms") == "80.5 ms (79.5–90.2)"
    assert ours == spread(ROUNDS["ours_ms"], 2, " ms") == "4.50 ms (4.00–5.00)"
    ratios = [s / o for s, o in zip(ROUNDS["stock_ms"], ROUNDS["ours_ms"])]  # per round, not of the medians
    assert speedup == spread(ratios, 1, "×") == "18.5× (16.0–21.2)"  # the ratio of the medians is 17.9×
    ratios = [o / f for o, f in zip(ROUNDS["ours_ms"], ROUNDS["floor_ms"])]
    assert over_floor == f"{spread(ratios, 2, '×')} the {statistics.median(ROUNDS['floor_ms']):.2f} ms clone"
    assert memory == "0.05 GB, 0.10 GB, 0.05 GB"


def test_interleaved_fp8_row_reads_the_fp8_rounds(tmp_path):
    _, _, _, stock, ours, speedup, over_floor, _ = cells(tmp_path, {**SEQUENTIAL, "interleaved": ROUNDS}, fp8=True)
    assert (stock, speedup) == ("–", "–")
    assert ours == spread(ROUNDS["fp8_ms"], 2, " ms")
    ratios = [o / f for o, f in zip(ROUNDS["fp8_ms"], ROUNDS["floor_ms"])]
    assert over_floor == f"{spread(ratios, 2, '×')} the {statistics.median(ROUNDS['floor_ms']):.2f} ms clone"


def test_sequential_row_shows_one_number_and_its_mark(tmp_path):
    device, _, layout, stock, ours, speedup, over_floor, _ = cells(tmp_path, SEQUENTIAL)
    assert device == f"[H100 80 GB](benchmarks/results/run.json) {render.SEQUENTIAL}"
    assert (layout, stock, ours, speedup) == ("TP1", "80.0 ms", "4.00 ms", "20.0×")
    assert over_floor == "0.40× the 10.00 ms clone"


@pytest.mark.parametrize("interleaved", [False, True], ids=["sequential", "interleaved"])
def test_note_under_the_table_only_while_a_row_is_sequential(tmp_path, interleaved):
    (tmp_path / "old.json").write_text(json.dumps(SEQUENTIAL))
    (tmp_path / "new.json").write_text(json.dumps({**SEQUENTIAL, "interleaved": ROUNDS}))
    rows = (render.Row("new", "new.json"), *([] if interleaved else [render.Row("old", "old.json")]))
    block = render.render_block(rows, results=tmp_path)
    assert (render.SEQUENTIAL_NOTE in block) is not interleaved
    assert block[0] == render.BEGIN and block[-1] == render.END


def test_rounds_call_every_side_in_turn_and_summarize():
    calls = []
    times = {"stock": iter([99.0, 80, 84, 82]), "ours": iter([9.0, 4, 4.2, 4.1]), "floor": iter([50.0, 10, 11, 9])}

    def timer(name):
        def call():
            calls.append(name)
            return float(next(times[name]))

        return call

    result = bench.interleaved_rounds({name: timer(name) for name in times}, 3, bench.TABLE_RATIOS, warmup=1)
    assert calls == ["stock", "ours", "floor"] * 4
    assert (result["rounds"], result["warmup_rounds"], result["order"]) == (3, 1, ["stock", "ours", "floor"])
    assert result["stock_ms"] == [80.0, 84.0, 82.0]  # the warm-up round is not recorded
    assert result["floor_ms"] == [10.0, 11.0, 9.0]
    assert result["speedup"] == pytest.approx([20.0, 20.0, 82.0 / 4.1])
    assert result["ours_over_floor"] == pytest.approx([0.4, 4.2 / 11, 4.1 / 9])
    assert "fp8_over_floor" not in result  # no FP8 side called
    assert result["median"] == pytest.approx(
        {"stock_ms": 82.0, "ours_ms": 4.1, "floor_ms": 10.0, "speedup": 20.0, "ours_over_floor": 0.4}
    )


def test_rounds_feed_the_table(tmp_path):
    """What the rounds write is what the table reads: a row rendered from ``interleaved_rounds``' output."""
    values = {"stock": [90.0, 80.0, 82.0], "ours": [5.0, 4.0, 4.4], "fp8": [9.0, 8.0, 8.8], "floor": [11.0, 10.0, 9.0]}
    calls = {name: iter(times).__next__ for name, times in values.items()}
    rounds = dict(bench.interleaved_rounds(calls, 2, bench.TABLE_RATIOS, warmup=1), floor="clone")
    _, _, _, stock, ours, _, over_floor, _ = cells(tmp_path, {**SEQUENTIAL, "interleaved": rounds}, fp8=True)
    assert (stock, ours) == ("–", "8.40 ms (8.00–8.80)")
    assert over_floor.endswith("the 9.50 ms clone")


def test_host_control_loop_is_per_item_and_median_of_its_passes(monkeypatch):
    """bench_export's control loop: this thread's CPU time of each pass over the items, the median pass, per item."""
    passes = iter([0.0, 0.004, 1.0, 1.016, 2.0, 2.008])  # start/end of three passes: 4, 16 and 8 ms (mean 9.3)
    monkeypatch.setattr(bench.time, "thread_time", lambda: next(passes))
    items = [bench.torch.zeros(1) for _ in range(4)]
    assert bench.host_control_us(items, passes=3) == pytest.approx(8e-3 * 1e6 / 4)


def test_host_figures_divide_each_run_by_the_control_beside_it():
    """A host twice as slow in one run doubles both that run's time and its control: the ratio stays."""
    figures = bench.host_figures([2.0, 4.0, 2.2], [1.0, 2.0, 1.0], tensors=1000)  # ms per run; us per item
    assert figures["host_us_per_tensor"] == pytest.approx(2.2)
    assert figures["host_us_per_tensor_range"] == pytest.approx([2.0, 4.0])
    assert figures["host_control_us_per_item"] == pytest.approx(1.0)
    assert figures["host_over_control"] == pytest.approx(2.0)  # ratios 2.0, 2.0, 2.2


def test_host_figures_without_a_control_reading_have_no_ratio():
    """A clock too coarse for the control loop reads 0 for it: no ratio instead of a division error."""
    assert bench.host_figures([2.0, 2.0], [0.0, 0.0], tensors=1000)["host_over_control"] is None


def test_host_floor_rounds_alternate_the_export_with_its_pairs_replayed(monkeypatch):
    """``host_floor_rounds``: each round times the export, then a generator yielding the very pairs one export
    gave (same objects, same order); per tensor, with the median of the per-round ratios."""
    pairs = [(f"w{i}", bench.torch.zeros(1)) for i in range(4)]
    timed, host_ms = [], iter([0.008, 0.004, 0.012, 0.004, 0.010, 0.005])  # ours, floor, per round

    def fake_timed_export(make_stream):
        timed.append(list(make_stream()))
        return 0.0, 0, len(timed[-1]), 0, next(host_ms)

    monkeypatch.setattr(bench, "timed_export", fake_timed_export)
    result = bench.host_floor_rounds(lambda: iter(pairs), rounds=3)
    assert len(timed) == 6 and all(len(t) == 4 for t in timed)
    assert all(a is b for t in timed[1::2] for a, b in zip(t, pairs))  # the floor hands out the same pair objects
    assert result["ours_us_per_tensor"] == pytest.approx([2.0, 3.0, 2.5])
    assert result["yield_floor_us_per_tensor"] == pytest.approx([1.0, 1.0, 1.25])
    assert result["median"]["ours_over_yield_floor"] == pytest.approx(2.0)  # ratios 2.0, 3.0, 2.0


def test_broadcast_step_bound_splits_fixed_part_from_bulk():
    """``bench_refit_vllm_broadcast.step_bound``: the fixed part is the handshake mark, the engine's reply and the
    reset; the bulk is the send less the handshake; the best ratio is the raw broadcast plus the fixed part."""
    broadcast = load_script("bench_refit_vllm_broadcast")
    result = {
        "raw_broadcast_ms": {"median": 12.0},
        "ours_step_parts_ms": {
            "send": {"median": 16.0},
            "wait_engine": {"median": 0.5},
            "reset_and_share": {"median": 1.5},
        },
        "ours_phases": {"trainer": {"host_ms": {"handshake": 1.0}}},
    }
    bound = broadcast.step_bound(result)
    assert bound["fixed_ms"] == 3.0 and bound["bulk_ms"] == 15.0, bound
    assert bound["raw_over_bulk"] == 0.8 and bound["best_raw_over_ours"] == 0.8, bound  # 12 / 15 both
    assert bound["ours_needed_ms"] == pytest.approx(12.0 / 0.85, abs=1e-3), bound
    assert broadcast.step_bound({"raw_broadcast_ms": {"median": 12.0}}) is None  # no parts: no bound
