"""The conformance matrix: every architecture Megatron-Bridge registers, on CPU ranks (gloo, local
layer spec), RefitBridge's export against stock's on the same model bit for bit (BF16), its
FP8 export against the reference quantizer applied to stock's tensors, and (at ``LORA_LAYOUTS``)
the same model wrapped with Megatron-Bridge's ``LoRA``: its merged and adapter exports against
stock's.

The cells are decided inside the ranks by ``mbridge_refit.testing.conformance``, run here under
torchrun once per world size (every layout of ``MATRIX_LAYOUTS`` with that many ranks, the cells
this session selected, so ``-k`` runs only those); each test below reads one cell. A cell passes
in any state but ``different`` and ``our export failed``; ``docs/conformance.md`` is the same run
written by ``scripts/conformance_matrix.py``. The first tests show the comparison failing on a
corrupted stream (and the LoRA cells on adapters left unmerged), so a passing cell means something.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, torchrun

from mbridge_refit.fp8.format import BlockwiseFP8Config, FP8FormatError
from mbridge_refit.models import builder
from mbridge_refit.models.recipes import MODEL_RECIPES
from mbridge_refit.testing import conformance, roundtrip_conformance, tiny_models
from mbridge_refit.testing.conformance import (
    BF16,
    FP8,
    LORA_ADAPTER,
    LORA_LAYOUTS,
    LORA_MERGED,
    LORA_PRECISIONS,
    MATRIX_LAYOUTS,
    Cell,
    CellState,
    check_bf16,
    check_fp8,
    read_cells,
)
from mbridge_refit.testing.export_comparison import compare_stream, fp8_expected

MATRIX_TIMEOUT = 900  # seconds for one launch (TP1: every registered architecture; 2 ranks: every 2-rank layout)
CELLS = [(layout, architecture) for layout in MATRIX_LAYOUTS for architecture in conformance.architectures_at(layout)]
CELL_IDS = [f"{layout}-{architecture}" for layout, architecture in CELLS]


# --- The comparison fails when it should. ---------------------------------------------------------


def _stream() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(130, 200, generator=generator).bfloat16()),
        ("b.weight", torch.randn(64, generator=generator).bfloat16()),
        ("c.weight", torch.randn(8, 8, generator=generator).bfloat16()),
    ]


def _flip_one_byte(tensor: torch.Tensor) -> torch.Tensor:
    corrupted = tensor.clone()
    corrupted.reshape(-1).view(torch.uint8)[7] ^= 1
    return corrupted


CORRUPTIONS = {
    "one byte": lambda s: [(n, _flip_one_byte(t) if n == "c.weight" else t) for n, t in s],
    "dtype": lambda s: [(n, t.float() if n == "b.weight" else t) for n, t in s],
    "shape": lambda s: [(n, t.reshape(4, 16) if n == "b.weight" else t) for n, t in s],
    "dropped name": lambda s: s[:-1],
    "extra name": lambda s: [*s, ("d.weight", torch.zeros(1))],
    "repeated name": lambda s: [*s, s[0]],
    "swapped order": lambda s: [s[1], s[0], s[2]],
    "renamed": lambda s: [("x.weight", s[0][1]), *s[1:]],
}


def test_an_equal_stream_is_exact():
    expected = _stream()
    comparison = compare_stream(expected, [(n, t.clone()) for n, t in expected])
    assert comparison.exact and comparison.compared == 3, comparison.describe()


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupted_stream_is_caught(corruption):
    expected = _stream()
    comparison = compare_stream(expected, CORRUPTIONS[corruption]([(n, t.clone()) for n, t in expected]))
    assert not comparison.exact, corruption
    assert comparison.describe() != "exact"


KEEP_B = BlockwiseFP8Config(keep_patterns=("b.weight",))


def test_fp8_expectation_quantizes_what_the_format_says_and_catches_a_bad_scale():
    stock = _stream()
    expected = fp8_expected(stock, KEEP_B)
    assert [n for n, _ in expected] == ["a.weight", "a.weight_scale_inv", "b.weight", "c.weight", "c.weight_scale_inv"]
    assert expected[0][1].dtype == torch.float8_e4m3fn and expected[1][1].shape == (2, 2)
    bad_scale = [(n, t * 2 if n == "a.weight_scale_inv" else t) for n, t in expected]
    assert compare_stream(expected, bad_scale).differing == ("a.weight_scale_inv",)


class _FakeBridge:
    """Yields a given stream as its export; what ``check_bf16``/``check_fp8`` read from a bridge."""

    def __init__(self, stream, *, fallback_reason=None, fp8_error=None):
        self.stream, self.fallback_reason, self.fp8_error = stream, fallback_reason, fp8_error

    def export_hf_weights(self, chunks, **kwargs):
        if kwargs.get("fp8") is not None and self.fp8_error is not None:
            raise self.fp8_error
        return iter(self.stream)

    def fp8_config(self, fp8):
        return KEEP_B

    def export_diagnostics(self):
        return type("Diagnostics", (), {"fallback_reason": self.fallback_reason})()


def _cell(precision, state, detail="", tensors=0):
    return Cell(architecture="Fake", layout="tp1", precision=precision, state=state, detail=detail, tensors=tensors)


@pytest.mark.parametrize(
    ("bridge", "state"),
    [
        (_FakeBridge(_stream()), CellState.FAST_PATH_EXACT),
        (_FakeBridge(_stream(), fallback_reason="no plan"), CellState.STOCK_FALLBACK_EXACT),
        (_FakeBridge(CORRUPTIONS["one byte"](_stream())), CellState.DIFFERENT),
        (_FakeBridge(CORRUPTIONS["one byte"](_stream()), fallback_reason="no plan"), CellState.DIFFERENT),
    ],
    ids=["fast", "fallback", "corrupted-fast", "corrupted-fallback"],
)
def test_bf16_cell_states(bridge, state):
    cell = check_bf16(bridge, [], _stream(), _cell)
    assert cell.state is state and cell.state.passes is (state is not CellState.DIFFERENT)


def test_fp8_cell_states():
    stock = _stream()
    expected = fp8_expected(stock, KEEP_B)
    assert check_fp8(_FakeBridge(expected), [], stock, _cell).state is CellState.FAST_PATH_EXACT
    off_by_one = [(n, _flip_one_byte(t) if n == "a.weight" else t) for n, t in expected]
    assert check_fp8(_FakeBridge(off_by_one), [], stock, _cell).state is CellState.DIFFERENT
    refusing = _FakeBridge([], fp8_error=FP8FormatError("no plan"))
    assert check_fp8(refusing, [], stock, _cell).state is CellState.FP8_REFUSED
    failing = _FakeBridge([], fp8_error=RuntimeError("boom"))
    assert check_fp8(failing, [], stock, _cell).state is CellState.OUR_EXPORT_FAILED
    assert not CellState.OUR_EXPORT_FAILED.passes


@pytest.mark.multirank
def test_a_corrupted_real_export_is_different(tmp_path):
    """A real model's fast-path export with one flipped bit ends in ``different``, BF16 and FP8;
    with its LoRA adapters left unmerged and its adapter export one factor short, both LoRA cells
    end in ``different`` while BF16 and FP8 stay exact."""
    result = tmp_path / "cells.json"
    checker = str(REPO / "tests" / "ranks" / "conformance_corruption_check.py")
    run = torchrun(1, [checker, "--architecture", "Qwen3ForCausalLM", "--result", str(result)])
    assert run.returncode == 0, run.output[-6000:]
    cells = [Cell.from_json(c) for c in json.loads(result.read_text())]
    assert [(c.precision, c.state) for c in cells] == [
        (BF16, CellState.DIFFERENT),
        (FP8, CellState.DIFFERENT),
        (BF16, CellState.FAST_PATH_EXACT),
        (FP8, CellState.FAST_PATH_EXACT),
        (LORA_MERGED, CellState.DIFFERENT),
        (LORA_ADAPTER, CellState.DIFFERENT),
    ]
    assert all("differing" in c.detail for c in cells[:2]) and "differing" in cells[4].detail
    assert "missing" in cells[5].detail, cells[5].detail


# --- The matrix. ----------------------------------------------------------------------------------


def _selected_architectures(items) -> dict[str, list[str]]:
    """layout name -> the architectures of the matrix cells among ``items`` (this session's tests
    after ``-k``/``-m`` selection), in the layout's order."""
    selected = set()
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if (
            getattr(item, "module", None) is sys.modules[__name__]
            and "layout" in params
            and item.originalname != "test_roundtrip_matches_disk"
        ):
            selected.add((params["layout"], params["architecture"]))
    return {
        layout: [a for a in conformance.architectures_at(layout) if (layout, a) in selected]
        for layout in MATRIX_LAYOUTS
    }


