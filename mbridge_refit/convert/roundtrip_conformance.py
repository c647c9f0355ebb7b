"""The roundtrip column of the conformance matrix: ``convert roundtrip`` against the checkpoint on disk.

Owns what a roundtrip cell means and how it is decided. For an architecture
(``tools.tiny_configs``), a tiny transformers model of it with seeded random values is saved as
an HF checkpoint (``write_tiny_checkpoint``; a tensor transformers saves under another name than
the family's published checkpoints is renamed to theirs, ``PUBLISHED_NAMES``, and tensors they
store in float32 are stored so, ``FLOAT32_TENSORS``); ``convert roundtrip`` (HF -> Megatron ->
HF, one process, CPU) writes it back; every tensor of the output must equal the source file's
tensor: the same names, dtypes, shapes and bytes, read with plain ``safetensors`` (the oracle is the
checkpoint on disk, never our own output).

A cell ends as (``tools.conformance.CellState``):

* ``exact``: every tensor came back bit for bit;
* ``refused``: ``convert`` exited with an input error naming why (e.g. a mapping the loader has no
  slice description for); the reason is recorded;
* ``upstream broken``: the bridge maps no conversion task to some parameters of the build, so stock
  cannot convert it either (the reason names them);
* ``cannot be built here``: transformers has no model class for the architecture, saving failed,
  or the Megatron model cannot be built on this machine (the exception came from ``build_model``);
* ``different`` / ``our export failed`` (an internal error of ``convert``): failures.

Run (what ``tests/test_conformance.py`` and ``scripts/conformance_matrix.py`` do)::

    python -m mbridge_refit.convert.roundtrip_conformance --json cells.json [--only A,B]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import shutil
import tempfile
import traceback
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from mbridge_refit.tools.conformance import Cell, CellState, describe_error, restored_environment
from mbridge_refit.tools.export_comparison import compare_stream

logger = logging.getLogger(__name__)

ROUNDTRIP = "roundtrip"  # the cell's precision column: the source checkpoint's own dtypes
LAYOUT = "tp1"
SEED = 0

# Architecture -> {name transformers writes: name the family's published checkpoints use}, where
# ``save_pretrained(save_original_format=True)`` writes a tensor under another name than the
# published checkpoints (and Megatron-Bridge's mapping) do. transformers 5.12.1 undoes its
# Nemotron-H load rename ``embedding.weight -> embeddings.weight`` (meant for checkpoints in
# Mamba's own naming) on save; NVIDIA's Nemotron-H checkpoints name it ``backbone.embeddings.weight``.
PUBLISHED_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "NemotronHForCausalLM": MappingProxyType({"backbone.embedding.weight": "backbone.embeddings.weight"}),
})

# Architecture -> HF tensors the tiny checkpoint stores in float32, as the family's checkpoints do
# and as Megatron-Core holds them (``tools.model_builder.FLOAT32_PARAMETERS``): Nemotron-H's Mamba
# A_log and D (radixark/miles#1546: its checkpoints are mixed dtype, Mamba's A_log, D, dt_bias in
# fp32; Megatron keeps dt_bias in the model dtype, so a roundtrip returns it in bf16: kept bf16 here).
FLOAT32_TENSORS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "NemotronHForCausalLM": ("*.mixer.A_log", "*.mixer.D"),
})


def write_tiny_checkpoint(architecture: str, out_dir: Path, *, seed: int = SEED) -> Path:
    """Save a tiny transformers model of ``architecture`` (bf16, seeded random values per tensor
    name) as an HF checkpoint in ``out_dir``, with per-expert tensor names (the layout
    Megatron-Bridge's mappings read)."""
    import transformers

    from mbridge_refit.tools.recipes import seeded_random_values
    from mbridge_refit.tools.tiny_configs import TinyConfigError, tiny_config

    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        raise TinyConfigError(f"transformers {transformers.__version__} has no model class {architecture}")
    model = model_class._from_config(tiny_config(architecture), dtype=torch.bfloat16)
    float32 = FLOAT32_TENSORS.get(architecture, ())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(seeded_random_values(name, param, seed))
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in float32):
                param.data = param.data.float()
    model.save_pretrained(out_dir, save_original_format=True)
    _rename_tensors(out_dir, PUBLISHED_NAMES.get(architecture, {}))
    return out_dir


