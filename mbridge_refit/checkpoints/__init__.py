"""Checkpoints on disk: the HF safetensors reader (``hf``), Megatron-Core ``torch_dist``
checkpoints (``megatron``, their pickles read by ``dcp_pickles``) and the sliced HF -> Megatron
loader (``loader``)."""
