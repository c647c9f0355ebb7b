"""Export plan + fast cached export on every claimed layout, real ranks under torchrun (CPU, gloo).

The checks themselves run inside each rank (tests/ranks/check_export.py); the oracle there is the
source checkpoint on disk. This file launches them and reads what each rank reported.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, torchrun
from test_roundtrip import CASES, layout_flags

pytestmark = pytest.mark.multirank
CHECKER = str(REPO / "tests" / "ranks" / "check_export.py")


@pytest.mark.parametrize(("recipe", "layout"), CASES, ids=[f"{r}-{layout}" for r, layout in CASES])
def test_plan_and_cached_export(recipe, layout, source_checkpoints, tmp_path):
    nproc, flags = layout_flags(layout)
    run = torchrun(nproc, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert all(r["ok"] for r in reports)
    assert len({r["entries"] for r in reports}) == 1, "ranks disagree on the number of entries"


@pytest.mark.parametrize(
    ("recipe", "flags", "expected"),
    [
        ("qwen3-tiny-3layer", ["--pp", "2", "--first-stage-layers", "2"], {0: [0, 0], 1: [0, 0], 2: [1, 0]}),
        ("qwen3-tiny", ["--pp", "2", "--vpp", "2"], {0: [0, 0], 1: [1, 0], 2: [0, 1], 3: [1, 1]}),
        ("qwen3-tiny", ["--pp", "2"], {0: [0, 0], 1: [0, 0], 2: [1, 0], 3: [1, 0]}),
    ],
    ids=["uneven-pp2-2+1", "pp2-vpp2", "pp2"],
)
def test_layer_map(recipe, flags, expected, source_checkpoints, tmp_path):
    """The plan's layer map, read from the chunks, for even, uneven and interleaved pipelines."""
    run = torchrun(2, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags])
    assert run.returncode == 0, run.output[-6000:]
    for rank in range(2):
        layer_map = json.loads((tmp_path / f"rank{rank}.json").read_text())["layer_map"]
        assert {int(k): v for k, v in layer_map.items()} == expected
