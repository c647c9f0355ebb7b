"""Stand-in for mamba-ssm's CUDA extension ``selective_scan_cuda`` where mamba-ssm is built without it.

The GPU wheelhouse (``prepare-wheelhouse.sh``) and ``scripts/setup.sh`` build mamba-ssm without its
CUDA extensions: Megatron's Mamba layers use only its Triton ops, but ``import mamba_ssm`` imports
this extension. On the GPU host the checks put this directory on ``PYTHONPATH``; ``setup.sh``
copies this module into the environment when no real extension is installed. The model builds
and exports here never run a Mamba forward; anything that calls into the extension fails loudly.
"""


def __getattr__(name):
    raise ImportError(
        f"selective_scan_cuda.{name}: mamba-ssm was built without its CUDA extension (this module is a stand-in)"
    )