def _selected_lora_cells(items) -> set[tuple[str, str]]:
    """(layout, architecture) of the LoRA cells among ``items``: the launch of their layout adds them."""
    return {
        (item.callspec.params["layout"], item.callspec.params["architecture"])
        for item in items
        if getattr(item, "module", None) is sys.modules[__name__] and item.originalname in LORA_TESTS
    }


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    """layout name -> every rank's cells, from one launch (on first use) of the ranks of every
    layout of that world size, running the cells this session selected."""
    runs: dict[str, dict[tuple[str, str], list[Cell]]] = {}
    selected = _selected_architectures(request.session.items)

    def cells_of(layout_name: str) -> dict[tuple[str, str], list[Cell]]:
        if layout_name not in runs:
            nproc = MATRIX_LAYOUTS[layout_name][0].expected_world_size
            layouts = [
                name
                for name, (layout, _) in MATRIX_LAYOUTS.items()
                if layout.expected_world_size == nproc and selected[name]
            ]
            only = ",".join(f"{name}:{architecture}" for name in layouts for architecture in selected[name])
            lora = sorted({a for name, a in _selected_lora_cells(request.session.items) if name in layouts})
            path = tmp_path_factory.mktemp(f"ranks{nproc}") / "cells.json"
            args = [
                "mbridge_refit.testing.conformance",
                "--layout",
                ",".join(layouts),
                "--only",
                only,
                "--json",
                str(path),
                "--lora",
                ",".join(lora),
            ]
            run = torchrun(nproc, args, timeout=MATRIX_TIMEOUT)
            assert run.returncode == 0, run.output[-6000:]
            for name in layouts:
                runs[name] = {}
            for rank_cells in read_cells(path, nproc):
                for cell in rank_cells:
                    runs[cell.layout].setdefault((cell.architecture, cell.precision), []).append(cell)
        return runs[layout_name]

    return cells_of


