"""Every wire format mbridge_refit sends between processes or ranks carries a version and refuses
another one by name: docs/architecture.md's table of them against each format's constant, and the
sharded transfer's handshake between two gloo ranks (tests/ranks/sharded_transfer_wire_check.py)."""

from __future__ import annotations

import json

from conftest import torchrun

from mbridge_refit.runtime.sharded_transfer import WIRE_VERSION as TRANSFER_VERSION


def test_ranks_of_another_sharded_transfer_version_or_checksum_setting_are_refused_by_name():
    """Rank 1 of an older, unversioned or newer install, then of another checksum=: both ranks raise
    TransferMismatchError naming it (the checksum case hung in the point-to-point sends before)."""
    launch = torchrun(2, ["tests/ranks/sharded_transfer_wire_check.py"], timeout=300)
    assert launch.returncode == 0, launch.output[-4000:]
    reports = {r["rank"]: r for r in (json.loads(line) for line in launch.output.splitlines() if line.startswith("{"))}
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
