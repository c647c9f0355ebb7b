"""pyproject's dependencies are ranges (install into an existing Megatron / vLLM environment
without re-pinning torch); the exact versions the project tests are pinned by scripts/setup.sh and
scripts/requirements.txt, and each of those pins lies inside pyproject's range."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
STACK = ("torch", "megatron-core", "megatron-bridge", "transformer-engine", "transformers")


def _pyproject_requirements():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for group in project["optional-dependencies"].values() for r in group]
    return {r.name: r for r in reqs}


def _exact_pins():
    """name -> version pinned with == in scripts/requirements.txt and scripts/setup.sh."""
    text = (ROOT / "scripts/requirements.txt").read_text() + (ROOT / "scripts/setup.sh").read_text()
    return {
        m[1]: m[2] for m in re.finditer(r'^\s*(?:\w+_PIN=")?([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s"]+)', text, re.M)
    }


@pytest.mark.parametrize("name", STACK + ("vllm",))
def test_pyproject_dependency_is_a_range_holding_the_tested_pin(name):
    req = _pyproject_requirements()[name]
    assert not any(s.operator in ("==", "===") for s in req.specifier), f"{req}: an exact pin in pyproject"
    pinned = _exact_pins().get(name)
    if name == "vllm":
        return  # the GPU host pins it (scripts/gpu/)
    assert pinned is not None, f"{name}: no exact pin in scripts/requirements.txt or scripts/setup.sh"
    assert req.specifier.contains(pinned, prereleases=True), f"{name}=={pinned} is outside pyproject's {req}"
