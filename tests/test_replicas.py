"""Exports with data-parallel and context-parallel replicas (world = tp x pp x cp x dp), on CPU.

Each case is one torchrun launch of 4 ranks whose checks run inside the ranks
(tests/ranks/replica_check.py: the plan, the export on every rank, the export by replica 0
alone, the FP8 export), each against the checkpoint on disk; then the `convert roundtrip` CLI at
a replicated layout, against the checkpoint on disk, and the layout errors.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, torchrun
from oracle import assert_bitwise_equal_checkpoints

pytestmark = pytest.mark.multirank
CHECKER = str(REPO / "tests" / "ranks" / "replica_check.py")

CASES = {
    "dp2_tp2": ("qwen3-tiny", ["--tp", "2"], {"dp": 2, "cp": 1, "participants": 2}),
    "dp2_pp2": ("qwen3-tiny", ["--pp", "2"], {"dp": 2, "cp": 1, "participants": 2}),
    "dp2_tp2_ep2": ("qwen3-moe-tiny", ["--tp", "2", "--ep", "2"], {"dp": 2, "cp": 1, "participants": 2}),
    "cp2_tp2": ("qwen3-tiny", ["--tp", "2", "--cp", "2"], {"dp": 1, "cp": 2, "participants": 4}),
    "dp2_pp2_vpp2": ("qwen3-tiny", ["--pp", "2", "--vpp", "2"], {"dp": 2, "cp": 1, "participants": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replicated_layout_exports_exactly(case, source_checkpoints, tmp_path):
    recipe, flags, expected = CASES[case]
    run = torchrun(4, [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), *flags])
    assert run.returncode == 0, run.output[-6000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["ok"] for r in reports)
    assert {(r["dp"], r["cp"]) for r in reports} == {(expected["dp"], expected["cp"])}
    assert sum(r["takes_part_in_replica0"] for r in reports) == expected["participants"]


@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_cli_with_replicas(case, source_checkpoints, tmp_path):
    recipe, flags, _ = CASES[case]
    source, out = source_checkpoints(recipe), tmp_path / "out"
    run = torchrun(4, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(out), *flags])
    assert run.returncode == 0, run.output[-6000:]
    assert_bitwise_equal_checkpoints(source, out)


def test_layout_that_does_not_divide_the_world_names_both_numbers(source_checkpoints, tmp_path):
    run = torchrun(
        3,
        [
            "mbridge_refit.convert",
            "roundtrip",
            "--hf",
            str(source_checkpoints("qwen3-tiny")),
            "--out",
            str(tmp_path / "out"),
            "--tp",
            "2",
        ],
    )
    # every rank exits 2 (bad input); torchrun itself then exits 1 and lists each rank's code
    assert run.returncode != 0 and run.output.count("(exitcode: 2)") >= 1, run.output[-3000:]
    assert "world size 3 is not divisible by tp*pp*cp" in run.output and "--nproc-per-node 2" in run.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("recipe", "flags"),
    [("qwen3-tiny", ["--tp", "2"]), ("qwen3-moe-tiny", ["--tp", "2", "--ep", "2", "--fp8-blockwise"])],
    ids=["qwen3-tp2", "qwen3-moe-tp2_ep2-fp8"],
)
def test_replicas_write_their_shares_in_parallel(recipe, flags, source_checkpoints, tmp_path):
    """DP2 (4 ranks) writes the very files DP1 (2 ranks) writes, each replica its own shards, and
    they equal the checkpoint on disk (BF16) or the reference quantizer applied to it (FP8)."""
    source = source_checkpoints(recipe)
    small = ["--max-shard-bytes", "40000"]  # many shards, so both replicas have some
    outputs = {}
    for ranks in (2, 4):
        out = tmp_path / f"out{ranks}"
        run = torchrun(
            ranks, ["mbridge_refit.convert", "roundtrip", "--hf", str(source), "--out", str(out), *flags, *small]
        )
        assert run.returncode == 0, run.output[-6000:]
        replicas = 2 if ranks == 4 else 1
        assert f"({replicas} replica{'s' if replicas > 1 else ''} writing in parallel)" in run.output, run.output[
            -3000:
        ]
        outputs[ranks] = out
    files = sorted(p.name for p in outputs[2].iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) >= 4, files
    assert files == sorted(p.name for p in outputs[4].iterdir())
    for name in files:
        assert (outputs[2] / name).read_bytes() == (outputs[4] / name).read_bytes(), name
    if "--fp8-blockwise" in flags:
        from test_fp8 import assert_fp8_checkpoint_is_reference

        assert assert_fp8_checkpoint_is_reference(source, outputs[4])
    else:
        assert_bitwise_equal_checkpoints(source, outputs[4])


def test_export_from_megatron_with_replicas(source_checkpoints, tmp_path):
    """`export` (names from the Megatron checkpoint's record) at DP2 x TP2 writes the source's tensors exactly."""
    source, megatron, out = source_checkpoints("qwen3-tiny"), tmp_path / "mcore", tmp_path / "out"
    run = torchrun(
        2, ["mbridge_refit.convert", "import", "--hf", str(source), "--megatron", str(megatron), "--pp", "2"]
    )
    assert run.returncode == 0, run.output[-4000:]
    run = torchrun(
        4,
        [
            "mbridge_refit.convert",
            "export",
            "--megatron",
            str(megatron),
            "--out",
            str(out),
            "--tp",
            "2",
            "--max-shard-bytes",
            "40000",
        ],
    )
    assert run.returncode == 0, run.output[-6000:]
    assert "(2 replicas writing in parallel)" in run.output
    assert_bitwise_equal_checkpoints(source, out)
