"""The ``--json`` summary of ``roundtrip``, ``export`` and ``verify``: one JSON object on stdout.

While a command given ``--json`` runs, everything else written to stdout (Megatron prints its
parameter counts, ``verify`` its report) goes to stderr (``summary_on_stdout``), so stdout holds
the object alone: rank 0 writes it as the command ends (``write_summary``), a failed command's
too (``ok`` false, its exit code and message). Every object has ``command``, ``ok`` and
``exit_code``; the commands add what they wrote or compared (``commands``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any, Iterator, TextIO

__all__ = ["summary_on_stdout", "write_summary"]

_stdout: list[TextIO] = []  # the stdout of the command running with --json (none: no summary)


@contextlib.contextmanager
def summary_on_stdout(enabled: bool) -> Iterator[None]:
    """For the block, stdout is stderr, and ``write_summary`` writes to the stdout of before."""
    if not enabled:
        yield
        return
    _stdout.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _stdout.pop()


def write_summary(payload: dict[str, Any]) -> None:
    """Write ``payload`` as the summary of the command running with ``--json`` (a no-op without
    it). Call it on one rank (rank 0)."""
    if _stdout:
        _stdout[-1].write(json.dumps(payload, indent=1) + "\n")
        _stdout[-1].flush()
