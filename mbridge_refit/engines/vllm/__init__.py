"""The vLLM adapter: the only code that names vLLM (an optional extra, ``mbridge_refit[vllm]``;
nothing here imports it at module import).

``trainer`` (the trainer side: ``VLLMRefit`` over the colocated ``ipc`` transport
(``engines.ipc.trainer.IpcSession`` bound to ``llm``), ``VLLMBroadcastRefit`` over ``broadcast``
(``engines.broadcast.trainer.BroadcastSession`` bound to ``llm``), ``engine_kwargs``, ``prompt_logprobs``), ``sharded``
(``VLLMShardedRefit``: colocated at engine tensor parallelism > 1, over ``engines.ipc.sharded``), ``adapter``
(``VLLMAdapterRefit``: a LoRA adapter into the engine's adapter slot, over ``engines.lora.ipc``), ``lora`` (the
engine side of that: vLLM's LoRA manager fed from memory) and ``worker``
(``RefitWorkerExtension``, the worker extension vLLM loads). Importing this package registers the
adapter as ``"vllm"`` (``engines.base.engine_adapter("vllm")``).
"""

from mbridge_refit.engines.base import ADAPTER_IPC, BROADCAST, IPC, SHARDED_IPC, EngineAdapter, register_adapter
from mbridge_refit.engines.vllm.adapter import VLLMAdapterRefit
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
    "VLLMAdapterRefit",
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
        sessions={
            IPC: VLLMRefit,
            SHARDED_IPC: VLLMShardedRefit,
            BROADCAST: VLLMBroadcastRefit,
            ADAPTER_IPC: VLLMAdapterRefit,
        },
        worker_extension=WORKER_EXTENSION,
        engine_kwargs=engine_kwargs,
    )
)
