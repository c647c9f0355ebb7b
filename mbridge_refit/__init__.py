"""mbridge_refit: fast, exact export of Megatron-Core weights as Hugging Face tensors.

Public names are imported lazily: importing Megatron-Bridge takes seconds, and the CLI's
argument checks and ``--help`` should not wait for it.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "RefitBridge": "mbridge_refit.bridge",
    "ExportDiagnostics": "mbridge_refit.bridge",
    "ExportPlan": "mbridge_refit.plan.entries",
    "PlanError": "mbridge_refit.plan.entries",
    "ParallelLayout": "mbridge_refit.plan.layout",
    "BlockwiseFP8Config": "mbridge_refit.fp8.format",
    "FP8FormatError": "mbridge_refit.fp8.format",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'mbridge_refit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
