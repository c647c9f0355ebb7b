"""Inference engines as refit targets.

``base`` (the contracts: ``RefitSession``, the trainer side; ``RefitWorker``, the engine side's
RPCs; ``RefitStep``; the registry of engine adapters) and ``worker_call`` (an RPC on a thread of
its own), shared by every path; ``replay/`` (the copies an engine's own loader performs, recorded
once and replayed, what every path stands on); one package per transport, engine-agnostic, each
with a trainer side taking how to call the engine's workers from an adapter and an engine side
behind the worker RPCs: ``ipc/`` (colocated: the engine maps the trainer's memory and replays its
recorded loader; ``trainer.IpcSession``, ``engine.RefitReceiver``, ``sharded.ShardedIpcSession``
for a tensor-parallel engine) and ``broadcast/`` (other GPUs: the packed broadcast over a group
the workers join; ``trainer.BroadcastSession``, ``engine.BroadcastTarget``), which never import
each other; ``lora/`` (a LoRA adapter into the engine's adapter slot); and one package per engine
adapter, the only code that names its engine: ``vllm/`` (``trainer``: ``VLLMRefit``,
``VLLMBroadcastRefit``, the two sessions above bound to an ``LLM``; ``sharded``:
``VLLMShardedRefit``; ``worker``: the worker extension vLLM loads). Nothing here imports an engine
at module import: each is an optional extra (``mbridge_refit[vllm]``).
"""
