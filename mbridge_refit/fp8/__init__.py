"""Blockwise FP8 (128x128, e4m3 + fp32 ``weight_scale_inv``): format, plan, quantizers, TE sources.

``format`` (facts and ``BlockwiseFP8Config``), ``keep`` (what each model family keeps in high
precision), ``plan`` (the FP8 export plan and its checks), ``reference`` (the torch quantizer
that defines the bits), ``kernels`` (Triton, CUDA only), ``quantize`` (the export transform over
buckets), ``te`` (Transformer Engine FP8 parameters) and ``export`` (``FP8Export``: one model's FP8
export and its stream).
"""
