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


@pytest.mark.parametrize(("recipe", "layout"), CASES, ids=[f"{r}-{l}" for r, l in CASES])
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


def test_fp8_buckets_hold_what_the_fp8_export_yields():
    """Buckets measured in the bytes the FP8 export yields (e4m3 data + scales) hold about twice
    the layers of BF16 buckets under the same budget; non-layer tensors stay buckets of their own
    when they exceed it; the first bucket with a layer closes after it. Pure bucketing logic."""
    from types import SimpleNamespace

    from mbridge_refit.export import _build_buckets, _Op
    from mbridge_refit.fp8 import yielded_bytes

    def entry(name, nbytes, scale_of=None):
        return SimpleNamespace(hf_name=name, megatron_param=name, pp_rank=0, alias_of=None, nbytes=nbytes, scale_of=scale_of)

    bf16 = [entry("embed", 3000)]
    fp8 = [entry("embed", 3000)]
    for layer in range(4):
        weight, norm = f"model.layers.{layer}.q.weight", f"model.layers.{layer}.norm.weight"
        bf16 += [entry(weight, 1000), entry(norm, 10)]
        fp8 += [entry(weight, 500), entry(weight + "_scale_inv", 4, scale_of=weight), entry(norm, 10)]
    ops = [_Op(entries=[e], assemblies=[], source=None, sharded_over_tp=False, expert=False) for e in bf16]

    def layers(sizes):
        return [[op.entries[0].hf_name.split(".")[2] if "layers" in op.entries[0].hf_name else "embed"
                 for op in bucket.ops if op.entries[0].hf_name.endswith("q.weight") or "embed" in op.entries[0].hf_name]
                for bucket in _build_buckets(ops, 2100, SimpleNamespace(), sizes)]

    sizes = yielded_bytes(SimpleNamespace(entries=fp8))
    assert sizes["model.layers.0.q.weight"] == 504 and sizes["embed"] == 3000
    # the first bucket holding a layer holds only that layer (the device starts after one layer)
    assert layers(None) == [["embed"], ["0"], ["1", "2"], ["3"]]
    assert layers(sizes) == [["embed"], ["0"], ["1", "2", "3"]]
    assert layers({e.hf_name: e.nbytes for e in bf16}) == layers(None)  # control: the plan's own sizes
