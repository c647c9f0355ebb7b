"""mbridge_refit: fast, exact export of Megatron-Core weights as Hugging Face tensors.

Public names are imported lazily: importing Megatron-Bridge takes seconds, and the CLI's
argument checks and ``--help`` should not wait for it.
"""

from __future__ import annotations

from mbridge_refit.lazy_exports import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _PUBLIC)
