"""Write the README's performance table from committed benchmark results.

    python scripts/render_performance.py            # rewrite the README's block
    python scripts/render_performance.py --check    # exit 1 if the README's block differs (tests/test_docs.py)

Every number in the block comes from one file under ``benchmarks/results/`` (written by
``scripts/bench_export.py`` with a manifest beside it); ``ROWS`` names the file of each row, so a
new measurement changes the README by changing one path here and rendering again. Times are the
steady state of each side, measured side by side in one run: where the file has ``interleaved``
(rounds calling stock, ours and the floor in turn), each cell is the median of the rounds and their
range, the speedup and ``ours / floor`` the median and range of the per-round ratios; an older file
holds one sequential measurement per side (``<side>_steady_ms``, the floor timed apart), shown as one
number and marked ``SEQUENTIAL``, with a note under the table. Memory is the peak extra device memory
of one export beyond the model (``torch.cuda.max_memory_allocated``), cache off and cached. The
block lies between ``BEGIN`` and ``END`` in the README.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BEGIN = "<!-- performance: written by scripts/render_performance.py -->"
END = "<!-- end of performance -->"


@dataclass(frozen=True)
class Row:
    """One row: what was measured (``label``) and the result file (relative to ``RESULTS``)."""

    label: str
    result: str
    fp8: bool = False  # the row reports the file's FP8 export (fp8_* fields) instead of BF16


ROWS = (
    Row("Qwen3-8B shape (399 tensors, 16.4 GB)", "2026-11-27-h200x2/export_qwen3-8b_tp1_fp8.json"),
    Row("Qwen3-8B shape, blockwise FP8", "2026-11-27-h200x2/export_qwen3-8b_tp1_fp8.json", fp8=True),
    Row(
        "Qwen3-30B-A3B shape, 4 layers (128 experts, 1575 tensors)",
        "2026-11-27-h200x2/export_qwen3-30b-a3b-4layers_tp1.json",
    ),
    Row(
        "Qwen3-30B-A3B shape, 24 layers (9435 tensors, 31.2 GB)",
        "2026-11-27-h200x2/export_qwen3-30b-a3b-24layers_tp1.json",
    ),
    Row(
        "DeepSeek-V3 shape, 4 layers (MLA, 3 dense + 1 MoE layer of 256 experts; 821 tensors, 30.2 GB)",
        "2026-11-27-h200x2/export_deepseek-v3-4layers_tp1.json",
    ),
    Row(
        "Qwen3-VL-30B-A3B shape, 4 layers, packed experts from its checkpoint (398 tensors)",
        "2026-11-27-h200x2/export_qwen3-vl-30b-a3b-4layers_tp1_from_checkpoint.json",
    ),
    Row("Qwen3-8B shape", "2026-11-27-h200x2/export_qwen3-8b_tp2.json"),
    Row(
        "Qwen3-30B-A3B shape, 4 layers, Megatron's default expert-TP",
        "2026-11-27-h200x2/export_qwen3-30b-a3b-4layers_tp2_etp2.json",
    ),
)

SEQUENTIAL = "†"
SEQUENTIAL_NOTE = (
    f"{SEQUENTIAL} One sequential measurement, not yet rerun in rounds: each side's median of its steady calls, "
    "taken one side after the other, the floor timed apart."
)

HEADER = (
    "| device | model | layout | stock | ours | speedup | ours / floor | extra memory: stock, ours (cache off), ours (cached) |",
    "| --- | --- | --- | --- | --- | --- | --- | --- |",
)


def _gb(nbytes: int | None) -> str:
    return "–" if nbytes is None else f"{nbytes / 1e9:.2f} GB"


def _device(result: dict) -> str:
    name = result["device"].replace("NVIDIA ", "").replace(" HBM3", "").replace("80GB", "80 GB")
    world = result.get("world_size", 1)
    return f"{world}× {name}" if world > 1 else name


def _floor(result: dict) -> tuple[float, str]:
    """The floor an export is held against: one device copy of the bytes on one GPU, the all-gather of
    the same bytes when the model is split over ranks."""
    if result.get("world_size", 1) > 1 and result.get("gather_floor_ms"):
        return result["gather_floor_ms"], "all-gather"
    return result["clone_floor_ms"], "clone"


@dataclass(frozen=True)
class Times:
    """What a row's time cells show: per side one value per round (one value in all for a sequential
    measurement); ``stock_ms`` and ``speedup`` are None for the FP8 row (stock has no FP8 export)."""

    stock_ms: list[float] | None
    ours_ms: list[float]
    speedup: list[float] | None
    ours_over_floor: list[float]
    floor_ms: float
    floor: str
    interleaved: bool


def _interleaved_times(rounds: dict, fp8: bool) -> Times:
    ours, over_floor = ("fp8_ms", "fp8_over_floor") if fp8 else ("ours_ms", "ours_over_floor")
    return Times(
        stock_ms=None if fp8 else rounds["stock_ms"],
        ours_ms=rounds[ours],
        speedup=None if fp8 else rounds["speedup"],
        ours_over_floor=rounds[over_floor],
        floor_ms=statistics.median(rounds["floor_ms"]),
        floor=rounds["floor"],
        interleaved=True,
    )


def _sequential_times(result: dict, fp8: bool) -> Times:
    floor_ms, floor = _floor(result)
    ours = result["fp8_steady_ms"] if fp8 else result["refit_cached_steady_ms"]
    stock = None if fp8 else result["stock_steady_ms"]
    return Times(
        stock_ms=None if stock is None else [stock],
        ours_ms=[ours],
        speedup=None if stock is None else [stock / ours],
        ours_over_floor=[ours / floor_ms],
        floor_ms=floor_ms,
        floor=floor,
        interleaved=False,
    )


def times(result: dict, fp8: bool) -> Times:
    if "interleaved" in result:
        return _interleaved_times(result["interleaved"], fp8)
    return _sequential_times(result, fp8)


def _spread(values: list[float] | None, digits: int, unit: str, interleaved: bool) -> str:
    """``median unit (min–max)`` of rounds, or the one value of a sequential measurement; ``–`` for none."""
    if values is None:
        return "–"
    number = f"{statistics.median(values):.{digits}f}{unit}"
    return f"{number} ({min(values):.{digits}f}–{max(values):.{digits}f})" if interleaved else number


def _result(row: Row, results: Path) -> dict:
    return json.loads((results / row.result).read_text())


def render_row(row: Row, results: Path = RESULTS) -> str:
    result = _result(row, results)
    shown = times(result, row.fp8)
    if row.fp8:
        memory = f"–, –, {_gb(result.get('fp8_peak_extra_bytes'))}"
    else:
        memory = ", ".join(
            _gb(result.get(key))
            for key in ("stock_peak_extra_bytes", "refit_peak_extra_bytes", "refit_cached_peak_extra_bytes")
        )
    mark = "" if shown.interleaved else f" {SEQUENTIAL}"
    cells = (
        f"[{_device(result)}](benchmarks/results/{row.result}){mark}",
        row.label,
        result["layout"].upper().replace("_", "×"),
        _spread(shown.stock_ms, 1, " ms", shown.interleaved),
        _spread(shown.ours_ms, 2, " ms", shown.interleaved),
        _spread(shown.speedup, 1, "×", shown.interleaved),
        f"{_spread(shown.ours_over_floor, 2, '×', shown.interleaved)} the {shown.floor_ms:.2f} ms {shown.floor}",
        memory,
    )
    return "| " + " | ".join(cells) + " |"


def render_block(rows: tuple[Row, ...] = ROWS, results: Path = RESULTS) -> list[str]:
    """The block: the table, and under it the note on rows of one sequential measurement, if any."""
    sequential = any("interleaved" not in _result(row, results) for row in rows)
    note = ["", SEQUENTIAL_NOTE] if sequential else []
    return [BEGIN, *HEADER, *(render_row(row, results) for row in rows), *note, END]


def replace_block(text: str, block: list[str]) -> str:
    """``text`` with the lines between ``block``'s first and last line (its markers) replaced by ``block``."""
    first, last = block[0], block[-1]
    begin, end = text.find(first), text.find(last)
    if begin < 0 or end < begin:
        raise SystemExit(f"the page lacks the markers {first!r} ... {last!r}: add them where the table goes")
    return text[:begin] + "\n".join(block) + text[end + len(last) :]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=REPO / "README.md", help="the page whose block is rewritten")
    parser.add_argument("--check", action="store_true", help="exit 1 if the block differs instead of rewriting it")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    rendered = replace_block(text, render_block())
    if args.check:
        if rendered != text:
            print(f"{args.readme}: the performance block differs from the committed results; run {__file__}")
            return 1
        return 0
    args.readme.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
