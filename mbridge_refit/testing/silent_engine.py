"""An engine stand-in for timing the trainer's side of a colocated refit alone: ``answering_workers``,
the ``call_workers`` of an ``engines.ipc.trainer.IpcSession`` whose workers take every RPC and do
nothing (an open reports nothing, an apply took no time). Used by the host-work checks and the
trainer-side benchmarks (``scripts/profile_ipc_trainer.py``, ``scripts/bench_ipc_host.py``,
``scripts/bench_refit_vllm.py``); nothing is copied, so only the trainer's work is measured."""

from __future__ import annotations

__all__ = ["answering_workers"]


def answering_workers(method: str, *args) -> list:
    """One worker's answer to ``method``: ``{}`` for an open, 0.0 ms for anything else."""
    return [{} if method == "mbridge_refit_open" else 0.0]
