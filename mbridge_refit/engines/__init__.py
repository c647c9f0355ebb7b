"""Inference engines as refit targets.

``sharing`` (the export's tensors described and shared by reference; ``ipc_handles``, its CUDA
IPC payload as JSON), ``apply_plan`` (the
copies an engine's own loader performs, recorded once and replayed), ``receiver`` (the engine
side of a refit, engine-agnostic), ``fingerprint`` (exact per-tensor checksums), and for vLLM:
``vllm_worker`` (the worker extension vLLM loads) and ``vllm`` (the trainer side). Nothing here
imports vLLM at module import: it is an optional extra (``mbridge_refit[vllm]``).
"""
