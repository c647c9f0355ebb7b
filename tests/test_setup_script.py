"""scripts/setup.sh's Transformer Engine step, run against a stand-in venv whose ``python`` records each call
(no install runs): without a CUDA toolkit (no nvcc under CUDA_HOME, a CPU machine) it builds TE's torch
extension against the CUDA headers of NVIDIA's pip wheels; with one, against the toolkit's, as before.

TE 2.20.2's torch extension is a ``CppExtension`` of .cpp files only: nvcc compiles none of it, and its build
takes CUDA's headers from the toolkit it finds, else from every ``nvidia/*/include`` of the environment."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Answers as the venv's python would: `import site` gives a site directory, a TE import works once TE's pin was
# installed, every other call (pip, other imports) succeeds. Each call is logged with the CUDA_HOME it saw.
FAKE_PYTHON = """#!/usr/bin/env bash
log="$(dirname "$0")/../calls.log"
echo "CUDA_HOME=${CUDA_HOME-<unset>} $*" >> "$log"
if [ "$1" = "-c" ]; then
  case "$2" in
    *"import site"*) echo "$(dirname "$0")/../site" ;;
    *transformer_engine*) grep -q 'transformer-engine\\[' "$log" || exit 1 ;;
  esac
fi
exit 0
"""


def run_setup(tmp_path: Path, cuda_home: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "scripts/requirements.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CUDA_HOME": str(cuda_home)}
    run = subprocess.run(
        ["bash", str(root / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    calls = (root / ".venv" / "calls.log").read_text().splitlines() if (root / ".venv" / "calls.log").exists() else []
    return run, calls


def header_pins() -> list[str]:
    return re.search(r'^CUDA_HEADER_PINS="([^"]+)"', (ROOT / "scripts/setup.sh").read_text(), re.M).group(1).split()


def te_install(calls: list[str]) -> str:
    return next(call for call in calls if "install" in call and "transformer-engine[" in call)


def test_without_a_toolkit_te_builds_against_the_cuda_header_wheels(tmp_path):
    run, calls = run_setup(tmp_path, tmp_path / "no-cuda")  # no nvcc there
    assert run.returncode == 0, run.stderr[-2000:]
    headers = [call for call in calls if all(pin in call for pin in header_pins())]
    assert headers and calls.index(headers[0]) < calls.index(te_install(calls)), calls
    assert te_install(calls).startswith("CUDA_HOME=<unset> "), "TE's build must find no toolkit: " + te_install(calls)


def test_with_a_toolkit_te_builds_against_it(tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    (cuda / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (cuda / "bin" / "nvcc").chmod(0o755)
    run, calls = run_setup(tmp_path, cuda)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not [call for call in calls if header_pins()[0] in call], calls
    assert te_install(calls).startswith(f"CUDA_HOME={cuda} "), te_install(calls)


def test_header_wheels_are_of_torchs_cuda_release():
    """The header wheels are of the CUDA release of the runtime wheel torch installed (13.0 for torch 2.11's cu130)."""
    try:
        runtime = importlib.metadata.version("nvidia-cuda-runtime")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch's CUDA runtime wheel is not installed here")
    release = runtime.split(".")[:2]
    assert all(pin.split("==")[1].split(".")[:2] == release for pin in header_pins()), (header_pins(), runtime)
