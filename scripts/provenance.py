"""Benchmark results with their provenance (shared by the scripts in this folder).

``results_dir()``: ``benchmarks/results/<date>-<device>/`` for a run on this machine.
``write_result(directory, name, payload)``: writes ``name`` (JSON) and records beside it, in
``manifest.json``, what produced it: the commit, the package versions, the exact command and the
device. Docs cite results by their folder; a run nobody cites is left to git history.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PACKAGES = ("torch", "megatron-core", "megatron-bridge", "transformer-engine", "transformers", "triton", "vllm")


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    return torch.cuda.get_device_name() + (f" x{count}" if count > 1 else "")


def results_dir(device: str | None = None) -> Path:
    """``benchmarks/results/<today>-<device slug>/`` (e.g. ``2026-11-23-h200``)."""
    slug = (device or device_name()).split(" x")[0].split()[-1].lower()
    count = (device or device_name()).partition(" x")[2]
    return RESULTS / f"{datetime.date.today().isoformat()}-{slug}{'x' + count if count else ''}"


def write_result(directory: Path, name: str, payload: dict, *, device: str | None = None) -> Path:
    """Write ``payload`` to ``directory/name`` and its provenance to ``directory/manifest.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(payload, indent=2) + "\n")
    manifest_path = directory / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"runs": {}}
    manifest.setdefault("runs", {})[name] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device or device_name(),
        "commit": _commit(),
        "versions": _versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def _commit() -> str:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return commit + (" (with uncommitted changes)" if dirty else "")


def _versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions
