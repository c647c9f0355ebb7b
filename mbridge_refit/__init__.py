"""mbridge_refit: fast, exact export of Megatron-Core weights as Hugging Face tensors.

``RefitBridge`` (a drop-in ``AutoBridge``) is imported lazily: importing Megatron-Bridge takes
seconds, and the CLI's argument checks and ``--help`` should not wait for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RefitBridge", "ExportPlan", "PlanError", "ParallelLayout", "BlockwiseFP8Config"]


def __getattr__(name: str) -> Any:
    if name == "RefitBridge":
        from mbridge_refit.bridge import RefitBridge

        return RefitBridge
    if name in ("ExportPlan", "PlanError"):
        from mbridge_refit import plan

        return getattr(plan, name)
    if name == "BlockwiseFP8Config":
        from mbridge_refit.fp8 import BlockwiseFP8Config

        return BlockwiseFP8Config
    if name == "ParallelLayout":
        from mbridge_refit.layout import ParallelLayout

        return ParallelLayout
    raise AttributeError(f"module 'mbridge_refit' has no attribute {name!r}")