def _assert_cell(matrix, layout: str, architecture: str, precision: str) -> Cell:
    cells = matrix(layout).get((architecture, precision), [])
    nproc = MATRIX_LAYOUTS[layout][0].expected_world_size
    assert len(cells) == nproc, f"{architecture} {layout} {precision}: {len(cells)} of {nproc} ranks reported"
    assert len({c.state for c in cells}) == 1, f"ranks disagree: {[(c.state, c.detail) for c in cells]}"
    cell = cells[0]
    assert cell.state.passes, f"{architecture} {layout} {precision}: {cell.state}: {cell.detail}"
    return cell


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), CELLS, ids=CELL_IDS)
def test_bf16_matches_stock(layout, architecture, matrix):
    _assert_cell(matrix, layout, architecture, BF16)


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), CELLS, ids=CELL_IDS)
def test_fp8_matches_reference(layout, architecture, matrix):
    _assert_cell(matrix, layout, architecture, FP8)


LORA_CELLS = [(layout, architecture) for layout, architecture in CELLS if layout in LORA_LAYOUTS]
LORA_CELL_IDS = [f"{layout}-{architecture}" for layout, architecture in LORA_CELLS]
LORA_TESTS = (
    "test_lora_merged_matches_stock",
    "test_lora_adapter_matches_stock",
    "test_lora_planned_families_take_the_fast_path",
)


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), LORA_CELLS, ids=LORA_CELL_IDS)
def test_lora_merged_matches_stock(layout, architecture, matrix):
    """The model wrapped with Megatron-Bridge's ``LoRA``, adapters random: the merged export equals
    stock's merged export (``testing.conformance.check_lora``)."""
    _assert_cell(matrix, layout, architecture, LORA_MERGED)


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), LORA_CELLS, ids=LORA_CELL_IDS)
def test_lora_adapter_matches_stock(layout, architecture, matrix):
    """The same wrapped model: the adapter export equals stock's adapter export."""
    _assert_cell(matrix, layout, architecture, LORA_ADAPTER)


