"""Every wire format mbridge_refit sends between processes or ranks carries a version and refuses
another one by name: docs/architecture.md's table of them against each format's constant, and the
sharded transfer's handshake, the plan exchange and the collective calls between two gloo ranks
(tests/ranks/sharded_transfer_wire_check.py, tests/ranks/plan_exchange_wire_check.py,
tests/ranks/collective_call_wire_check.py)."""

from __future__ import annotations

import importlib
import json
import re

from conftest import REPO, torchrun

from mbridge_refit.plan.build import PLAN_EXCHANGE_VERSION
from mbridge_refit.runtime.handshake import CALLS_PROTOCOL
from mbridge_refit.runtime.sharded_transfer import WIRE_VERSION as TRANSFER_VERSION


def test_ranks_of_another_sharded_transfer_version_or_checksum_setting_are_refused_by_name(tmp_path):
    """Rank 1 of an older, unversioned or newer install, then of another checksum=: both ranks raise
    TransferMismatchError naming it (the checksum case hung in the point-to-point sends before)."""
    launch = torchrun(2, ["tests/ranks/sharded_transfer_wire_check.py", str(tmp_path)], timeout=300)
    assert launch.returncode == 0, launch.output[-4000:]
    reports = {r["rank"]: r for r in (json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json")))}
    assert sorted(reports) == [0, 1], launch.output[-4000:]
    for rank, report in reports.items():
        for case, theirs in (
            ("older", TRANSFER_VERSION - 1),
            ("none", "none (an mbridge_refit from before it was versioned)"),
            ("newer", TRANSFER_VERSION + 1),
        ):
            message = report[case]
            assert "sharded transfer wire version mismatch" in message, (case, message)
            assert "Run the same mbridge_refit version on the trainer and the engine" in message, message
            if rank == 0:
                assert f"this side speaks version {TRANSFER_VERSION}, rank(s) [1] version {theirs}" in message, message
        assert "different checksum= settings ({True: [0], False: [1]})" in report["checksum"], report["checksum"]
        assert report["delivered"] == ([0.0, 1.0, 2.0, 3.0] if rank == 0 else [4.0, 5.0, 6.0, 7.0])


def _rank_reports(tmp_path) -> dict[int, dict]:
    return {r["rank"]: r for r in (json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json")))}


def test_trainer_ranks_of_another_plan_exchange_version_are_refused_by_name(tmp_path):
    """Rank 1 of an install whose plan exchange carries no version, then of the next version: both ranks
    raise PlanError (rank 0 naming rank 1 and both versions) instead of unpickling another install's
    contributions; agreeing ranks then exchange as before."""
    launch = torchrun(2, ["tests/ranks/plan_exchange_wire_check.py", str(tmp_path)], timeout=300)
    assert launch.returncode == 0, launch.output[-4000:]
    reports = _rank_reports(tmp_path)
    assert sorted(reports) == [0, 1], launch.output[-4000:]
    for rank, report in reports.items():
        mine, theirs = (PLAN_EXCHANGE_VERSION, PLAN_EXCHANGE_VERSION + 1)[:: 1 if rank == 0 else -1]
        newer = report["newer"]
        assert (
            f"plan exchange wire version mismatch: this side speaks version {mine}, rank(s) [{1 - rank}] version {theirs}"
            in newer
        ), newer
        assert "Run the same mbridge_refit version" in newer, newer
        assert "plan exchange wire version mismatch" in report["none"], report["none"]
        assert report["agreed"] == [["rank 0's own"], ["rank 1's own"]]
    none = reports[0]["none"]
    assert f"this side speaks version {PLAN_EXCHANGE_VERSION}, rank(s) [1] version none (an mbridge_refit from" in none


def test_trainer_ranks_of_another_collective_call_protocol_are_named_once_their_wait_runs_out(tmp_path):
    """Rank 1 of an install of the next CALLS_PROTOCOL, then of one from before the calls were versioned:
    once the wait runs out (2 s) the ranks name each other's version (the unversioned one by rank 0)
    instead of each other as ranks that did not call; agreeing ranks then meet."""
    launch = torchrun(2, ["tests/ranks/collective_call_wire_check.py", str(tmp_path)], timeout=300)
    assert launch.returncode == 0, launch.output[-4000:]
    reports = _rank_reports(tmp_path)
    assert sorted(reports) == [0, 1], launch.output[-4000:]
    for rank, report in reports.items():
        mine, theirs = (CALLS_PROTOCOL, CALLS_PROTOCOL + 1)[:: 1 if rank == 0 else -1]
        newer = report["newer"]
        assert newer.startswith("the export: collective call wire version mismatch"), newer
        assert f"this side speaks version {mine}, rank(s) [{1 - rank}] version {theirs}. Run the same" in newer, newer
        assert report["agreed"] == "arrived", report
    none = reports[0]["none"]
    assert f"this side speaks version {CALLS_PROTOCOL}, rank(s) [1] version none (an mbridge_refit from" in none, none


def _table_rows() -> dict[str, int]:
    """``{module.CONSTANT: version}`` of docs/architecture.md's table of wire formats."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Wire formats and their versions") :]
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| [^|]+ \| `([\w.]+)` \| (\d+) \|", section, re.MULTILINE)}


def test_every_wire_format_constant_is_in_the_table_with_its_value():
    """Each row names a module's constant and its value; each public ``*_VERSION`` / ``*_PROTOCOL`` constant
    the package defines has a row (a format added without one is noticed here)."""
    rows = _table_rows()
    assert rows, "docs/architecture.md has no table of wire formats"
    for name, version in rows.items():
        module, constant = name.rsplit(".", 1)
        assert getattr(importlib.import_module(f"mbridge_refit.{module}"), constant) == version, name
    defined = set()
    for path in (REPO / "mbridge_refit").rglob("*.py"):
        module = ".".join(path.relative_to(REPO / "mbridge_refit").with_suffix("").parts)
        for match in re.finditer(r"^((?!_)[A-Z_]*(?:VERSION|PROTOCOL)) = ", path.read_text(), re.MULTILINE):
            defined.add(f"{module}.{match[1]}")
    assert defined == set(rows), (sorted(defined - set(rows)), sorted(set(rows) - defined))
