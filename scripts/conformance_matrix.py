"""Write docs/conformance.md and the README's support matrix: the conformance matrix of every
registered architecture on CPU.

    python scripts/conformance_matrix.py [--out docs/conformance.md] [--readme README.md] [--cells cells.json]
    python scripts/conformance_matrix.py --from-cells a.json b.json  # render again without running
    python scripts/conformance_matrix.py --parts roundtrip --jobs 8 --cells b.json  # a part, cells 8 at a time
    python scripts/conformance_matrix.py --only GptOssForCausalLM,tp1:LlamaForCausalLM --cells c.json  # some cells
    python scripts/conformance_matrix.py --parts lora --cells d.json  # the LoRA cells alone (their launches)

Runs the checks ``tests/test_conformance.py`` runs (``python -m mbridge_refit.testing.conformance``,
one launch per world size for the layouts of ``MATRIX_LAYOUTS``, CPU ranks under torchrun, the
LoRA cells in the launches of ``LORA_LAYOUTS``; the roundtrip columns through
``mbridge_refit.testing.roundtrip_conformance``), then writes the page:
one row per architecture, a column per layout and precision, each cell's state linking to the
test that proves it, the counts per state, and the reason of every cell that is not on the fast
path. The README's block between ``README_BEGIN`` and ``README_END`` gets the counts and the cells
of ``README_FAMILIES``, one letter per cell. Exits 1 when a cell fails (``different``
or ``our export failed``); the pages are written anyway.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections import Counter
from importlib import metadata
from pathlib import Path

from torch.distributed.elastic.utils.distributed import get_free_port as free_port

REPO = Path(__file__).resolve().parents[1]
TEST_MODULE = REPO / "tests" / "test_conformance.py"
TEST_OF_PRECISION = {  # in TEST_MODULE
    "bf16": "test_bf16_matches_stock",
    "fp8": "test_fp8_matches_reference",
    "roundtrip": "test_roundtrip_matches_disk",
    "lora-merged": "test_lora_merged_matches_stock",
    "lora-adapter": "test_lora_adapter_matches_stock",
}
PRECISIONS = tuple(TEST_OF_PRECISION)  # a column per layout each (where the layout has such cells)
README_PRECISIONS = ("bf16", "fp8", "roundtrip")  # the README's letters per cell; the LoRA columns are on the page
VERSIONS = ("torch", "megatron-core", "megatron-bridge", "transformers")
README_FAMILIES = (  # the README's rows: the families RL users refit most (issue #17); docs/conformance.md has all
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "GptOssForCausalLM",
    "NemotronHForCausalLM",
    "Qwen3VLMoeForConditionalGeneration+packed_experts",
)
README_BEGIN = "<!-- support matrix: written by scripts/conformance_matrix.py -->"
README_END = "<!-- end of support matrix -->"
STATE_LETTERS = {  # the README's one letter per cell state (the page spells them out)
    "fast path, exact": "E",
    "exact": "E",
    "stock fallback, exact": "S",
    "FP8 refused": "r",
    "refused": "r",
    "upstream broken": "U",
    "cannot be built here": "n",
    "different": "DIFFERENT",
    "our export failed": "FAILED",
}


def launch(layout_names: list[str], nproc: int, json_path: Path, only: str, lora: bool) -> None:
    """Run the layouts' ranks, one launch (plain python for one rank, as the tests do), the LoRA
    cells too where ``lora``; raise if they fail."""
    module = [
        "-m",
        "mbridge_refit.testing.conformance",
        "--layout",
        ",".join(layout_names),
        "--json",
        str(json_path),
        "--only",
        only,
        "--lora",
        "all" if lora else "",
    ]
    launcher = (
        []
        if nproc == 1
        else [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
        ]
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, *launcher, *module], cwd=REPO, env=env, check=True)


def run_roundtrip(jobs: int, only: str) -> list:
    """The roundtrip columns: ``convert roundtrip`` of every architecture of every layout against
    its file (TP1 in one process, each cell at more ranks launched on its own, ``jobs`` at a time)."""
    from mbridge_refit.testing.conformance import MATRIX_LAYOUTS, Cell

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "roundtrip.json"
        module = [
            "-m",
            "mbridge_refit.testing.roundtrip_conformance",
            "--layout",
            ",".join(MATRIX_LAYOUTS),
            "--json",
            str(path),
            "--jobs",
            str(jobs),
            "--only",
            only,
        ]
        subprocess.run([sys.executable, *module], cwd=REPO, env=env, check=True)
        return [Cell.from_json(c) for c in json.loads(path.read_text())]


def only_at(layout_names: list[str], only: str) -> str:
    """The entries of ``--only`` (``ARCH`` or ``LAYOUT:ARCH``) that run at ``layout_names``."""
    return ",".join(e for e in only.split(",") if e and (":" not in e or e.partition(":")[0] in layout_names))


def run_matrix(only: str, *, lora: bool, layouts: tuple[str, ...] | None = None) -> dict[str, list]:
    """layout name -> rank 0's cells (every rank's states checked equal), in ``MATRIX_LAYOUTS`` order:
    of every layout, or of ``layouts``; with the LoRA cells where ``lora``."""
    from mbridge_refit.testing.conformance import MATRIX_LAYOUTS, read_cells

    by_world_size: dict[int, list[str]] = {}
    for layout_name, (layout, _) in MATRIX_LAYOUTS.items():
        if layouts is None or layout_name in layouts:
            by_world_size.setdefault(layout.expected_world_size, []).append(layout_name)
    matrix: dict[str, list] = {name: [] for name in MATRIX_LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc, layout_names in by_world_size.items():
            path = Path(tmp) / f"ranks{nproc}.json"
            mine = only_at(layout_names, only)
            if only and not mine:
                continue  # none of ``only`` runs at these layouts
            launch(layout_names, nproc, path, mine, lora)
            ranks = read_cells(path, nproc)
            disagreeing = [c.architecture for cells in zip(*ranks) for c in cells if c.state != cells[0].state]
            if disagreeing or len({len(cells) for cells in ranks}) != 1:
                raise SystemExit(f"{layout_names}: ranks disagree on {sorted(set(disagreeing))}")
            for cell in ranks[0]:
                matrix[cell.layout].append(cell)
    return matrix


def test_lines() -> dict[str, int]:
    """Test function name -> its line in TEST_MODULE (the cells link there)."""
    tree = ast.parse(TEST_MODULE.read_text())
    lines = {node.name: node.lineno for node in tree.body if isinstance(node, ast.FunctionDef)}
    missing = set(TEST_OF_PRECISION.values()) - set(lines)
    if missing:
        raise SystemExit(f"{TEST_MODULE} lacks {sorted(missing)}: update TEST_OF_PRECISION")
    return lines


def layout_label(layout_name: str) -> str:
    """``tp2ep2`` -> ``TP2×EP2``: a layout name as the page writes it."""
    return re.sub(r"(?<=\d)(?=[A-Z])", "×", layout_name.upper())


def tests_legend(
    matrix: dict[str, list], lines: dict[str, int], page_dir: Path, precisions: tuple[str, ...] = PRECISIONS
) -> str:
    """One line naming the test of each precision, linked to its line; a cell's test id is
    ``LAYOUT-ARCH`` (the links' example: TP1 Qwen3), so the cells themselves stay plain text."""
    cells = {(c.layout, c.architecture) for cells in matrix.values() for c in cells}
    layout, architecture = ("tp1", "Qwen3ForCausalLM") if ("tp1", "Qwen3ForCausalLM") in cells else min(cells)
    target = os.path.relpath(TEST_MODULE, page_dir)
    links = [
        f'{precision.upper()} [`{function}`]({target}#L{lines[function]} "{function}[{layout}-{architecture}]")'
        for precision, function in TEST_OF_PRECISION.items()
        if precision in precisions
    ]
    return "Each cell is the state of its test, id `LAYOUT-ARCH`: " + ", ".join(links) + "."


def render(matrix: dict[str, list], page_dir: Path, runs: list[dict[str, str]]) -> str:
    lines = test_lines()
    present = {(c.layout, c.precision) for cells in matrix.values() for c in cells}
    columns = [(layout, precision) for layout in matrix for precision in PRECISIONS if (layout, precision) in present]
    by_key = {(c.architecture, c.layout, c.precision): c for cells in matrix.values() for c in cells}
    architectures = sorted({c.architecture for cells in matrix.values() for c in cells})
    out = [
        *_header(runs),
        "## Counts",
        "",
        *_counts_table(matrix, columns),
        "",
        "## Cells",
        "",
        tests_legend(matrix, lines, page_dir),
        "",
    ]
    out.append("| architecture | " + " | ".join(f"{layout_label(layout)} {p.upper()}" for layout, p in columns) + " |")
    out.append("| --- " * (len(columns) + 1) + "|")
    for architecture in architectures:
        row = [str(by_key[k].state) if (k := (architecture, layout, p)) in by_key else "–" for layout, p in columns]
        out.append(f"| {architecture} | " + " | ".join(row) + " |")
    out += ["", "## CPU build concessions", ""]
    out += _concessions_table(matrix)
    out += ["", "## Reasons", "", *_reasons_table(matrix)]
    return "\n".join(out) + "\n"


def _header(runs: list[dict[str, str]]) -> list[str]:
    def described(run: dict[str, str]) -> str:
        versions = ", ".join(f"{name} {run[name]}" for name in VERSIONS)
        return f"on {run['date']} at commit `{run['commit']}` on CPU ranks of {run.get('machine', 'this machine')} ({versions})"

    generated = (
        described(runs[0])
        if len(runs) == 1
        else "from these runs (a later run's cell replaces an earlier one's): "
        + "; ".join(f"({i}) {described(run)}" for i, run in enumerate(runs, 1))
    )
    return [
        "# Conformance matrix",
        "",
        "Every architecture Megatron-Bridge registers (`AutoBridge.list_supported_models()`), built as a tiny",
        "random model on CPU ranks (gloo; Megatron's local layer spec, or a Transformer Engine spec with CPU",
        "stand-ins holding the GPU build's parameters: `mbridge_refit/models/cpu_specs.py`): RefitBridge's",
        "export against stock `export_hf_weights` on the same model (same names in the same order, same",
        "dtype, shape and bytes),",
        "and its blockwise FP8 export against the reference quantizer applied to stock's tensors. Every",
        "architecture runs at TP1; TP2, PP2, EP2 and TP2×EP2 (2 ranks each) run the families that build on",
        "CPU, chosen to cover the placement kinds each layout splits (`MATRIX_LAYOUTS` in",
        "`mbridge_refit/testing/conformance.py` says which and why; `–`: not run at that layout).",
        "Rows `ARCH+packed_experts` are checkpoint variants: the bridge is built from the tiny checkpoint, whose",
        "routed experts are packed in one tensor per projection (Qwen3-VL-MoE's in its published transposed",
        "layout), so it maps them with its packed-expert mappings (`mbridge_refit/testing/tiny_models.py`).",
        "`Gemma4ForCausalLM+moe_block` is Gemma 4's MoE model (`enable_moe_block`: 26B-A4B), which the bridge builds",
        "with another provider and layer spec (`VARIANT_CONFIG_OVERRIDES` in `mbridge_refit/testing/tiny_models.py`).",
        "The LORA columns (TP1, `LORA_LAYOUTS`): the same model then wrapped with Megatron-Bridge's `LoRA`",
        "(`megatron.bridge.peft.lora`, its default targets `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`;",
        "r 4, alpha 8), every adapter factor random (B too): LORA-MERGED is `export_hf_weights` (merged, stock's",
        "default) against stock's merged export, LORA-ADAPTER `export_adapter_weights` against stock's adapter",
        "export, both oracles from a model bridge made as stock's `AutoBridge` makes one per call",
        "(`check_lora` in `mbridge_refit/testing/conformance.py`). `LoRA cannot wrap`: the wrap raised (on CPU,",
        "mostly LoRA not knowing the CPU stand-in of Transformer Engine's grouped expert linear) or wrapped",
        "nothing; `upstream broken` there: stock's merged or adapter export failed, its merged export equals the",
        "export before the wrap, or its adapter export yields a name twice; `stock fallback, exact`: our plan",
        "refused the adapters (the reason below) and the stock path ran.",
        "States: `fast path, exact`; `stock fallback, exact` (the plan refused the model, the export is",
        "stock's); `FP8 refused` (FP8 needs the plan: refused before any work, with the reason);",
        "`cannot be built here` (config, bridge or model construction failed on CPU); `upstream broken`",
        "(stock's own export failed); `LoRA cannot wrap`. A difference or a failure of our export fails the test.",
        "The ROUNDTRIP columns: a tiny random HF checkpoint of the architecture through `convert roundtrip`",
        "on CPU at that layout (`convert --nproc-per-node 2 roundtrip --tp 2 ...` beyond TP1), every tensor",
        "compared with the file (`exact`; `refused`: convert exited with an input error naming why;",
        "`upstream broken`: the bridge maps no conversion task to some parameters of the build).",
        "The tests run every TP1 cell and some cells at 2 ranks by default, the others with `-m slow`.",
        "The legend above the cells names the test of each precision; a cell's test id is `LAYOUT-ARCH`.",
        "",
        f"Generated by `python scripts/conformance_matrix.py` {generated}; the tests run the same checks: "
        "`pytest tests/test_conformance.py`.",
        "",
    ]


def _counts_table(matrix: dict[str, list], columns: list[tuple[str, str]]) -> list[str]:
    """One row per layout and precision: its ranks, architectures, and cells in each state."""
    from mbridge_refit.testing.conformance import MATRIX_LAYOUTS, CellState

    states = [str(state) for state in CellState]  # every state, the failing ones too (0 when none)
    table = ["| layout | ranks | precision | " + " | ".join(states) + " |", "| --- " * (len(states) + 3) + "|"]
    for layout, precision in columns:
        counts = Counter(str(c.state) for c in matrix[layout] if c.precision == precision)
        ranks = MATRIX_LAYOUTS[layout][0].expected_world_size
        table.append(
            f"| {layout_label(layout)} | {ranks} | {precision.upper()} | "
            + " | ".join(str(counts[s]) for s in states)
            + " |"
        )
    return table


def _concessions_table(matrix: dict[str, list]) -> list[str]:
    """Which architectures were built with which CPU concessions (and what each changes)."""
    from mbridge_refit.models.builder import CPU_WEIGHT_ONLY_CONCESSIONS

    users: dict[str, set[str]] = {}
    for cells in matrix.values():
        for cell in cells:
            for field in cell.concessions:
                users.setdefault(field, set()).add(cell.architecture)
    table = [
        "Provider settings a CPU build cannot honour, set to one it can (`CPU_WEIGHT_ONLY_CONCESSIONS` in",
        "`mbridge_refit/models/builder.py`, which `convert` takes too); none changes a parameter's name,",
        "shape, mapping or bytes.",
        'Every CPU build also runs with `torch.cuda.current_device()` answering `"cpu"`: Megatron-Core',
        "allocates the MoE router's expert-bias buffers there whatever `use_cpu_initialization` says.",
        "CPU builds use sequential experts (no grouped GEMM); a family whose mapping names only grouped",
        "experts makes stock's export fail on them (`upstream broken`, the reason names the parameters).",
        "",
        "| setting | CPU value | why, and what it changes | architectures |",
        "| --- | --- | --- | --- |",
    ]
    for field, (value, why) in CPU_WEIGHT_ONLY_CONCESSIONS.items():
        table.append(f"| `{field}` | `{value}` | {why} | {', '.join(sorted(users.get(field, ()))) or '–'} |")
    return table


def _reasons_table(matrix: dict[str, list]) -> list[str]:
    """One row per architecture, layout and reason (BF16 and FP8 cells with the same reason share it)."""
    rows: dict[tuple[str, str, str, str], list[str]] = {}
    for layout, cells in matrix.items():
        for cell in cells:
            if cell.detail:
                rows.setdefault((cell.architecture, layout, str(cell.state), cell.detail), []).append(
                    cell.precision.upper()
                )
    table = ["| architecture | cells | state | reason |", "| --- | --- | --- | --- |"]
    for (architecture, layout, state, detail), precisions in sorted(rows.items(), key=lambda row: row[0][:2]):
        reason = detail.replace("|", "\\|").replace("\n", " ")
        table.append(f"| {architecture} | {layout_label(layout)} {'+'.join(precisions)} | {state} | {reason} |")
    return table


def this_run(commit: str | None = None) -> dict[str, str]:
    """The date, the commit (default: the one checked out), the machine and the versions the cells
    are run with."""
    if commit is None:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "machine": machine,
        **{name: metadata.version(name) for name in VERSIONS},
    }