RECIPE_ARCHITECTURES = sorted({a for r in MODEL_RECIPES.values() for a in r.hf_config["architectures"]})


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), [c for c in CELLS if c[1] in RECIPE_ARCHITECTURES])
def test_recipe_families_take_the_fast_path(layout, architecture, matrix):
    """The families the repository's own recipes claim (README support matrix) never drop to a fallback."""
    for precision in (BF16, FP8):
        cell = _assert_cell(matrix, layout, architecture, precision)
        assert cell.state is CellState.FAST_PATH_EXACT, (
            f"{architecture} {layout} {precision}: {cell.state}: {cell.detail}"
        )


# Families the plan places through rules beyond the plain mapping classes: a layer's own heads (Gemma 4),
# a concatenated vision QKV (Qwen3-VL, Qwen3.5-VL), relayouts (Gemma 3 VL, ERNIE 4.5). A regression to
# the stock fallback fails here.
FAMILY_RULE_ARCHITECTURES = (
    "Gemma4ForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Ernie4_5_MoeForCausalLM",  # relaid tensors: a transposed projector, an unsqueezed expert bias
)


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), [c for c in CELLS if c[1] in FAMILY_RULE_ARCHITECTURES])
def test_family_rule_architectures_take_the_fast_path(layout, architecture, matrix):
    test_recipe_families_take_the_fast_path(layout, architecture, matrix)


# Families whose experts plan.stacking plans: GPT-OSS, the checkpoint variants whose experts are packed, Gemma 4 MoE.
STACKED_EXPERT_ARCHITECTURES = ("GptOssForCausalLM", *conformance.PACKED_EXPERT_MODELS, *conformance.MOE_BLOCK_MODELS)


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), [c for c in CELLS if c[1] in STACKED_EXPERT_ARCHITECTURES])
def test_stacked_expert_families_take_the_fast_path(layout, architecture, matrix):
    """Stacked expert tensors (GPT-OSS's gate_up_proj, down_proj; packed experts, Qwen3-VL-MoE's
    published ones transposed) keep their family on the fast path."""
    test_recipe_families_take_the_fast_path(layout, architecture, matrix)


@pytest.mark.parametrize("page", ["docs/conformance.md", "README.md"])
def test_matrix_page_links_name_tests_of_this_module(page):
    """docs/conformance.md and the README's support matrix link each cell to a test here: the line
    of its function, a known cell id."""
    text = (REPO / page).read_text()
    tree = ast.parse((REPO / "tests" / "test_conformance.py").read_text())
    function_lines = {node.name: node.lineno for node in tree.body if isinstance(node, ast.FunctionDef)}
    links = re.findall(r'test_conformance\.py#L(\d+) "(test_\w+)\[([\w.+-]+)\]', text)
    assert links, f"{page} links no test"
    stale = {(line, function) for line, function, _ in links if function_lines.get(function) != int(line)}
    assert not stale, f"links to lines that are not their test's (rerun scripts/conformance_matrix.py): {sorted(stale)}"
    assert {cell_id for _, _, cell_id in links} <= set(CELL_IDS)


def test_build_helpers_restore_what_they_change(monkeypatch):
    """The CUDA-device answer and the environment are the build's only: both are back after it."""
    current_device = torch.cuda.current_device
    with builder.cuda_device_queries_answer_cpu():
        assert torch.cuda.current_device() == "cpu"
    assert torch.cuda.current_device is current_device
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    monkeypatch.delenv("NVTE_FLASH_ATTN", raising=False)
    with conformance.restored_environment():
        os.environ["NVTE_FUSED_ATTN"] = "1"
        os.environ["NVTE_FLASH_ATTN"] = "1"
    assert os.environ["NVTE_FUSED_ATTN"] == "0" and "NVTE_FLASH_ATTN" not in os.environ


# --- The roundtrip column: `convert roundtrip` against the checkpoint on disk. --------------------


def _fake_convert(write_output):
    """A stand-in for ``convert roundtrip`` (exit 0) whose output ``write_output(source, out)`` writes."""

    def run(source, out, layout):
        write_output(source, out)
        return 0, roundtrip_conformance.ConvertErrors()

    return run


