"""Code from a checkpoint runs only where the caller asks for it: a config whose architecture exists
only as the checkpoint's own Python (``auto_map`` with a ``model_type`` transformers does not have
built in) is refused by the CLI (exit 2) unless ``--trust-remote-code`` is given, and by
``RefitBridge.from_hf_pretrained`` unless ``trust_remote_code=True`` is passed (then honoured, with
a warning). A built-in ``model_type`` loads with its built-in class whatever ``auto_map`` says."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from conftest import torchrun


def checkpoint_with_remote_code(source, dest, marker, model_type="evil_qwen3"):
    """A copy of ``source`` whose config asks transformers to import the checkpoint's own module,
    which would create ``marker`` if it ever ran."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "configuration_evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import Qwen3Config\nclass EvilConfig(Qwen3Config):\n    model_type = 'evil_qwen3'\n"
    )
    return dest


def test_cli_refuses_remote_code(source_checkpoints, tmp_path):
    marker = tmp_path / "marker"
    evil = checkpoint_with_remote_code(source_checkpoints("qwen3-tiny"), tmp_path / "evil", marker)
    run = torchrun(1, ["mbridge_refit.convert", "roundtrip", "--hf", str(evil), "--out", str(tmp_path / "out")])
    assert run.returncode == 2, run.output[-3000:]
    assert "auto_map" in run.output and "evil_qwen3" in run.output and "--trust-remote-code" in run.output
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_bridge_refuses_remote_code(source_checkpoints, tmp_path):
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import RemoteCodeError

    marker = tmp_path / "marker"
    evil = checkpoint_with_remote_code(source_checkpoints("qwen3-tiny"), tmp_path / "evil", marker)
    with pytest.raises(RemoteCodeError, match="trust_remote_code=True"):
        RefitBridge.from_hf_pretrained(evil)
    assert not marker.exists()


def test_builtin_model_type_with_auto_map_loads_the_builtin_class(source_checkpoints, tmp_path):
    """NVIDIA's Nemotron-H checkpoints carry an auto_map beside a model_type transformers has built in:
    stock loads them with the built-in class, and so do the bridge and the CLI's config reader."""
    from transformers import Qwen3Config

    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import load_config

    marker = tmp_path / "marker"
    checkpoint = checkpoint_with_remote_code(source_checkpoints("qwen3-tiny"), tmp_path / "ckpt", marker, "qwen3")
    bridge = RefitBridge.from_hf_pretrained(checkpoint)
    assert type(bridge.hf_pretrained.config) is Qwen3Config
    assert type(load_config(checkpoint)) is Qwen3Config
    assert not marker.exists()


def test_trust_remote_code_in_the_python_api_is_honoured_with_a_warning(source_checkpoints, caplog):
    from mbridge_refit.bridge import RefitBridge

    with caplog.at_level(logging.WARNING, logger="mbridge_refit"):
        bridge = RefitBridge.from_hf_pretrained(source_checkpoints("qwen3-tiny"), trust_remote_code=True)
    assert bridge.trust_remote_code is True
    assert any("trust_remote_code=True" in r.getMessage() for r in caplog.records if r.name.startswith("mbridge_refit"))


@pytest.mark.parametrize("command", ["roundtrip", "import", "export", "plan"])
def test_cli_trust_remote_code_flag_parses(command):
    """Every command that reads a checkpoint's config takes the flag (off by default)."""
    from mbridge_refit.convert.parser import build_parser

    inputs = {
        "roundtrip": ["--hf", "A", "--out", "B"],
        "import": ["--hf", "A", "--megatron", "B"],
        "export": ["--megatron", "A", "--out", "B"],
        "plan": ["--hf", "A"],
    }[command]
    assert build_parser().parse_args([command, *inputs, "--trust-remote-code"]).trust_remote_code is True
    assert build_parser().parse_args([command, *inputs]).trust_remote_code is False


def test_cli_config_check_takes_the_flag_to_transformers(source_checkpoints, tmp_path, monkeypatch):
    """Without the flag the refusal names it; with it, transformers is asked with
    trust_remote_code=True (a stand-in for transformers here: nothing of the checkpoint runs)."""
    import transformers

    from mbridge_refit.convert.exit_codes import BadInput
    from mbridge_refit.convert.inputs import supported_config

    evil = checkpoint_with_remote_code(source_checkpoints("qwen3-tiny"), tmp_path / "evil", tmp_path / "marker")
    with pytest.raises(BadInput, match="--trust-remote-code"):
        supported_config(evil)
    asked = []
    stand_in = transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"])
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: asked.append(k) or stand_in)
    supported_config(evil, trust_remote_code=True)
    assert asked == [{"trust_remote_code": True}] and not (tmp_path / "marker").exists()
