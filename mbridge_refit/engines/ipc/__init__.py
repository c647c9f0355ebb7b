"""The colocated refit over CUDA IPC: the engine on the trainer's GPUs maps the trainer's memory
and replays its own recorded loader from it. Never imports ``engines.broadcast.engine`` (``tests/test_package.py``).

``trainer`` (the trainer side: ``IpcSession`` exports what is not live and shares it), ``engine``
(the engine side behind the worker RPCs: ``RefitReceiver``), ``sharded`` (colocated with a
tensor-parallel engine: ``ShardedIpcSession``, each worker fed its shards by the sharded transfer;
engine side ``RefitReceiver``), ``sharing`` (where an export's tensors live: ``SharedLayout``;
CUDA IPC and in-process transports), ``handles`` (the CUDA IPC payload as typed JSON, no pickle),
``completion`` (the end of an engine's replay told by a CUDA event shared by IPC) and
``go_ahead`` (the trainer's word to a worker already holding a step's apply RPC: apply or skip).
"""
