"""``convert export`` of a checkpoint written by Megatron-Bridge's training (issue #58), not by ``import``.

tests/ranks/training_checkpoint_writer.py builds a tiny Qwen3 at TP2 (2 CPU ranks), changes every weight (so
the checkpoint's weights are not the HF source's), and saves it as Megatron-Bridge's ``save_checkpoint`` does
with torch_dist (model, Adam's states, param groups, scheduler, RNG state, train state, run_config.yaml, the
tracker); the oracle is stock ``AutoBridge.export_hf_weights`` of the live model before the save. The command
reads it at TP1 in this process, with ``--hf`` the HF checkpoint the run started from.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, torchrun
from oracle import read_checkpoint
from test_input_faults import convert

from mbridge_refit.convert import ExitCode
from mbridge_refit.models import recipes

WRITER = str(REPO / "tests" / "ranks" / "training_checkpoint_writer.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    base = recipes.make_random_checkpoint("qwen3-tiny", root / "base", seed=4)
    launch = torchrun(2, [WRITER, "--hf", str(base), "--result", str(root), "--tp", "2"])
    assert launch.returncode == 0, launch.output[-6000:]
    return root


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("where", ["save", "save/iter_0000002"])
def test_export_equals_the_trained_model(run, where, tmp_path):
    out = tmp_path / "out"
    assert convert("export", "--megatron", run / where, "--hf", run / "base", "--out", out) == ExitCode.OK
    exported, expected = read_checkpoint(out), read_checkpoint(run / "expected")
    assert same(exported, expected), "the export differs from the live model's stock export"
    assert not same(exported, read_checkpoint(run / "base")), "the oracle must differ from the HF source"
    assert json.loads((out / "config.json").read_text()) == json.loads((run / "base" / "config.json").read_text())


def test_without_hf_it_is_refused_naming_the_flag(run, tmp_path, capsys):
    assert convert("export", "--megatron", run / "save", "--out", tmp_path / "out") == ExitCode.BAD_INPUT
    assert "pass --hf HF_DIR" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_wrong_base_is_refused_before_any_weight_is_read(run, tmp_path, capsys):
    other = recipes.make_random_checkpoint("qwen3-tiny-3layer", tmp_path / "other", seed=4)
    code = convert("export", "--megatron", run / "save", "--hf", other, "--out", tmp_path / "out")
    assert code == ExitCode.BAD_INPUT and "does not match its config.json" in capsys.readouterr().err


def test_megatron_lm_args_in_the_common_state_are_read_as_data(run, tmp_path):
    """Megatron-LM's ``generate_state_dict`` also stores its ``argparse.Namespace`` in the common state, which
    every load reads: ``weights_only`` takes it as data (Megatron-Core registers Namespace as a safe global)."""
    out = tmp_path / "out"
    assert convert("export", "--megatron", run / "save_lm_args", "--hf", run / "base", "--out", out) == ExitCode.OK
    assert same(read_checkpoint(out), read_checkpoint(run / "expected"))
