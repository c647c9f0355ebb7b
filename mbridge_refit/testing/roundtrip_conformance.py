"""The roundtrip column of the conformance matrix: ``convert roundtrip`` against the checkpoint on disk.

Owns what a roundtrip cell means and how it is decided. For a matrix model (an architecture of
``testing.tiny_models``, or one with a checkpoint variant), a tiny HF checkpoint with seeded random
values is written in the family's published layout (``testing.tiny_models``); ``convert
roundtrip`` (HF -> Megatron -> HF, on CPU) writes it back at one layout of
``testing.conformance.MATRIX_LAYOUTS``; every tensor of the output must equal the source file's
tensor: the same names, dtypes, shapes and bytes, read with plain ``safetensors`` (the oracle is
the checkpoint on disk, never our own output).

At TP1 ``convert`` runs in this process. At a layout of more ranks it runs as a user runs it,
``python -m mbridge_refit.convert --nproc-per-node N roundtrip --tp ...``, in a child process whose
log this module reads (``ConvertErrors.from_log``): a torch process group cannot be formed again in
one torchrun world once ``convert`` has destroyed it, so the ranks are launched per cell.

A cell ends as (``testing.conformance.CellState``):

* ``exact``: every tensor came back bit for bit;
* ``refused``: ``convert`` exited with an input error naming why (e.g. a mapping the loader has no
  slice description for); the reason is recorded;
* ``upstream broken``: the bridge maps no conversion task to some parameters of the build, so stock
  cannot convert it either (the reason names them);
* ``cannot be built here``: transformers has no model class for the architecture, saving failed,
  or the Megatron model cannot be built on this machine (the exception came from ``build_model``);
* ``different`` / ``our export failed`` (an internal error of ``convert``): failures.

Run (what ``tests/test_conformance.py`` and ``scripts/conformance_matrix.py`` do)::

    python -m mbridge_refit.testing.roundtrip_conformance --json cells.json [--layout tp1,tp2] [--only A,tp2:B]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Sequence

from mbridge_refit.convert.flags import layout_flags
from mbridge_refit.plan.layout import ParallelLayout
from mbridge_refit.testing import conformance
from mbridge_refit.testing.conformance import MATRIX_LAYOUTS, Cell, CellState
from mbridge_refit.testing.export_comparison import compare_stream
from mbridge_refit.testing.tiny_models import checkpoint_tensors, write_tiny_checkpoint

__all__ = [
    "ConvertErrors",
    "LAUNCH_ENVIRONMENT",
    "RANKS_TIMEOUT_S",
    "ROUNDTRIP",
    "check_roundtrip",
    "convert_and_compare",
    "main",
    "run",
    "write_source",
]

logger = logging.getLogger(__name__)

ROUNDTRIP = "roundtrip"  # the cell's precision column: the source checkpoint's own dtypes
# The environment launched cells start from, taken before any cell runs: a TP1 cell running in this
# process meanwhile has Megatron's attention-backend variables set (restored_environment puts them
# back after it), which a launched build would inherit and assert against.
LAUNCH_ENVIRONMENT = dict(os.environ)
RANKS_TIMEOUT_S = 600  # one launched roundtrip of a tiny model (2 CPU ranks take well under a minute)


def check_roundtrip(architecture: str, work_dir: Path, layout_name: str = "tp1") -> Cell:
    """The roundtrip cell of ``architecture`` at ``MATRIX_LAYOUTS[layout_name]``; its files go
    under ``work_dir``."""
    return write_source(architecture, work_dir, layout_name) or convert_and_compare(architecture, work_dir, layout_name)


def write_source(architecture: str, work_dir: Path, layout_name: str) -> Cell | None:
    """Write the cell's source checkpoint under ``work_dir``: None, or the cell when it cannot be
    built. Call from the main thread (transformers' lazy module resolves classes unguarded)."""
    try:
        write_tiny_checkpoint(architecture, work_dir / "source")
    except Exception as err:
        return _cell(architecture, layout_name, CellState.CANNOT_BE_BUILT, conformance.describe_error(err))
    return None


def convert_and_compare(architecture: str, work_dir: Path, layout_name: str) -> Cell:
    """``convert roundtrip`` of ``work_dir``'s source at the layout, compared with the source."""
    source, out = work_dir / "source", work_dir / "roundtrip"
    code, errors = _run_convert_roundtrip(source, out, MATRIX_LAYOUTS[layout_name][0])
    if code == 2:
        reason = " ".join(errors.messages) or "convert roundtrip exited 2"
        state = CellState.UPSTREAM_BROKEN if _names_unmapped_parameters(reason) else CellState.REFUSED
        return _cell(architecture, layout_name, state, reason[:600])
    if code != 0:
        state = CellState.CANNOT_BE_BUILT if errors.in_model_build else CellState.OUR_EXPORT_FAILED
        return _cell(architecture, layout_name, state, (" ".join(errors.messages) or f"exit {code}")[:600])
    comparison = compare_stream(checkpoint_tensors(source), checkpoint_tensors(out))
    if not comparison.exact:
        return _cell(architecture, layout_name, CellState.DIFFERENT, comparison.describe(), comparison.compared)
    return _cell(architecture, layout_name, CellState.EXACT, "", comparison.compared)


def _cell(architecture: str, layout_name: str, state: CellState, detail: str = "", tensors: int = 0) -> Cell:
    return Cell(
        architecture=architecture, layout=layout_name, precision=ROUNDTRIP, state=state, detail=detail, tensors=tensors
    )


def _run_convert_roundtrip(source: Path, out: Path, layout: ParallelLayout) -> tuple[int, "ConvertErrors"]:
    """``convert roundtrip --hf source --out out`` at ``layout`` on CPU: its exit code and errors
    (in this process at one rank, else launched as the layout's ranks: module docstring)."""
    argv = [
        "roundtrip",
        "--hf",
        str(source),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--no-progress",
        *layout_flags(layout),
    ]
    if layout.expected_world_size > 1:
        return _launch_convert(["--nproc-per-node", str(layout.expected_world_size), *argv])
    from mbridge_refit.convert.app import main as convert_main

    errors = ConvertErrors()
    convert_logger = logging.getLogger("mbridge_refit.convert")
    convert_logger.addHandler(errors)
    try:
        # Megatron's build sets attention-backend variables the next build asserts
        with conformance.restored_environment():
            code = convert_main(argv)
    finally:
        convert_logger.removeHandler(errors)
    return code, errors


def _launch_convert(argv: list[str]) -> tuple[int, "ConvertErrors"]:
    """``python -m mbridge_refit.convert *argv`` in a child process (CPU only): exit code, errors."""
    env = {**LAUNCH_ENVIRONMENT, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    try:
        run = subprocess.run(
            [sys.executable, "-m", "mbridge_refit.convert", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=RANKS_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as err:
        errors = ConvertErrors()
        errors.messages.append(f"convert did not finish within {RANKS_TIMEOUT_S} s")
        logger.debug("convert's output before the timeout: %s", err.output)
        return 3, errors
    return run.returncode, ConvertErrors.from_log(run.stdout + run.stderr)


class ConvertErrors(logging.Handler):
    """The errors ``convert`` logged: their messages (with the exception, for internal errors) and
    whether an exception was raised inside the Megatron model's build (``build_model``).

    A logging handler on ``convert``'s logger in this process, or read from the log of launched
    ranks (``from_log``)."""

    RANK_ERROR = re.compile(r"^\[rank\d+\] ERROR [\w.]+: (?P<message>.*)$")
    IN_MODEL_BUILD = re.compile(r'models/builder\.py", line \d+, in build_model$')
    EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(Error|Exception)): (?P<message>.*)$")

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.messages: list[str] = []
        self.in_model_build = False

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(" ".join(record.getMessage().split()))
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            self.messages.append(conformance.describe_error(err))
            frames = traceback.extract_tb(err.__traceback__)
            self.in_model_build |= any(
                f.name == "build_model" and f.filename.endswith("models/builder.py") for f in frames
            )

    @classmethod
    def from_log(cls, log: str) -> "ConvertErrors":
        """The errors of launched ranks' log (``[rankR] ERROR logger: message`` lines, each rank's
        exception line after its traceback), each message once, in order of first appearance."""
        errors = cls()
        for line in log.splitlines():
            line = line.rstrip()
            found = cls.RANK_ERROR.match(line) or cls.EXCEPTION.match(line)
            if found:
                message = " ".join(found.group("message").split())
                if found.re is cls.EXCEPTION:
                    message = f"{found.group('type')}: {message}"
                if message not in errors.messages:
                    errors.messages.append(message)
            errors.in_model_build |= bool(cls.IN_MODEL_BUILD.search(line.strip()))
        return errors


def _names_unmapped_parameters(reason: str) -> bool:
    """The loader's refusal for parameters no mapping of the bridge covers (its ``LoadError``)."""
    return "were not loaded from the checkpoint (no mapping or no HF tensor)" in reason


def run(plan: Sequence[tuple[str, Sequence[str]]], *, jobs: int = 1) -> list[Cell]:
    """The roundtrip cell of every ``(layout, architectures)`` of ``plan``, in plan order, each cell
    in a temporary directory of its own. TP1 cells run one after the other in this process; cells
    of more ranks (launched processes) run ``jobs`` at a time, their sources written first."""
    cells = [(layout_name, architecture) for layout_name, architectures in plan for architecture in architectures]
    work_dirs = {c: Path(tempfile.mkdtemp(prefix=f"roundtrip-{c[0]}-{c[1]}-")) for c in cells}
    done: dict[tuple[str, str], Cell] = {}
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            launched = {}
            for c in (c for c in cells if MATRIX_LAYOUTS[c[0]][0].expected_world_size > 1):
                done[c] = write_source(c[1], work_dirs[c], c[0])
                if done[c] is None:
                    launched[c] = pool.submit(convert_and_compare, c[1], work_dirs[c], c[0])
            for c in (c for c in cells if c not in done):
                done[c] = check_roundtrip(c[1], work_dirs[c], c[0])
            done.update((c, future.result()) for c, future in launched.items())
    finally:
        for work_dir in work_dirs.values():
            shutil.rmtree(work_dir, ignore_errors=True)
    for cell in (done[c] for c in cells):
        logger.info("%s %s roundtrip: %s %s", cell.architecture, cell.layout, cell.state, cell.detail[:200])
    return [done[c] for c in cells]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    conformance.add_selection_arguments(parser, layouts_run=", run one after the other")
    parser.add_argument("--json", type=Path, required=True, help="where the cells go (a JSON list)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="cells of more than one rank run this many at a time (default 1)"
    )
    args = parser.parse_args(argv)
    _, plan = conformance.selection(parser, args)
    logging.basicConfig(
        level=logging.INFO, format="%(message)s"
    )  # convert's own setup replaces it from its first TP1 cell on
    cells = run(plan, jobs=args.jobs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([cell.to_json() for cell in cells], indent=1))


if __name__ == "__main__":
    main()
