"""Checkpoints on disk: the HF safetensors reader (``hf``), Megatron-Core ``torch_dist``
checkpoints (``megatron``) and the sliced HF -> Megatron loader (``loader``)."""
