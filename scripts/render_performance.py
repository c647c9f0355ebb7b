"""Write the README's performance table and docs/performance.md from committed benchmark results.

    python scripts/render_performance.py            # rewrite the README's block and docs/performance.md
    python scripts/render_performance.py --check    # exit 1 if either differs (tests/test_docs.py)

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

docs/performance.md is the whole page, one section per refit path (stable anchors: ``PATHS``): for every
benchmark a table names (a result file name), the newest committed result of that name on each device
(the date its manifest entry gives, else its folder's), with the commit and the command of its manifest
entry. A result without a manifest entry is refused by name: its provenance is what the row shows.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
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


def _export_cells(result: dict, fp8: bool) -> list[str]:
    """The time and memory cells of an export row (README and docs/performance.md alike)."""
    shown = times(result, fp8)
    if fp8:
        memory = f"–, –, {_gb(result.get('fp8_peak_extra_bytes'))}"
    else:
        memory = ", ".join(
            _gb(result.get(key))
            for key in ("stock_peak_extra_bytes", "refit_peak_extra_bytes", "refit_cached_peak_extra_bytes")
        )
    return [
        _spread(shown.stock_ms, 1, " ms", shown.interleaved),
        _spread(shown.ours_ms, 2, " ms", shown.interleaved),
        _spread(shown.speedup, 1, "×", shown.interleaved),
        f"{_spread(shown.ours_over_floor, 2, '×', shown.interleaved)} the {shown.floor_ms:.2f} ms {shown.floor}",
        memory,
    ]


def render_row(row: Row, results: Path = RESULTS) -> str:
    result = _result(row, results)
    mark = "" if "interleaved" in result else f" {SEQUENTIAL}"
    cells = (
        f"[{_device(result)}](benchmarks/results/{row.result}){mark}",
        row.label,
        _layout(result),
        *_export_cells(result, row.fp8),
    )
    return "| " + " | ".join(cells) + " |"


def _layout(result: dict) -> str:
    return result["layout"].upper().replace("_", "×")


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


# docs/performance.md: one section per refit path, the newest committed result per benchmark and device.

PAGE = REPO / "docs" / "performance.md"
PAGE_RESULTS = "../benchmarks/results"  # RESULTS as the page links it


@dataclass(frozen=True)
class Entry:
    """One committed result: its folder under ``RESULTS``, its file name, its content and its manifest entry."""

    folder: str
    name: str
    result: dict
    run: dict

    @property
    def date(self) -> str:
        """The manifest's date (ISO; a date without a time counts as the start of that day), else the folder's."""
        return self.run.get("date") or self.folder[:10]

    @property
    def link(self) -> str:
        return f"{PAGE_RESULTS}/{self.folder}/{self.name}"


def _gpu_name(result: dict) -> str:
    name = result["device"].replace("NVIDIA ", "").replace(" 80GB HBM3", "")
    return re.sub(r" x\d+$", "", name)


def _one_gpu(result: dict) -> int:
    return 1


def _world(result: dict) -> int:
    return result.get("world_size", 1)


def _nccl_gpus(result: dict) -> int:
    """A refit over NCCL puts the engine on a GPU of its own; over gloo it shares the trainer's."""
    return result.get("gpus") or (2 if result.get("backend") == "nccl" else 1)


def _engine_tp(result: dict) -> int:
    return result["engine_tp"]


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict], str]


@dataclass(frozen=True)
class Table:
    """Rows: for each benchmark of ``names``, its newest result on each device; ``gpus`` counts a result's
    GPUs (part of its device). A benchmark is a result file name, or a tuple of names that are one
    benchmark (the same run, a flag adding a side); a repeat of a run (``NAME_run2.json``,
    ``NAME_host2.json``) is the same benchmark; any other suffix is a variant, shown in the history only."""

    title: str
    what: str
    names: tuple[str | tuple[str, ...], ...]
    columns: tuple[Column, ...]
    gpus: Callable[[dict], int] = _one_gpu


