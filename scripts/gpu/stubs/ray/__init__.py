"""Stand-in for ``ray`` on the GPU host (benchmarks only, never installed with the package).

vLLM 0.26.0's ``weight_transfer/ipc_engine.py`` imports ray at module top, but its callable
send mode (what scripts/bench_refit_vllm.py uses for the native baseline) never touches it, and
the offline wheelhouse holds no ray. Anything that really uses ray fails loudly here.
"""


def __getattr__(name):
    raise ImportError(f"ray.{name}: ray is not installed on this host (this module is a stand-in)")
