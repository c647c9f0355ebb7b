"""Plan-time metadata: parallel layouts, slice placements, storage formats and the export plan.

Nothing here moves tensor data. ``layout`` (how a model is split), ``placement`` (where each HF
tensor's slices sit in a rank's shard), ``storage`` (how the trainer stores a parameter),
``entries`` (the plan's types, JSON), ``build`` (the plan from a model, once per model),
``engine_layout`` (how an inference engine slices each HF tensor) and ``transfer`` (the transfer
plan of an engine-sharded refit: which trainer rank sends which box to which engine rank).
"""
