"""The rounds ``scripts/bench_export.py`` writes for the README's performance table call every side in turn
and summarize what they timed (fake timers, CPU).
"""

from __future__ import annotations

import importlib.util
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


bench = load_script("bench_export")


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
