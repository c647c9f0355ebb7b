"""Stand-in for mamba-ssm's CUDA extension ``selective_scan_cuda`` on the GPU host (checks only,
never installed with the package).

The wheelhouse builds mamba-ssm without its CUDA extensions (``prepare-wheelhouse.sh``): Megatron's
Mamba layers use only its Triton ops, but ``import mamba_ssm`` imports this extension. The export
checks build Nemotron-H models and never run a Mamba forward; anything that calls into the
extension fails loudly here.
"""


def __getattr__(name):
    raise ImportError(f"selective_scan_cuda.{name}: mamba-ssm was built without its CUDA extension (this module is a stand-in)")
