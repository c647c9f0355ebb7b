"""Checkpoints on disk: the HF safetensors reader (``hf``), Megatron-Core ``torch_dist``
checkpoints (``megatron``, their pickles read by ``dcp_pickles``), the sliced HF -> Megatron
loader (``loader``), and how a checkpoint directory is written (``publish``: crash-safe swap;
``output_lock``: one writer per output)."""
