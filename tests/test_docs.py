"""The user docs: the README stays a user's page, every relative link in it and in docs/ resolves (anchors
included), and the pages rendered from committed results are what their scripts render."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
README_MAX_LINES = 175


def relative_links(page: Path) -> list[str]:
    return [link for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()) if not re.match(r"[a-z]+://", link)]


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move depth to docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_links_resolve(page):
    broken = [link for link in relative_links(page) if not (page.parent / link).exists()]
    assert not broken, f"{page.name}: broken links {broken}"


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](missing.md) [web](https://example.org/x)")
    assert [link for link in relative_links(page) if not (page.parent / link).exists()] == ["missing.md"]


def anchors(page: Path) -> set[str]:
    """The anchors a page has on GitHub: each heading's slug (lower case, punctuation dropped, spaces to
    hyphens; a repeated slug gets -1, -2, ...) and every ``<a id>`` / ``<a name>``."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' in a code block is no heading
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found | set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))


def broken_anchors(page: Path) -> list[str]:
    """Links of ``page`` to an anchor of a markdown page (itself or a relative one) that the page lacks."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]*#[^)\s]+)", page.read_text()):
        path, _, anchor = link.partition("#")
        if re.match(r"[a-z]+://", link) or not (path == "" or path.endswith(".md")):
            continue
        target = page if path == "" else page.parent / path
        if not target.exists() or anchor not in anchors(target):
            broken.append(link)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_anchors_resolve(page):
    broken = broken_anchors(page)
    assert not broken, f"{page.name}: links to anchors the target page lacks: {broken}"


def test_anchor_check_sees_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## The replay's copies (2× H200, 0.26.0)\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text(
        '<a id="kept"></a>\n[a](other.md#the-replays-copies-2-h200-0260) [b](other.md#same-1) [c](#kept) '
        "[gone](other.md#gone) [d](#nowhere) [code](x.py#L3)"
    )
    assert broken_anchors(page) == ["other.md#gone", "#nowhere"]


def test_performance_table_is_rendered_from_committed_results(tmp_path):
    """The README's performance block is what scripts/render_performance.py renders from the result
    files it names; a number edited by hand makes the check fail (the control below)."""
    import subprocess
    import sys

    script = REPO / "scripts" / "render_performance.py"
    run = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    edited = tmp_path / "README.md"
    text = (REPO / "README.md").read_text()
    begin = text.index("<!-- performance:")
    row = text.index("| [", begin)
    end = text.index("<!-- end of performance -->")
    assert " ms" in text[row:end]  # the edit below lands in the block (either cell format)
    edited.write_text(text[:row] + text[row:].replace(" ms", " ms (edited)", 1))
    run = subprocess.run(
        [sys.executable, str(script), "--check", "--readme", str(edited)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1 and "differ" in run.stdout


def test_performance_page_is_rendered_from_committed_results(tmp_path):
    """docs/performance.md is what scripts/render_performance.py renders from benchmarks/results/ (the check
    above covers both pages); a cell edited by hand in a copy of it makes the check fail, naming the page."""
    import subprocess
    import sys

    edited = tmp_path / "performance.md"
    text = (REPO / "docs" / "performance.md").read_text()
    row = text.index('<a id="colocated-ipc">')
    assert " ms (" in text[row:]
    edited.write_text(text[:row] + text[row:].replace(" ms (", " ms (edited, ", 1))
    script = REPO / "scripts" / "render_performance.py"
    run = subprocess.run(
        [sys.executable, str(script), "--check", "--page", str(edited)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1 and str(edited) in run.stdout, run.stdout + run.stderr


def test_performance_page_has_one_section_per_refit_path():
    """The anchors README.md and docs/refit/ link to: one per path, in the page as ``<a id>``."""
    page = REPO / "docs" / "performance.md"
    assert {"export", "colocated-ipc", "sharded", "broadcast", "reshard", "lora"} <= anchors(page)


def test_refit_estimate_is_rendered_from_committed_results(tmp_path):
    """docs/benchmarks/scale.md's refit estimate block and refit_estimate.json are what scripts/estimate_refit.py
    computes from the traffic and cost files it names; a number edited by hand makes the check fail."""
    import subprocess
    import sys

    script = REPO / "scripts" / "estimate_refit.py"
    run = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    edited = tmp_path / "scale.md"
    text = (REPO / "docs" / "benchmarks" / "scale.md").read_text()
    begin = text.index("<!-- refit estimate:")
    edited.write_text(text[:begin] + text[begin:].replace(" ms (", " ms (edited, ", 1))
    run = subprocess.run(
        [sys.executable, str(script), "--check", "--page", str(edited)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1 and "differs" in run.stdout


# Dotted names the README shows in backticks under the package's subpackages, e.g. `sinks.WeightSink`.
_SUBPACKAGES = ("engines", "sinks", "plan", "runtime", "checkpoints", "fp8", "convert", "errors")
_DOTTED = re.compile(r"`((?:mbridge_refit\.)?(?:" + "|".join(_SUBPACKAGES) + r")(?:\.[A-Za-z_]\w*)+)`")


def _readme_names() -> list[str]:
    """Every ``from mbridge_refit... import a, b`` of the README's code blocks, as ``module:name``, and
    every backticked dotted package name of its text."""
    text = (REPO / "README.md").read_text()
    names = []
    for module, imported in re.findall(r"^\s*from (mbridge_refit[\w.]*) import ([\w, ]+)", text, re.M):
        names += [f"{module}:{name.strip()}" for name in imported.split(",")]
    for dotted in _DOTTED.findall(text):
        dotted = dotted if dotted.startswith("mbridge_refit.") else f"mbridge_refit.{dotted}"
        names.append(dotted)
    names += [f"mbridge_refit.bridge.RefitBridge.{method}" for method in re.findall(r"\bbridge\.([a-z_]\w*)", text)]
    sinks = text[text.index("## Sinks") :].split("\n## ", 1)[0]  # its table names the sinks by class
    names += [f"mbridge_refit.sinks:{name}" for name in re.findall(r"`([A-Z]\w+)`", sinks)]
    return sorted(set(names))


def _resolves(name: str) -> bool:
    import importlib

    if ":" in name:
        module, attribute = name.split(":")
        return hasattr(importlib.import_module(module), attribute)
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def test_every_name_the_readme_shows_exists():
    names = _readme_names()
    assert len(names) >= 10, f"the README shows few package names; the scan found {names}"
    missing = [name for name in names if not _resolves(name)]
    assert not missing, f"README.md names what the package does not have: {missing}"


def test_name_check_sees_a_missing_name():
    assert _resolves("mbridge_refit.sinks.DiscardSink") and not _resolves("mbridge_refit.sinks.NoSuchSink")
    assert not _resolves("mbridge_refit.no_such_module:Thing".replace(":", ".")) and not _resolves(
        "mbridge_refit.errors:Nope"
    )


def readme_commands() -> list[str]:
    """The README's shell commands (the first fenced block), comments cut."""
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_readme_main_command_runs_and_verifies(tmp_path):
    """The README's main command, as written there, on the tiny default (CPU, 4 ranks, no downloads):
    a tiny Qwen3 through Megatron TP2 x PP2 and back, the result identical to its source. In CI this
    runs on the fresh clone the test command just set up."""
    import os
    import subprocess

    from conftest import free_port

    command = next(c for c in readme_commands() if "demo" in c)
    run = subprocess.run(
        [*command.split(), str(tmp_path / "demo")],
        cwd=REPO,
        env={**os.environ, "MASTER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "identical:" in run.stdout, run.stdout[-2000:]


def readme_python_api() -> str:
    """The code block of the README's "Python API" section, as written there."""
    section = (REPO / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_api_runs_on_cpu(tmp_path):
    """The README's Python API block, as written there, in a fresh CPU process (gloo, one rank) beside the
    tiny checkpoint it names, written by ``convert make-tiny`` from the built-in recipe (no downloads): it
    runs, and the tensors it keeps equal the checkpoint on disk (names, dtypes, bytes)."""
    import os
    import subprocess
    import sys

    import torch
    from safetensors.torch import load_file

    from mbridge_refit.models import recipes

    snippet = readme_python_api()
    name = re.search(r'from_hf_pretrained\("([^"]+)"\)', snippet).group(1)
    assert not Path(name).is_absolute(), (
        f"the README's block reads {name}: name a checkpoint `make-tiny` writes beside it"
    )
    recipes.make_random_checkpoint(recipes.DEFAULT_MODEL, tmp_path / name, seed=3)
    kept = tmp_path / "kept.pt"
    script = f"{snippet}\nimport torch as _t\n_t.save(weights, {str(kept)!r})\n"
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    weights, disk = torch.load(kept), load_file(tmp_path / name / "model.safetensors")
    assert sorted(weights) == sorted(disk)
    different = [n for n in disk if weights[n].dtype != disk[n].dtype or not torch.equal(weights[n], disk[n])]
    assert not different, f"the README's block kept tensors unlike the checkpoint's: {different}"
