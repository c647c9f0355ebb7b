"""Inference engines as refit targets.

``base`` (the contracts: ``RefitSession``, the trainer side; ``RefitWorker``, the engine side's
RPCs; ``RefitStep``; the registry of engine adapters), the three transports, engine-agnostic,
each trainer side taking how to call the engine's workers from an adapter: ``ipc_session`` +
``ipc`` (colocated: the engine maps the trainer's memory and replays its recorded loader; trainer
side ``IpcSession``, engine side ``RefitReceiver``), ``sharded_ipc`` (colocated with a
tensor-parallel engine: each worker replays its loader from the shards the sharded transfer
delivers on its GPU; ``ShardedIpcSession``) and ``broadcast_session`` + ``broadcast`` (other GPUs:
the packed broadcast over a group the workers join; trainer side ``BroadcastSession``, engine side
``BroadcastTarget``), what they stand on: ``sharing`` (the export's
tensors described and shared by reference), ``ipc_handles`` (its CUDA IPC payload as JSON),
``apply_plan`` (the copies an engine's own loader performs, recorded once and replayed),
``shard_remap`` (a loader recorded full-size, read from a shard), ``copy_batches`` (with
``copy_kernels``: the replay as few launches),
``fingerprint`` (exact per-tensor checksums); and one package per engine adapter, the only code
that names its engine: ``vllm/`` (``trainer``: ``VLLMRefit``, ``VLLMBroadcastRefit``, the two sessions above bound to an
``LLM``; ``sharded``: ``VLLMShardedRefit``; ``worker``: the worker extension vLLM loads). Nothing here imports an engine at module import:
each is an optional extra (``mbridge_refit[vllm]``).
"""