def _copy_with_one_flipped_bit(source, out):
    from safetensors.torch import save_file

    tensors = dict(tiny_models.checkpoint_tensors(source))
    name = sorted(tensors)[-1]
    tensors[name] = _flip_one_byte(tensors[name])
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))


def test_roundtrip_cell_catches_a_flipped_bit_and_a_dropped_tensor(tmp_path, monkeypatch):
    """The roundtrip cell compares with the checkpoint on disk: one flipped bit, or one tensor
    missing, ends in ``different``; the unchanged files are ``exact``."""
    from safetensors.torch import save_file

    def copy(source, out):
        shutil.copytree(source, out)

    def drop_one(source, out):
        tensors = dict(tiny_models.checkpoint_tensors(source))
        tensors.pop(sorted(tensors)[0])
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"))

    for write_output, state in (
        (copy, CellState.EXACT),
        (_copy_with_one_flipped_bit, CellState.DIFFERENT),
        (drop_one, CellState.DIFFERENT),
    ):
        monkeypatch.setattr(roundtrip_conformance, "_run_convert_roundtrip", _fake_convert(write_output))
        cell = roundtrip_conformance.check_roundtrip("LlamaForCausalLM", tmp_path / write_output.__name__)
        assert cell.state is state, cell.detail
    assert not CellState.DIFFERENT.passes and CellState.EXACT.passes and CellState.REFUSED.passes


def test_errors_of_launched_ranks_are_read_from_their_log():
    """A launched roundtrip's refusal and internal error are read from the ranks' log: each message
    once, and whether the exception came from the model's build (``cannot be built here``)."""
    log = "\n".join(
        [
            "[rank0] INFO mbridge_refit.convert.commands: loading /tmp/source",
            "[rank0] ERROR mbridge_refit.convert.app: cannot load decoder.layers.0.x: no slice description",
            "[rank1] ERROR mbridge_refit.convert.app: roundtrip failed (internal error: please report it with this traceback)",
            "Traceback (most recent call last):",
            '  File "/x/mbridge_refit/models/builder.py", line 160, in build_model',
            "    chunks = provider.provide_distributed_model(",
            "RuntimeError: TransformerEngine needs CUDA.",
            "[rank0] ERROR mbridge_refit.convert.launcher: 2 of 2 ranks failed (2, 3): exit code 3",
            "[rank0] ERROR mbridge_refit.convert.app: cannot load decoder.layers.0.x: no slice description",
        ]
    )
    errors = roundtrip_conformance.ConvertErrors.from_log(log)
    assert errors.messages == [
        "cannot load decoder.layers.0.x: no slice description",
        "roundtrip failed (internal error: please report it with this traceback)",
        "RuntimeError: TransformerEngine needs CUDA.",
        "2 of 2 ranks failed (2, 3): exit code 3",
    ]
    assert errors.in_model_build
    assert not roundtrip_conformance.ConvertErrors.from_log("\n".join(log.splitlines()[:2])).in_model_build


# The roundtrip cells the default run launches at layouts of more than one rank: each is a launch of
# its own, two ranks beside the TP1 cells in roundtrip_conformance's process (sharing a 2-core host). One
# by default: each rank's slots of a published transposed stack of experts, the launched `convert
# --nproc-per-node 2` asserted exact. The rest are marked slow. A family's roundtrip stays proven by its
# TP1 cell and the family at a layout by its BF16 cell there (tp2-Qwen3_5MoeForCausalLM,
# pp2-Qwen2_5_VLForConditionalGeneration and tp2ep2-HYV3ForCausalLM among them); a layout's `convert
# roundtrip` by tests/test_docs.py's README command (TP2 x PP2), tests/test_roundtrip.py's
# llama-tied-tiny-pp2 (PP2) and tests/test_fp8.py's moe-tp2_ep2 (TP2 x EP2).
# (The line count here keeps the links of docs/conformance.md and the README to the tests below.)
ROUNDTRIP_DEFAULT_MULTIRANK = frozenset(
    {
        ("ep2", "Qwen3VLMoeForConditionalGeneration+packed_experts"),
    }
)
ROUNDTRIP_CELLS = [
    pytest.param(
        layout,
        architecture,
        id=f"{layout}-{architecture}",
        marks=()
        if (MATRIX_LAYOUTS[layout][0].expected_world_size == 1 or (layout, architecture) in ROUNDTRIP_DEFAULT_MULTIRANK)
        else pytest.mark.slow,
    )
    for layout, architecture in CELLS
]


