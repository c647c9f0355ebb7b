"""The export runtime: runs an ``ExportPlan`` on this rank.

``schedule`` (pure: the plan cut into gather ops and buckets, and how each HF tensor is assembled),
``collectives`` (process groups and the gathers), ``buffers`` (the bridge-owned output cache),
``selection`` (lazy row selections), ``weight_source`` (``ExportsWeights``: what
consumers that drive an export ask of a bridge), ``exporter`` (``PlanExporter``: the per-step loop),
``param_sync`` (Megatron DDP's deferred parameter gathers), ``sharded_transfer``
(``ShardedTransfer``: a transfer plan run with point-to-point sends and local copies) and
``replica_agreement`` (whether the ranks that send copies of one tensor hold the same bytes).
"""