@dataclass(frozen=True)
class RefitPath:
    anchor: str
    title: str
    page: str  # the path's page, relative to docs/
    tables: tuple[Table, ...]
    none_yet: str = ""  # what the section says while it has no table


def _median(value) -> float:
    return value["median"] if isinstance(value, dict) else value


def _ms(value, digits: int = 1) -> str:
    """A time: a bare number, or ``median (min–max)`` of a ``{"median", "all"}`` record."""
    if value is None:
        return "–"
    if isinstance(value, dict):
        rounds = value.get("all") or [value["median"]]
        return f"{value['median']:.{digits}f} ms ({min(rounds):.{digits}f}–{max(rounds):.{digits}f})"
    return f"{value:.{digits}f} ms"


def _ratio(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _field(*keys: str) -> Callable[[dict], object]:
    def get(result: dict):
        for key in keys:
            result = result.get(key) if isinstance(result, dict) else None
        return result

    return get


def _model(result: dict) -> str:
    return str(result["model"])


def _format(result: dict) -> str:
    fmt = result.get("format") or ("fp8" if result.get("fp8") else "bf16")
    return "FP8" if fmt.startswith("fp8") else fmt.upper()


def _ok(result: dict) -> str:
    return {True: "yes", False: "**no**"}.get(result.get("ok"), "–")


EXPORT_NAMES = (
    ("export_qwen3-8b_tp1.json", "export_qwen3-8b_tp1_fp8.json"),
    *dict.fromkeys(row.result.split("/")[-1] for row in ROWS if "qwen3-8b_tp1" not in row.result),
)

EXPORT = Table(
    title="Export",
    what="`scripts/bench_export.py`: the cached export against stock `AutoBridge.export_hf_weights` and the floor, "
    "steady state, outputs equal stock's bit for bit (the FP8 row: the blockwise FP8 export of the same run). "
    f"{SEQUENTIAL}: one sequential measurement.",
    names=EXPORT_NAMES,
    gpus=_world,
    columns=(
        Column("layout", _layout),
        Column("stock", lambda r: _export_cells(r, False)[0]),
        Column("ours", lambda r: _export_cells(r, False)[1]),
        Column("speedup", lambda r: _export_cells(r, False)[2]),
        Column("ours / floor", lambda r: _export_cells(r, False)[3]),
        Column(
            "ours, FP8",
            lambda r: (
                _export_cells(r, True)[1] if "fp8_steady_ms" in r or "fp8_ms" in r.get("interleaved", {}) else "–"
            ),
        ),
        Column("extra memory: stock, ours (cache off), ours (cached)", lambda r: _export_cells(r, False)[4]),
    ),
)

COLOCATED = Table(
    title="Timed",
    what="`scripts/bench_refit_vllm.py`: `VLLMRefit.refit` (export and apply) into a vLLM engine on the trainer's GPU, "
    "median (range) of the steady steps, against one memcpy of the bytes and vLLM's `ipc` backend fed by the stock export.",
    names=(
        "bench_refit_vllm_qwen3-8b.json",
        "bench_refit_vllm_qwen3-8b_fp8.json",
        "bench_refit_vllm_qwen3-30b-a3b-4layers.json",
        "bench_refit_vllm_qwen3-30b-a3b-24layers.json",
        "bench_refit_vllm_qwen3-30b-a3b-24layers_fp8.json",
    ),
    columns=(
        Column("format", _format),
        Column("tensors", lambda r: str(r["tensors"])),
        Column("ours", lambda r: _ms(r["ours_ms"], 2)),
        Column("memcpy floor", lambda r: _ms(r["floor_ms"], 2)),
        Column("ours / floor", lambda r: _ratio(_field("ratios", "ours_over_floor")(r))),
        Column("vLLM `ipc`, stock export", lambda r: _ms(_median(r["vllm_native_stock_ms"]))),
        Column("that / ours", lambda r: _ratio(_field("ratios", "stock_native_over_ours")(r))),
        Column("first refit", lambda r: _ms(r["first_refit_ms"])),
    ),
)

COLOCATED_CHECKS = Table(
    title="Checked against vLLM loading from disk",
    what="`scripts/check_vllm_refit_gpu.py`: the refit engine's parameters and log-probabilities equal an engine "
    "started from the same weights on disk (`ok`: every check of the file passed).",
    names=(
        "vllm_refit_qwen3-1.7b.json",
        "vllm_refit_qwen3-1.7b_fp8.json",
        "vllm_refit_qwen3-1.7b-4layers.json",
        "vllm_refit_qwen3-1.7b-4layers_fp8.json",
        "vllm_refit_qwen3-30b-a3b-4layers.json",
        "vllm_refit_qwen3-30b-a3b-4layers_fp8.json",
        "vllm_refit_deepseek-v3-cut.json",
        "vllm_refit_deepseek-v3-cut_fp8.json",
        "vllm_refit_deepseek-v3-cut-2layers_fp8.json",
    ),
    columns=(Column("format", _format), Column("ok", _ok)),
)

BROADCAST = Table(
    title="Timed",
    what="`scripts/bench_refit_vllm_broadcast.py`: `VLLMBroadcastRefit` from the trainer's GPU to a vLLM engine on "
    "another over NCCL, median (range) of the steady steps, against one raw broadcast of the same bytes and vLLM's "
    "`nccl` backend fed by the stock export.",
    names=("bench_refit_vllm_broadcast_qwen3-1.7b.json", "bench_refit_vllm_broadcast_qwen3-8b.json"),
    gpus=_nccl_gpus,
    columns=(
        Column("format", _format),
        Column("buckets", lambda r: f"{r['bucket_mib']} MiB × {r.get('num_buffers', '–')}"),
        Column("checksums", lambda r: {True: "on", False: "off"}.get(r.get("checksum"), "–")),
        Column("ours", lambda r: _ms(r["ours_ms"])),
        Column("raw broadcast", lambda r: _ms(_median(r["raw_broadcast_ms"]))),
        Column("raw / ours", lambda r: _ratio(_field("ratios", "raw_over_ours")(r))),
        Column("vLLM `nccl`, stock export", lambda r: _ms(_median(r["vllm_native_nccl_stock_ms"]))),
        Column("that / ours", lambda r: _ratio(_field("ratios", "native_stock_over_ours")(r))),
    ),
)

BROADCAST_CHECKS = Table(
    title="Checked against vLLM loading from disk",
    what="`scripts/check_vllm_broadcast_gpu.py`: the engine refit over the broadcast equals one loaded from disk, "
    "and injected failures raise on both sides (`ok`: every check of the file passed).",
    names=(
        "vllm_broadcast_qwen3-1.7b.json",
        "vllm_broadcast_qwen3-1.7b_fp8.json",
        "vllm_broadcast_qwen3-30b-a3b-4layers.json",
        "vllm_broadcast_qwen3-30b-a3b-4layers_fp8.json",
    ),
    gpus=_nccl_gpus,
    columns=(
        Column("format", _format),
        Column("backend", lambda r: str(r.get("backend", "–"))),
        Column("steady step", lambda r: _ms(_median(r["steady_ms"])) if r.get("steady_ms") else "–"),
        Column("ok", _ok),
    ),
)

SHARDED = Table(
    title="Timed: `ShardedTransfer` into engine shards",
    what="`scripts/bench_sharded_refit.py`: every engine rank receives only its shard (no engine), against the "
    "gathering cached export and stock's export at the trainer's layout, steady state.",
    names=("sharded_refit_qwen3-8b_tp1_to_tp1.json", "sharded_refit_qwen3-8b_tp2_to_tp2.json"),
    gpus=_world,
    columns=(
        Column("trainer → engine", lambda r: r["layout"].upper().replace("->", " → ")),
        Column("ours", lambda r: _ms({"median": r["sharded_ms"], "all": r["sharded_all_ms"]}, 2)),
        Column("gathering export (cached)", lambda r: _ms(r["gather_cached_ms"])),
        Column("stock export", lambda r: _ms(r["stock_steady_ms"])),
        Column("moved between ranks", lambda r: _gb(r["bytes_moved"])),
        Column(
            "= stock", lambda r: "yes" if r["mismatches_vs_stock"] == 0 else f"**{r['mismatches_vs_stock']} differ**"
        ),
    ),
)

SHARDED_VLLM = Table(
    title="Timed and checked: `VLLMShardedRefit` into vLLM at TP2",
    what="`scripts/check_vllm_refit_tp2_gpu.py`: trainer TP2 into a vLLM engine at `tensor_parallel_size=2` on the "
    "same 2 GPUs, median of the steady steps, against the gathering export and vLLM's `load_weights`; the engine "
    "equals one loaded from disk (`ok`).",
    names=(
        "vllm_refit_tp2_qwen3-1.7b.json",
        "vllm_refit_tp2_qwen3-1.7b_fp8.json",
        "vllm_refit_tp2_qwen3-30b-a3b-4layers.json",
        "vllm_refit_tp2_qwen3-30b-a3b-4layers_fp8.json",
    ),
    gpus=_engine_tp,
    columns=(
        Column("format", _format),
        Column("ours", lambda r: _ms(r["ours_ms"])),
        Column("memcpy floor", lambda r: _ms(r["floor_ms"], 2)),
        Column("gathering export + `load_weights`", lambda r: _ms(r.get("vllm_load_weights_gather_ms"))),
        Column("moved between ranks", lambda r: _gb(_field("plan", "bytes_moved")(r))),
        Column("ok", _ok),
    ),
)

LORA = Table(
    title="Timed and checked",
    what="`scripts/check_vllm_lora_refit_gpu.py`: `VLLMAdapterRefit` refits the adapter into vLLM's LoRA slot, "
    "against the merged full refit of the same model; the slot equals the same adapter loaded from disk (`ok`).",
    names=("vllm_lora_refit_qwen3-1.7b-8layers.json",),
    columns=(
        Column("LoRA rank", lambda r: str(r["lora_rank"])),
        Column("adapter refit", lambda r: _ms(r["adapter_refit_ms"], 2)),
        Column("adapter bytes", lambda r: _gb(r["adapter_bytes"])),
        Column("merged refit", lambda r: _ms(r["merged_refit_ms"], 2)),
        Column("merged bytes", lambda r: _gb(r["merged_bytes"])),
        Column("ok", _ok),
    ),
)

PATHS = (
    RefitPath("export", "Export", "refit/README.md", (EXPORT,)),
    RefitPath("colocated-ipc", "Colocated IPC", "refit/ipc.md", (COLOCATED, COLOCATED_CHECKS)),
    RefitPath("sharded", "Sharded", "refit/sharded.md", (SHARDED, SHARDED_VLLM)),
    RefitPath("broadcast", "Broadcast", "refit/broadcast.md", (BROADCAST, BROADCAST_CHECKS)),
    RefitPath(
        "reshard",
        "Reshard",
        "refit/reshard.md",
        (),
        none_yet="Not built yet (issue 57): no result. The layout-changing refit plans of today are the sharded path's.",
    ),
    RefitPath("lora", "LoRA", "refit/lora.md", (LORA,)),
)

PAGE_HEAD = """# Performance

<!-- written by scripts/render_performance.py from benchmarks/results/: edit the script, not this page -->

The newest committed result of each benchmark on each device, one section per refit path ([the paths](refit/README.md)).
Each row links its result file and names the commit and the command of its manifest entry (`commit`: the first hash
the entry gives; the manifest says more where the measured tree differed from it). Ratios are only between numbers
of one run ([method](benchmarks.md#method)); earlier runs and what they found: [history](benchmarks/history/README.md).
"""


REPEAT = re.compile(r"_(?:run|host)\d+$")


def benchmark_of(file_name: str) -> str:
    """The benchmark a result file belongs to: its name less a repeat's suffix (``_run2``, ``_host1``)."""
    stem = file_name.removesuffix(".json")
    return REPEAT.sub("", stem) + ".json"


def _benchmarks(table: Table) -> list[tuple[str, ...]]:
    return [(names,) if isinstance(names, str) else names for names in table.names]


def committed_results(results: Path = RESULTS) -> dict[str, list[Entry]]:
    """Every committed result of a benchmark some table names, by benchmark file name (others are not read)."""
    wanted = {name for path in PATHS for table in path.tables for names in _benchmarks(table) for name in names}
    found: dict[str, list[Entry]] = {}
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        manifest = folder / "manifest.json"
        runs = json.loads(manifest.read_text()).get("runs", {}) if manifest.exists() else {}
        for file in sorted(folder.glob("*.json")):
            if benchmark_of(file.name) not in wanted:
                continue
            if file.name not in runs:
                raise SystemExit(f"{file}: no entry in {manifest}; add its date, device, commit and command there")
            entry = Entry(folder.name, file.name, json.loads(file.read_text()), runs[file.name])
            found.setdefault(benchmark_of(file.name), []).append(entry)
    return found


def current(entries: list[Entry], table: Table) -> list[tuple[str, Entry]]:
    """The newest entry per device, devices in name order."""
    newest: dict[str, Entry] = {}
    for entry in entries:
        gpus = table.gpus(entry.result)
        device = f"{gpus}× {_gpu_name(entry.result)}" if gpus > 1 else _gpu_name(entry.result)
        if device not in newest or (entry.date, entry.folder) > (newest[device].date, newest[device].folder):
            newest[device] = entry
    return sorted(newest.items())


def _commit(run: dict) -> str:
    found = re.search(r"\b[0-9a-f]{7,40}\b", str(run.get("commit") or ""))
    if not found:
        raise SystemExit(f"manifest entry {run} names no commit")
    return found.group()[:7]


def _code(text: str) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render_table(table: Table, found: dict[str, list[Entry]]) -> list[str]:
    headers = ["device", "model", *(c.header for c in table.columns), "date", "commit", "command"]
    lines = [f"### {table.title}", "", table.what, "", "| " + " | ".join(headers) + " |"]
    lines.append("| " + " | ".join("---" for _ in headers) + " |")
    rows = 0
    for names in _benchmarks(table):
        for device, entry in current([e for name in names for e in found.get(name, [])], table):
            model = entry.result.get("model") or entry.name.removesuffix(".json")
            cells = [f"[{device}]({entry.link})", str(model), *(c.cell(entry.result) for c in table.columns)]
            cells += [entry.date[:10], f"`{_commit(entry.run)}`", _code(entry.run.get("command", "–"))]
            lines.append("| " + " | ".join(cells) + " |")
            rows += 1
    if not rows:
        raise SystemExit(f"table {table.title!r} found none of its results {table.names} under {RESULTS}")
    return lines


def render_page(results: Path = RESULTS) -> str:
    found = committed_results(results)
    lines = [PAGE_HEAD]
    for path in PATHS:
        lines += [
            f'<a id="{path.anchor}"></a>',
            "",
            f"## {path.title}",
            "",
            f"How it works and how to run it: [{path.page}]({path.page}).",
        ]
        if not path.tables:
            lines += ["", path.none_yet]
        for table in path.tables:
            lines += ["", *render_table(table, found)]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=Path, default=REPO / "README.md", help="the page whose block is rewritten")
    parser.add_argument("--page", type=Path, default=PAGE, help="the performance page, rewritten whole")
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs instead of rewriting it")
    args = parser.parse_args(argv)
    readme = args.readme.read_text()
    page = args.page.read_text() if args.page.exists() else ""
    rendered = {args.readme: (readme, replace_block(readme, render_block())), args.page: (page, render_page())}
    if args.check:
        differs = [path for path, (text, new) in rendered.items() if new != text]
        for path in differs:
            print(f"{path}: the performance tables differ from the committed results; run {__file__}")
        return 1 if differs else 0
    for path, (text, new) in rendered.items():
        if new != text:
            path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
