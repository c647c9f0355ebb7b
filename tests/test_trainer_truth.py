"""The export inside a trainer as RL frameworks drive it (tests/ranks/trainer_truth_check.py):
Megatron's default expert-TP, parameters replaced under a bridge, packers that keep a bucket,
ranks that break the collective contract. Real ranks under torchrun (CPU, gloo); the oracle is
the checkpoint on disk or stock's export of the same live model.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, torchrun

pytestmark = pytest.mark.multirank
CHECKER = str(REPO / "tests" / "ranks" / "trainer_truth_check.py")


def _run(case: str, recipe: str, flags: list[str], source_checkpoints, tmp_path, *, timeout: float = 600) -> list[dict]:
    run = torchrun(
        2,
        [CHECKER, "--hf", str(source_checkpoints(recipe)), "--result", str(tmp_path), "--case", case, *flags],
        timeout=timeout,
    )
    assert run.returncode == 0, run.output[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_megatron_default_expert_tp_exports_whole_experts(source_checkpoints, tmp_path):
    """A MoE model at TP 2 with expert-TP left to Megatron (= 2): fast path, equal to the checkpoint and stock."""
    reports = _run("megatron-default-etp", "qwen3-moe-tiny", [], source_checkpoints, tmp_path)
    assert {r["expert_tp"] for r in reports} == {2} and all(r["split_expert_tensors"] for r in reports)


@pytest.mark.parametrize(
    "recipe,flags",
    [("qwen3-tiny", ["--tp", "2"]), ("qwen3-moe-tiny", ["--tp", "1"])],
    ids=["qwen3-tp2", "qwen3-moe-tp1"],  # TP1: every tensor a view of its parameter, reused while it stays
)
def test_replaced_parameters_are_exported_fresh(recipe, flags, source_checkpoints, tmp_path):
    reports = _run("replaced-params", recipe, flags, source_checkpoints, tmp_path)
    assert all(r["replaced"] for r in reports)


IN_PLACE_LAYOUTS = {
    "tp1": ("qwen3-tiny", ["--tp", "1"]),  # every tensor a view of its parameter, kept between exports
    "tp2": ("qwen3-tiny", ["--tp", "2"]),
    "pp2": ("qwen3-tiny", ["--pp", "2"]),  # rank 1 receives rank 0's tensors
    "pp2_vpp2": ("qwen3-tiny", ["--pp", "2", "--vpp", "2"]),
    "ep2": ("qwen3-moe-tiny", ["--ep", "2"]),
    "tp2_ep2": ("qwen3-moe-tiny", ["--tp", "2", "--ep", "2"]),
}


@pytest.mark.parametrize("layout", IN_PLACE_LAYOUTS)
def test_changes_in_place_are_followed_or_refused_on_every_rank(layout, source_checkpoints, tmp_path):
    """Issue 56 items 1-7, one launch per layout, each step against stock's export of the live model
    (tests/ranks/trainer_truth_check.py, case changed-in-place): a same-address transpose; a dtype
    change on rank 0 only (refused on both ranks before any collective) and ``model.half()``
    (with ``weight_dtype=torch.bfloat16`` too); ``_parameters[k] = new`` and the replacements of
    ``set_overwrite_module_params_on_conversion(True)``; an offload by ``resize_(0)`` loaded back by
    ``p.data = new`` (refused while emptied); a consumer rebinding yielded tensors; the old storages
    freed by ``release_export_buffers``; an expert (a parameter) deleted."""
    recipe, flags = IN_PLACE_LAYOUTS[layout]
    reports = _run("changed-in-place", recipe, flags, source_checkpoints, tmp_path)
    assert [set(r["dtype-on-rank0"]["refused"]) for r in reports] == [{"ModelChangedError"}, {"CollectiveMisuseError"}]
    assert all(r["offload"]["refused"] == r["deleted"]["deleted"] == "ModelChangedError" for r in reports), reports
    assert all(r["release"]["freed"] and r["consumer-rebinds"]["views"] for r in reports), reports
    # p.data = new after resize_(0) landed at an emptied storage's address somewhere (the allocator's choice)
    assert sum(r["offload"]["same_address"] for r in reports), reports
    rebinds = [r["consumer-rebinds"] for r in reports]
    assert all(r["buffer"] is None or r["verdict"] in ("stock", "ReboundOutputError") for r in rebinds), rebinds
    _check_rebound_on_rank1(layout, [r["rebound-on-rank1"] for r in reports])


def _check_rebound_on_rank1(layout: str, reports: list[dict]) -> None:
    """Step rebound-on-rank1: refused on both ranks, naming rank 1's tensor, before any collective."""
    if reports[0]["buffer"] is None:  # every tensor a view of its parameter: no bridge-owned buffer is yielded
        assert layout == "tp1" and reports[1]["buffer"] is None, reports
        return
    assert [r["refused"] for r in reports] == ["CollectiveMisuseError", "ReboundOutputError"], reports
    assert reports[0]["buffer"] == reports[1]["buffer"] is not None, reports