def render_readme_block(matrix: dict[str, list], readme_dir: Path) -> list[str]:
    """The README's support matrix: the counts per state of every layout and precision, then a row
    per ``README_FAMILIES`` architecture, a column per layout, the BF16 / FP8 / ROUNDTRIP states as
    letters linked to their tests (docs/conformance.md has every architecture)."""
    lines = test_lines()
    by_key = {(c.architecture, c.layout, c.precision): c for cells in matrix.values() for c in cells}

    def letters(architecture: str, layout: str) -> str:
        cells = [by_key.get((architecture, layout, precision)) for precision in README_PRECISIONS]
        if not any(cells):
            return "–"
        return " ".join(STATE_LETTERS[str(c.state)] if c else "·" for c in cells)

    def counts(layout: str, precision: str) -> str:
        found = Counter(STATE_LETTERS[str(c.state)] for c in matrix[layout] if c.precision == precision)
        return ", ".join(f"{n} {letter}" for letter, n in sorted(found.items(), key=lambda item: -item[1])) or "–"

    return [
        README_BEGIN,
        "| cells per state | " + " | ".join(p.upper() for p in README_PRECISIONS) + " |",
        "| --- " * (len(README_PRECISIONS) + 1) + "|",
        *(
            f"| {layout_label(layout)} | " + " | ".join(counts(layout, p) for p in README_PRECISIONS) + " |"
            for layout in matrix
        ),
        "",
        "| family (BF16 FP8 ROUNDTRIP) | " + " | ".join(layout_label(layout) for layout in matrix) + " |",
        "| --- " * (len(matrix) + 1) + "|",
        *(f"| {a} | " + " | ".join(letters(a, layout) for layout in matrix) + " |" for a in README_FAMILIES),
        "",
        "`E` exact (BF16/FP8: on the fast path), `S` stock fallback, exact, `r` refused by name, `U` upstream broken,",
        "`n` cannot be built on CPU, `·` not run, `–` layout not run.",
        tests_legend(matrix, lines, readme_dir, README_PRECISIONS),
        README_END,
    ]


