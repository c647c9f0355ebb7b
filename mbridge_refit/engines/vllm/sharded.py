"""The vLLM adapter's trainer side of the colocated refit at engine tensor parallelism > 1.

``VLLMShardedRefit(llm, engine="tp2")`` is an ``engines.ipc.sharded.ShardedIpcSession`` that calls
vLLM's workers through ``llm.collective_rpc``. Placement as vLLM makes it: an ``LLM`` at
``tensor_parallel_size=N`` started (by its default multi-process executor) from trainer rank 0 runs
worker r on local GPU r, the GPU torchrun gives trainer rank r, so engine rank r's shards are
trainer rank r's (the transfer plan's default placement). Trainer rank 0 passes ``llm`` (its call
reaches every worker; each maps, by CUDA IPC, the handles of the trainer rank on its own GPU); the
other ranks pass ``None`` and take part in the transfer and the outcome. With vLLM's
``external_launcher`` (the engine inside each torchrun process) every rank passes its own ``llm``.
The engine skips a tied output layer (``ignored_by_engine``): it is left out of the plan. An engine
started from a blockwise FP8 checkpoint is refit with ``fp8="blockwise"`` (each rank quantizes its
shards; ``engines.ipc.sharded``); vLLM's FP8 layers are recorded through its layerwise reload.
"""

from __future__ import annotations

from typing import Any

from mbridge_refit.engines.ipc.sharded import ShardedIpcSession
from mbridge_refit.engines.ipc.sharing import CudaIpcTransport, Transport
from mbridge_refit.engines.vllm import trainer

__all__ = ["VLLMShardedRefit"]


def VLLMShardedRefit(  # noqa: N802 - a session class's factory, named as the sessions it sits beside
    llm: Any,
    *,
    engine: Any = "tp2",
    transport: Transport | None = None,
    timeout_s: float = 600.0,
    reset_prefix_cache: bool = True,
    **options: Any,
) -> ShardedIpcSession:
    """A sharded colocated refit session into ``llm`` (None on trainer ranks without the handle).
    ``options``: ``engine_ranks``, ``group``, ``check_first_refit``, ``allow_partial``
    (``ShardedIpcSession``). Every call to the workers is bounded by ``timeout_s``; after each
    that writes the weights the engine's prefix cache is reset (``reset_prefix_cache``; ``trainer.reset_prefix_cache``)."""

    def call_workers(method: str, *args: Any) -> list:
        return llm.collective_rpc(method, timeout=timeout_s, args=args)

    return ShardedIpcSession(
        None if llm is None else call_workers,
        engine=engine,
        transport=transport or CudaIpcTransport(),
        ignored=trainer.ignored_by_engine,
        after_weights_written=(lambda: trainer.reset_prefix_cache(llm))
        if llm is not None and reset_prefix_cache
        else None,
        **options,
    )