@pytest.fixture(scope="module")
def roundtrip_cells(request, tmp_path_factory):
    """(layout, architecture) -> its roundtrip cell, from one run of ``testing.roundtrip_conformance``
    over the roundtrip cells this session selected."""
    selected = [
        (item.callspec.params["layout"], item.callspec.params["architecture"])
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_roundtrip_matches_disk" and item.module is sys.modules[__name__]
    ]
    layouts = [name for name in MATRIX_LAYOUTS if any(layout == name for layout, _ in selected)]
    path = tmp_path_factory.mktemp("roundtrip") / "cells.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    only = ",".join(f"{layout}:{architecture}" for layout, architecture in selected)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mbridge_refit.testing.roundtrip_conformance",
            "--json",
            str(path),
            "--layout",
            ",".join(layouts),
            "--only",
            only,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=MATRIX_TIMEOUT,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    return {(cell.layout, cell.architecture): cell for cell in map(Cell.from_json, json.loads(path.read_text()))}


@pytest.mark.parametrize(("layout", "architecture"), ROUNDTRIP_CELLS)
def test_roundtrip_matches_disk(layout, architecture, roundtrip_cells):
    cell = roundtrip_cells[layout, architecture]
    assert cell.state.passes, f"{architecture} {layout} roundtrip: {cell.state}: {cell.detail}"
    # the loader reads stacked experts and a transposed projector too
    if architecture in (*RECIPE_ARCHITECTURES, *STACKED_EXPERT_ARCHITECTURES, "Gemma3ForConditionalGeneration"):
        assert cell.state is CellState.EXACT, f"{architecture} {layout} roundtrip: {cell.state}: {cell.detail}"


def test_a_cpu_build_without_cuda_forks_no_cuda_rng_state():
    """Inside the build helper the CUDA RNG tracker's fork is Megatron's no-op (the Mamba mixer
    initialises in one); the tracker there was before is back after it."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    before = get_cuda_rng_tracker()
    with builder.cuda_device_queries_answer_cpu():
        with get_cuda_rng_tracker().fork():
            pass
    assert get_cuda_rng_tracker() is before


MAMBA_ARCHITECTURES = ("NemotronHForCausalLM",)  # families whose Mamba mixers plan.placement plans


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), [c for c in CELLS if c[1] in MAMBA_ARCHITECTURES])
def test_mamba_families_take_the_fast_path(layout, architecture, matrix):
    """Mamba mixers (in_proj's z, x, B, C, dt; conv1d's x, B, C) keep their family on the fast path."""
    test_recipe_families_take_the_fast_path(layout, architecture, matrix)


# The families whose LoRA adapters the plan merges and exports itself (LORA_MERGED and LORA_ADAPTER on the
# fast path at TP1): those the 2-rank columns split, with Gemma 2 and GLM-5 DSA (MLA's output projection),
# but for the ones whose adapters the plan refuses by name (gated or concatenated QKV: Qwen3-Next, Qwen3.5,
# Qwen3-VL), whose stock LoRA export fails (GPT-OSS's stacked experts) or which LoRA cannot wrap on CPU (HY-V3's
# grouped-expert stand-in). A regression to the stock fallback fails here.
LORA_UNPLANNED = {
    "GptOssForCausalLM",
    "HYV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3VLForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
}
LORA_PLANNED_ARCHITECTURES = sorted(
    {*conformance.SPLIT_LAYOUT_FAMILIES, "Gemma2ForCausalLM", "GlmMoeDsaForCausalLM"} - LORA_UNPLANNED
)


@pytest.mark.multirank
@pytest.mark.parametrize(("layout", "architecture"), [c for c in LORA_CELLS if c[1] in LORA_PLANNED_ARCHITECTURES])
def test_lora_planned_families_take_the_fast_path(layout, architecture, matrix):
    """The merged and adapter exports of these families' LoRA models run on the plan, exact."""
    for precision in LORA_PRECISIONS:
        cell = _assert_cell(matrix, layout, architecture, precision)
        assert cell.state is CellState.FAST_PATH_EXACT, (
            f"{architecture} {layout} {precision}: {cell.state}: {cell.detail}"
        )
