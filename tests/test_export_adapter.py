"""``convert export-adapter`` (issue #33): a Megatron-Bridge LoRA training checkpoint -> an HF PEFT adapter.

tests/ranks/peft_checkpoint_writer.py saves a tiny Qwen3 wrapped with Megatron-Bridge's ``LoRA`` (random
A and B) as a PEFT run saves it, at TP2 (2 CPU ranks), twice (the adapters changed in between), and
writes the oracles from the live model: stock ``save_hf_adapter`` (the PEFT checkpoint to match, bit for
bit) and the merged export as an HF checkpoint. The command reads it at TP1 (one rank, this process).

The logits check runs in float32 (the base checkpoint is the bf16 recipe upcast, exactly): PEFT computes
``W·x + s·B·(A·x)`` and the merged model ``(W + s·B·A)·x``, which round differently in any dtype, so
"equal" means within 1e-5 (float32 reassociation over hidden 64; measured 6e-7), five orders of magnitude
below what the adapters change (0.8 here, checked so the comparison can fail). In bf16 the merged
weights' own rounding (~4e-3 relative) would swamp any such bound.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, torchrun
from oracle import read_checkpoint
from test_input_faults import ADDRESS_SPACE_LIMIT, BOMB_DRIVER, convert

from mbridge_refit.convert import ExitCode

WRITER = str(REPO / "tests" / "ranks" / "peft_checkpoint_writer.py")
ADAPTER = "adapter_model.safetensors"


def float32_copy(source: Path, out: Path) -> Path:
    """The HF checkpoint at ``source`` with every tensor in float32 (bf16 upcasts exactly), one file."""
    from safetensors.torch import save_file

    out.mkdir()
    checkpoint = read_checkpoint(source)
    save_file({name: checkpoint[name].float() for name in checkpoint}, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return out


@pytest.fixture(scope="module")
def run(source_checkpoints, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("peft")
    base = float32_copy(source_checkpoints("qwen3-tiny"), root / "base")
    launch = torchrun(2, [WRITER, "--hf", str(base), "--result", str(root), "--tp", "2"])
    assert launch.returncode == 0, launch.output[-6000:]
    return root


def adapter(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / ADAPTER)


def same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_adapter_loads_with_peft_and_computes_the_merged_logits(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    assert (
        convert("export-adapter", "--megatron", run / "save" / "iter_0000001", "--hf", run / "base", "--out", out) == 0
    )
    assert same(adapter(out), adapter(run / "expected1"))  # stock's PEFT checkpoint, bit for bit
    config = json.loads((out / "adapter_config.json").read_text())
    assert config == {
        **json.loads((run / "expected1" / "adapter_config.json").read_text()),
        "base_model_name_or_path": str(run / "base"),
    }

    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(run / "base", dtype=torch.float32).eval()
        plain = base(tokens).logits
        peft = PeftModel.from_pretrained(base, out).eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32).eval()(tokens).logits
    assert (merged - plain).abs().max() > 0.1  # the adapters change the logits: the check below can fail
    torch.testing.assert_close(peft, merged, rtol=0, atol=1e-5)


def test_the_latest_iteration_shows_the_changed_adapter(run, tmp_path):
    out = tmp_path / "adapter"
    assert convert("export-adapter", "--megatron", run / "save", "--hf", run / "base", "--out", out) == 0
    written = adapter(out)
    assert same(written, adapter(run / "expected2"))
    assert not any(torch.equal(written[k], adapter(run / "expected1")[k]) for k in written)
    # an existing output is replaced whole, never left half-written
    assert (
        convert("export-adapter", "--megatron", run / "save", "--hf", run / "base", "--out", out) == ExitCode.BAD_INPUT
    )
    before = (out / ADAPTER).read_bytes()
    assert (
        convert(
            "export-adapter",
            "--megatron",
            run / "save" / "iter_0000001",
            "--hf",
            run / "base",
            "--out",
            out,
            "--overwrite",
        )
        == 0
    )
    assert (out / ADAPTER).read_bytes() != before
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]  # no staging directory left


def _peft_null(run: Path, tmp_path: Path) -> Path:
    iteration = shutil.copytree(run / "save" / "iter_0000001", tmp_path / "iter_0000001")
    config = iteration / "run_config.yaml"
    config.write_text(
        config.read_text().replace(
            "_target_: megatron.bridge.peft.lora.LoRA", "_target_: megatron.bridge.peft.dora.DoRA"
        )
    )
    return iteration


def _no_run_config(run: Path, tmp_path: Path) -> Path:
    iteration = shutil.copytree(run / "save" / "iter_0000001", tmp_path / "iter_0000001")
    (iteration / "run_config.yaml").unlink()
    return iteration


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (_peft_null, "only megatron.bridge.peft.lora.LoRA adapters"),
        (_no_run_config, "has no run_config.yaml"),
        (lambda run, tmp: run / "base", "holds neither .metadata nor latest_checkpointed_iteration.txt"),
    ],
    ids=["dora", "no-run-config", "an-hf-checkpoint"],
)
def test_refuses_what_is_no_lora_checkpoint(run, make, needle, tmp_path, capsys):
    code = convert("export-adapter", "--megatron", make(run, tmp_path), "--hf", run / "base", "--out", tmp_path / "out")
    assert code == ExitCode.BAD_INPUT
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_a_wrong_base(run, source_checkpoints, tmp_path, capsys):
    wrong = source_checkpoints("qwen3-tiny-3layer")
    code = convert("export-adapter", "--megatron", run / "save", "--hf", wrong, "--out", tmp_path / "out")
    assert code == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert "is not the base the run fine-tuned (num_layers: the run trained 4, the base has 3)" in err
    assert not (tmp_path / "out").exists()


def test_a_damaged_lora_rank_is_refused_before_the_adapters_are_allocated(run, tmp_path):
    """run_config.yaml's ``peft.dim`` 8.4M (the saved adapters have rank 4): the fit is checked on a meta-device
    model, so the command refuses it (exit 2, naming the shapes) with the process under 2 GiB. Before, the LoRA
    wrapped the CPU model first: 4 layers x 2 adapters of 8.4M x 64 float32, 17 GiB, then the refusal."""
    iteration = shutil.copytree(run / "save" / "iter_0000001", tmp_path / "iter_0000001")
    config = iteration / "run_config.yaml"
    text = config.read_text()
    assert "\n  dim: 4\n" in text, text
    config.write_text(text.replace("\n  dim: 4\n", "\n  dim: 8400000\n"))
    argv = ["export-adapter", "--megatron", str(iteration), "--hf", str(run / "base"), "--out", str(tmp_path / "out")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", BOMB_DRIVER.format(limit=ADDRESS_SPACE_LIMIT), json.dumps([argv])]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert json.loads(output.split("CODES ", 1)[1].splitlines()[0]) == [ExitCode.BAD_INPUT], output[-4000:]
    assert "do not fit the base model" in output and "8400000" in output and "Traceback" not in output
    assert int(output.split("MAXRSS_KB ", 1)[1].split()[0]) < 2 * 2**20, "the adapters were allocated"
    assert not (tmp_path / "out").exists()