def write_readme_block(readme: Path, block: list[str]) -> None:
    """Replace the README's lines from ``README_BEGIN`` to ``README_END`` with ``block``."""
    text = readme.read_text()
    begin, end = text.find(README_BEGIN), text.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(
            f"{readme} lacks the markers {README_BEGIN!r} ... {README_END!r}: add them where the matrix goes"
        )
    readme.write_text(text[:begin] + "\n".join(block) + text[end + len(README_END) :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "conformance.md")
    parser.add_argument(
        "--readme", type=Path, default=REPO / "README.md", help="the page whose support matrix block is rewritten"
    )
    parser.add_argument("--cells", type=Path, default=None, help="also write every cell (JSON) here")
    parser.add_argument(
        "--from-cells",
        type=Path,
        nargs="+",
        default=None,
        help="render the cells of earlier runs (--cells) instead of running; a later run's cell replaces an earlier one's",
    )
    parser.add_argument(
        "--parts",
        default="export,roundtrip,lora",
        help="what to run, comma-separated: export (the BF16/FP8 cells), roundtrip, lora (the LoRA cells; "
        "alone: only their launches, keeping only them)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="roundtrip cells of more than one rank run this many at a time"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated ARCH (at every layout) or LAYOUT:ARCH (default: every cell)"
    )
    parser.add_argument("--commit", default=None, help="the commit the cells are run at (default: the checkout's HEAD)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"export", "roundtrip", "lora"}:
        parser.error(f"--parts {args.parts!r}: choose from export, roundtrip, lora")
    from mbridge_refit.testing.conformance import LORA_LAYOUTS, LORA_PRECISIONS, MATRIX_LAYOUTS, Cell

    if args.from_cells:
        saved = [json.loads(path.read_text()) for path in args.from_cells]
        runs, matrix = [one["run"] for one in saved], {name: [] for name in MATRIX_LAYOUTS}
        latest = {}  # a later run's cell replaces an earlier run's cell of the same column
        for cell in (Cell.from_json(c) for one in saved for c in one["cells"]):
            latest[cell.architecture, cell.layout, cell.precision] = cell
        for cell in latest.values():
            matrix[cell.layout].append(cell)
    else:
        runs = [this_run(args.commit)]
        matrix = {name: [] for name in MATRIX_LAYOUTS}
        if "export" in parts:
            matrix = run_matrix(args.only, lora="lora" in parts)
        elif "lora" in parts:  # the launches of the LoRA layouts, their LoRA cells only
            ran = run_matrix(args.only, lora=True, layouts=LORA_LAYOUTS)
            matrix = {name: [c for c in ran[name] if c.precision in LORA_PRECISIONS] for name in MATRIX_LAYOUTS}
        for cell in run_roundtrip(args.jobs, args.only) if "roundtrip" in parts else ():
            matrix[cell.layout].append(cell)
    if args.cells:
        cells = [c.to_json() for layout_cells in matrix.values() for c in layout_cells]
        args.cells.write_text(json.dumps({"run": runs[0], "cells": cells}, indent=1))
    args.out.write_text(render(matrix, args.out.resolve().parent, runs))
    write_readme_block(args.readme, render_readme_block(matrix, args.readme.resolve().parent))
    failing = [c for cells in matrix.values() for c in cells if not c.state.passes]
    print(f"wrote {args.out}; {sum(len(c) for c in matrix.values())} cells, {len(failing)} failing")
    for cell in failing:
        print(f"FAILING {cell.architecture} {cell.layout} {cell.precision}: {cell.state}: {cell.detail}")
    sys.exit(1 if failing else 0)


if __name__ == "__main__":
    main()
