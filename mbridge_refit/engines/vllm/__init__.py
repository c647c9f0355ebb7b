"""The vLLM adapter: the only code that names vLLM (an optional extra, ``mbridge_refit[vllm]``;
nothing here imports it at module import).

``trainer`` (the trainer side: ``VLLMRefit`` over the colocated ``ipc`` transport,
``VLLMBroadcastRefit`` over ``broadcast``, ``engine_kwargs``, ``prompt_logprobs``), ``sharded``
(``VLLMShardedRefit``: colocated at engine tensor parallelism > 1, over ``sharded_ipc``) and ``worker``
(``RefitWorkerExtension``, the worker extension vLLM loads). Importing this package registers the
adapter as ``"vllm"`` (``engines.base.engine_adapter("vllm")``).
"""

from mbridge_refit.engines.base import BROADCAST, IPC, SHARDED_IPC, EngineAdapter, register_adapter
from mbridge_refit.engines.vllm.sharded import VLLMShardedRefit
from mbridge_refit.engines.vllm.trainer import (
    VLLMBroadcastRefit,
    VLLMRefit,
    engine_kwargs,
    ignored_by_engine,
    prompt_logprobs,
)
from mbridge_refit.engines.vllm.worker import WORKER_EXTENSION, RefitWorkerExtension

__all__ = [
    "ADAPTER",
    "WORKER_EXTENSION",
    "RefitWorkerExtension",
    "VLLMBroadcastRefit",
    "VLLMRefit",
    "VLLMShardedRefit",
    "engine_kwargs",
    "ignored_by_engine",
    "prompt_logprobs",
]

ADAPTER = register_adapter(
    EngineAdapter(
        name="vllm",
        sessions={IPC: VLLMRefit, SHARDED_IPC: VLLMShardedRefit, BROADCAST: VLLMBroadcastRefit},
        worker_extension=WORKER_EXTENSION,
        engine_kwargs=engine_kwargs,
    )
)