def _rename_tensors(checkpoint_dir: Path, renames: Mapping[str, str]) -> None:
    """Rename tensors of the checkpoint in place (``PUBLISHED_NAMES``): their files and the index."""
    if not renames:
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if not renames.keys() & set(handle.keys()):
                continue
            metadata = handle.metadata()
            tensors = {renames.get(name, name): handle.get_tensor(name) for name in handle.keys()}
        save_file(tensors, str(path), metadata=metadata)
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {renames.get(name, name): file for name, file in data["weight_map"].items()}
        index.write_text(json.dumps(data, indent=2))


def checkpoint_tensors(checkpoint_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors files in ``checkpoint_dir``, sorted by name (plain safetensors)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys())
    return sorted(tensors.items())


def check_roundtrip(architecture: str, work_dir: Path) -> Cell:
    """The roundtrip cell of ``architecture``; its files go under ``work_dir`` (removed after)."""
    source, out = work_dir / "source", work_dir / "roundtrip"
    try:
        write_tiny_checkpoint(architecture, source)
    except Exception as err:
        return _cell(architecture, CellState.CANNOT_BE_BUILT, describe_error(err))
    code, errors = _run_convert_roundtrip(source, out)
    if code == 2:
        reason = " ".join(errors.messages) or "convert roundtrip exited 2"
        state = CellState.UPSTREAM_BROKEN if _names_unmapped_parameters(reason) else CellState.REFUSED
        return _cell(architecture, state, reason[:600])
    if code != 0:
        state = CellState.CANNOT_BE_BUILT if errors.in_model_build else CellState.OUR_EXPORT_FAILED
        return _cell(architecture, state, (" ".join(errors.messages) or f"exit {code}")[:600])
    comparison = compare_stream(checkpoint_tensors(source), checkpoint_tensors(out))
    if not comparison.exact:
        return _cell(architecture, CellState.DIFFERENT, comparison.describe(), comparison.compared)
    return _cell(architecture, CellState.EXACT, "", comparison.compared)


def _run_convert_roundtrip(source: Path, out: Path) -> tuple[int, "_ErrorRecords"]:
    """``convert roundtrip --hf source --out out`` in this process: its exit code and errors."""
    from mbridge_refit.convert.app import main as convert_main

    errors = _ErrorRecords()
    convert_logger = logging.getLogger("mbridge_refit.convert")
    convert_logger.addHandler(errors)
    try:
        with restored_environment():  # Megatron's build sets attention-backend variables the next build asserts
            code = convert_main(["roundtrip", "--hf", str(source), "--out", str(out), "--device", "cpu", "--no-progress"])
    finally:
        convert_logger.removeHandler(errors)
    return code, errors


class _ErrorRecords(logging.Handler):
    """The error records ``convert`` logs: their messages (with the exception, for internal errors)
    and whether an exception was raised inside the Megatron model's build (``build_model``)."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []
        self.in_model_build = False

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(" ".join(record.getMessage().split()))
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            self.messages.append(describe_error(err))
            frames = traceback.extract_tb(err.__traceback__)
            self.in_model_build |= any(f.name == "build_model" and f.filename.endswith("model_builder.py") for f in frames)


def _names_unmapped_parameters(reason: str) -> bool:
    """The loader's refusal for parameters no mapping of the bridge covers (its ``LoadError``)."""
    return "were not loaded from the checkpoint (no mapping or no HF tensor)" in reason


def _cell(architecture: str, state: CellState, detail: str = "", tensors: int = 0) -> Cell:
    return Cell(architecture=architecture, layout=LAYOUT, precision=ROUNDTRIP, state=state, detail=detail, tensors=tensors)


def run(architectures: Sequence[str]) -> list[Cell]:
    """The roundtrip cell of every architecture, each in a temporary directory of its own."""
    cells = []
    for architecture in architectures:
        work_dir = Path(tempfile.mkdtemp(prefix=f"roundtrip-{architecture}-"))
        try:
            cell = check_roundtrip(architecture, work_dir)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
        logger.info("%s roundtrip: %s %s", architecture, cell.state, cell.detail[:200])
        cells.append(cell)
    return cells


def main(argv: Sequence[str] | None = None) -> None:
    from mbridge_refit.tools.tiny_configs import registered_architectures

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--only", default="", help="comma-separated architectures (default: every registered one)")
    parser.add_argument("--json", type=Path, required=True, help="where the cells go (a JSON list)")
    args = parser.parse_args(argv)
    architectures = [a for a in args.only.split(",") if a] or registered_architectures()
    cells = run(architectures)  # convert's own logging setup applies from the first cell on
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([cell.to_json() for cell in cells], indent=1))


if __name__ == "__main__":
    main()
