"""Sinks: consumers of the exported ``(hf_name, tensor)`` stream.

The contract lives in :mod:`.base`; each other module owns one sink, except the parts of
:mod:`.packed_broadcast`: :mod:`.broadcast_wire` (the wire format both ends share),
:mod:`.broadcast_buffers` (the memory each end keeps across refits) and :mod:`.broadcast_timing`
(where a refit's time goes, for benchmarks).
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
from mbridge_refit.sinks.packed_broadcast import (
    DEFAULT_BUCKET_BYTES,
    ChecksumError,
    PackedBroadcastConfig,
    PackedBroadcastReceiver,
    PackedBroadcastSender,
    PlanMismatchError,
    RefitStatusError,
)

__all__ += [
    "ChecksumError",
    "DEFAULT_BUCKET_BYTES",
    "FUSED_TENSOR_RULES",
    "FusedTensorRule",
    "HFModelUpdateSink",
    "PackedBroadcastConfig",
    "PackedBroadcastReceiver",
    "PackedBroadcastSender",
    "PlanMismatchError",
    "RefitStatusError",
    "WeightUpdateError",
]
