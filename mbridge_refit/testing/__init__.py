"""Test support: what the tests and the conformance scripts use, and no production module imports
(``tests/test_package.py`` checks it; the wheel leaves this package out).

``conformance`` (one cell of the conformance matrix: RefitBridge's export of a registered
architecture against stock's, run as ranks), ``roundtrip_conformance`` (the matrix's roundtrip
column: ``convert roundtrip`` against the tiny checkpoint on disk), ``export_comparison`` (a stream
against its oracle: names, order, dtype, shape, bytes; the FP8 stream the reference quantizer
expects), ``simulated_ranks`` (one rank of a layout in this process, the others simulated away),
``parameter_classes`` (engine parameter classes as engines write them: vLLM's dispatching one),
``plans`` (export plans written out by hand, for the byte protocols' tests and checks),
``many_experts`` (the tiny MoE recipe at a chosen expert count, for counts of host work per tensor),
``vllm_worker`` (the worker extension the vLLM checks load), ``vllm_harness`` (what the vLLM checks and
benchmarks of ``scripts/`` share: options, trainer, engines, timings, results) and ``tiny_models`` (a tiny config of every registered architecture and its seeded random
checkpoint in the family's published layout).
"""

__all__: list[str] = []