@pytest.mark.parametrize("layout", ["tp2", "pp2"])  # a gathered output; rank 1's receive buffer of a stage-0 tensor
def test_a_buffer_rebound_on_one_rank_is_refused_on_every_rank_before_any_collective(
    layout, source_checkpoints, tmp_path
):
    """Rank 1's consumer rebinds a yielded bridge-owned buffer after the loop (``t.data = t.data.half()``):
    the next export is refused on both ranks by the handshake, naming the tensor, within seconds (rank
    0 waited in a gather for the process group's timeout: rank 1 found it only mid-export); after
    ``release_export_buffers()`` the export equals stock's (tests/ranks/trainer_truth_check.py)."""
    recipe, flags = IN_PLACE_LAYOUTS[layout]
    reports = _run("changed-in-place", recipe, [*flags, "--steps", "rebound-on-rank1"], source_checkpoints, tmp_path)
    _check_rebound_on_rank1(layout, [r["rebound-on-rank1"] for r in reports])


def test_bucket_api_keeps_a_bucket_valid_and_the_checking_mode_catches_kept_tensors(source_checkpoints, tmp_path):
    reports = _run("buckets", "qwen3-tiny", ["--tp", "2"], source_checkpoints, tmp_path)
    assert all(r["buckets"] > 10 for r in reports)


def test_an_export_called_on_one_rank_alone_fails_within_its_timeout(source_checkpoints, tmp_path):
    reports = _run("lone-rank", "qwen3-tiny", ["--tp", "2"], source_checkpoints, tmp_path)
    assert reports[0]["seconds"] < 20, reports[0]


def test_a_rank_leaving_early_is_named_on_its_peers(source_checkpoints, tmp_path):
    _run("early-exit", "qwen3-tiny", ["--tp", "2"], source_checkpoints, tmp_path)


def test_a_second_export_while_one_is_open_is_refused_on_every_rank(source_checkpoints, tmp_path):
    """Two overlapping exports closed at different points on the two ranks paired the first's gathers
    with the second's (gloo fails or aborts the process) or left the ranks waiting for each other.
    Now every rank raises CollectiveMisuseError at the second call, before any collective, in each
    phase; a rank already waiting in the second's handshake is woken by the refusal (well before
    the 30 s timeout); the next export equals stock's. A second export of another bridge (of the
    same model) was not refused: gloo aborted the process (EnforceNotMet, a collective mismatch)."""
    reports = _run("overlapping-exports", "qwen3-tiny", ["--tp", "2"], source_checkpoints, tmp_path, timeout=300)
    phases = {"both", "one", "waiting", "another-bridge"}
    assert all(phases <= r.keys() for r in reports), reports
    assert 1.0 < reports[1]["waiting"]["seconds"] < 20, reports[1]
