"""The lint gate: ``ruff check`` and ``ruff format --check`` pass on the repository (configuration in
pyproject.toml: line length 120, import sorting, pyflakes), so style is settled by the tool, not in review."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    beside = Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.fail("ruff is not installed: scripts/setup.sh installs it from scripts/requirements.txt")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    run = subprocess.run([*_ruff(), *command, "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]


def test_ruff_sees_a_violation(tmp_path):
    """Control: the same configuration fails an unsorted import and an unformatted line."""
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("import sys\nimport os\nx=( 1 )\nprint(os, sys, x)\n")
    check = subprocess.run([*_ruff(), "check", "."], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    form = subprocess.run(
        [*_ruff(), "format", "--check", "."], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 1 and "I001" in check.stdout
    assert form.returncode == 1
