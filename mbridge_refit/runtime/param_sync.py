"""Fresh weights from a model wrapped by Megatron DDP: finish pending parameter all-gathers.

With the distributed optimizer, ``optimizer.step()`` writes each data-parallel rank's updated
shard of the parameters; an all-gather over the data-parallel group then gives every rank the
full parameters. Without ``overlap_param_gather`` that gather runs inside ``step()``. With it,
Megatron defers the gather to the next forward pass (forward pre-hooks dispatch and wait for it
bucket by bucket), so between ``step()`` and the next forward each rank's parameters hold its
own shard's new values and every other shard's *pre-step* values. An export in that window
would yield stale weights without any error.

``finish_pending_param_gathers`` completes every deferred gather first, the way Megatron itself
does before evaluation and checkpointing (``DistributedDataParallel.disable_forward_pre_hook``
runs ``start_param_sync(force_sync=True)``): a gather already in flight is waited for, one not
yet dispatched runs synchronously, and the bucket group is marked dispatched, so the next
forward pass neither waits nor gathers again. Bucket groups whose gather completed are not
touched. Collective over each bucket group's data-parallel group when anything is pending: every
rank of the job calls it at the same point (``RefitBridge.export_hf_weights`` does, on every
rank, before deciding which ranks export). A model without Megatron DDP, or without deferred
gathers, is left as it is (no collective).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

__all__ = ["deferred_gather_groups", "finish_pending_param_gathers"]

logger = logging.getLogger(__name__)


def deferred_gather_groups(chunks: Iterable[torch.nn.Module]) -> list[Any]:
    """The DDP bucket groups of ``chunks`` whose parameter all-gather is deferred and not complete
    (dispatched and in flight, or not dispatched yet). Reads state only; no collective."""
    pending = []
    for chunk in chunks:
        config = getattr(chunk, "ddp_config", None)
        if config is None or not getattr(config, "overlap_param_gather", False):
            continue
        for group in [*getattr(chunk, "bucket_groups", []), *getattr(chunk, "expert_parallel_bucket_groups", [])]:
            if group.param_gather_handle is not None or not group.param_gather_dispatched:
                pending.append(group)
    return pending


def finish_pending_param_gathers(chunks: Iterable[torch.nn.Module]) -> int:
    """Complete every deferred parameter all-gather of ``chunks`` (module docstring); returns how
    many bucket groups it completed. Collective over their data-parallel groups when any is."""
    pending = deferred_gather_groups(chunks)
    if pending:
        with torch.no_grad():
            for group in pending:
                group.start_param_sync(force_sync=True)
        logger.debug("finished %d deferred parameter all-gathers before exporting", len(pending))
    return len(pending)
