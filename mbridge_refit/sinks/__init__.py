"""Sinks: consumers of the exported ``(hf_name, tensor)`` stream.

The contract lives in :mod:`.base`; each other module owns one sink. The packed broadcast's sender
and receiver are the broadcast refit's, in ``engines.broadcast.engine.packed``.
"""

from mbridge_refit.sinks.base import DiscardSink, WeightSink, drain
from mbridge_refit.sinks.safetensors import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_NAME,
    ShardAssignment,
    ShardedSafetensorsWriter,
    ShardPlanner,
    plan_shards,
    shard_file_name,
)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DiscardSink",
    "INDEX_NAME",
    "ShardAssignment",
    "ShardPlanner",
    "ShardedSafetensorsWriter",
    "WeightSink",
    "drain",
    "plan_shards",
    "shard_file_name",
]

from mbridge_refit.sinks.model_update import FUSED_TENSOR_RULES, FusedTensorRule, HFModelUpdateSink, WeightUpdateError

__all__ += [
    "FUSED_TENSOR_RULES",
    "FusedTensorRule",
    "HFModelUpdateSink",
    "WeightUpdateError",
]
