"""A check the versioned JSON formats share (ExportPlan, TransferPlan): JSON of another version, or of
none, is refused by name."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest


def assert_other_version_refused(
    text: str, read: Callable[[str], Any], error: type[Exception], *, label: str, writer: str, current: int, version
) -> None:
    """``text`` (JSON this install wrote, at version ``current``) with its version replaced by ``version``
    (None: removed, as an install from before the format was versioned wrote it), read by ``read``: raises
    ``error`` naming the format (``label``), this side's version, ``writer``'s and the fix."""
    raw = json.loads(text)
    assert raw.pop("version") == current
    if version is not None:
        raw["version"] = version
    with pytest.raises(error) as refused:
        read(json.dumps(raw))
    message = str(refused.value)
    shown = "none (an mbridge_refit from before it was versioned)" if version is None else version
    assert f"{label} wire version mismatch: this side speaks version {current}" in message
    assert f"{writer} version {shown}. Run the same mbridge_refit version" in message
