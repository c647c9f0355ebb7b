"""Write the README's performance table from committed benchmark results.

    python scripts/render_performance.py            # rewrite the README's block
    python scripts/render_performance.py --check    # exit 1 if the README's block differs (tests/test_docs.py)

Every number in the block comes from one file under ``benchmarks/results/`` (written by
``scripts/bench_export.py`` with a manifest beside it); ``ROWS`` names the file of each row, so a
new measurement changes the README by changing one path here and rendering again. Times are the
steady state of each side, measured side by side in one run; memory is the peak extra device
memory of one export beyond the model (``torch.cuda.max_memory_allocated``), cache off and cached.
The block lies between ``BEGIN`` and ``END`` in the README.
"""

from __future__ import annotations

import argparse
import json
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
    Row("Qwen3-8B shape (399 tensors, 16.4 GB)", "2026-11-24-h100/export_qwen3-8b_tp1.json"),
    Row("Qwen3-8B shape, blockwise FP8", "2026-11-23-h100/export_qwen3-8b_tp1_fp8.json", fp8=True),
    Row(
        "Qwen3-30B-A3B shape, 4 layers (128 experts, 1575 tensors)",
        "2026-11-26-h200/export_qwen3-30b-a3b-4layers_tp1_new_round2.json",
    ),
    Row(
        "Qwen3-30B-A3B shape, 24 layers (9435 tensors, 28.5 GB)",
        "2026-11-26-h200/export_qwen3-30b-a3b-24layers_tp1.json",
    ),
    Row(
        "DeepSeek-V3 shape, 4 layers (MLA, 3 dense + 1 MoE layer of 256 experts; 821 tensors, 30.2 GB)",
        "2026-11-26-h100x2-b/export_deepseek-v3-4layers_tp1.json",
    ),
    Row(
        "Qwen3-VL-30B-A3B shape, 4 layers, packed experts from its checkpoint (398 tensors)",
        "2026-11-25-h100/export_qwen3-vl-30b-a3b-4layers_tp1_from_checkpoint.json",
    ),
    Row("Qwen3-8B shape", "2026-11-23-h200x2/export_qwen3-8b_tp2.json"),
    Row(
        "Qwen3-30B-A3B shape, 4 layers, Megatron's default expert-TP",
        "2026-11-25-h100x2/export_qwen3-30b-a3b-4layers_tp2_etp2.json",
    ),
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


def render_row(row: Row) -> str:
    result = json.loads((RESULTS / row.result).read_text())
    floor_ms, floor_name = _floor(result)
    if row.fp8:
        ours, stock = result["fp8_steady_ms"], None
        memory = f"–, –, {_gb(result.get('fp8_peak_extra_bytes'))}"
    else:
        ours, stock = result["refit_cached_steady_ms"], result["stock_steady_ms"]
        memory = ", ".join(
            _gb(result.get(key))
            for key in ("stock_peak_extra_bytes", "refit_peak_extra_bytes", "refit_cached_peak_extra_bytes")
        )
    cells = (
        f"[{_device(result)}](benchmarks/results/{row.result})",
        row.label,
        result["layout"].upper().replace("_", "×"),
        "–" if stock is None else f"{stock:.1f} ms",
        f"{ours:.2f} ms",
        "–" if stock is None else f"{stock / ours:.1f}×",
        f"{ours / floor_ms:.2f}× the {floor_ms:.2f} ms {floor_name}",
        memory,
    )
    return "| " + " | ".join(cells) + " |"


def render_block() -> list[str]:
    return [BEGIN, *HEADER, *(render_row(row) for row in ROWS), END]


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
