"""mbridge_refit: fast, exact export of Megatron-Core weights as Hugging Face tensors.

Public names are imported lazily: importing Megatron-Bridge takes seconds, and the CLI's
argument checks and ``--help`` should not wait for it.
"""

from __future__ import annotations

from mbridge_refit.lazy_exports import lazy_getattr, public_names

_PUBLIC = {
    "mbridge_refit.bridge": ("RefitBridge", "ExportDiagnostics"),
    "mbridge_refit.plan.entries": ("ExportPlan", "PlanError"),
    "mbridge_refit.plan.layout": ("ParallelLayout",),
    "mbridge_refit.fp8.format": ("BlockwiseFP8Config", "FP8FormatError"),
}

__all__ = public_names(_PUBLIC)


__getattr__ = lazy_getattr(__name__, _PUBLIC)
