"""No code from a checkpoint ever runs: a config with ``auto_map`` (the checkpoint's own Python) is
refused before transformers sees it, by the CLI (exit 2) and by ``RefitBridge.from_hf_pretrained``."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import torchrun


def checkpoint_with_remote_code(source, dest, marker):
    """A copy of ``source`` whose config asks transformers to import the checkpoint's own module,
    which would create ``marker`` if it ever ran."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(model_type="evil_qwen3", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
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
    assert "auto_map" in run.output and "never runs" in run.output
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_bridge_refuses_remote_code(source_checkpoints, tmp_path):
    from mbridge_refit.bridge import RefitBridge
    from mbridge_refit.checkpoints.hf import RemoteCodeError

    marker = tmp_path / "marker"
    evil = checkpoint_with_remote_code(source_checkpoints("qwen3-tiny"), tmp_path / "evil", marker)
    with pytest.raises(RemoteCodeError, match="auto_map"):
        RefitBridge.from_hf_pretrained(evil)
    with pytest.raises(ValueError, match="never runs code"):
        RefitBridge.from_hf_pretrained(source_checkpoints("qwen3-tiny"), trust_remote_code=True)
    assert not marker.exists()
