"""Models to run on: the tiny model recipes and the Megatron model builder.

``recipes`` (the tiny models of ``recipes/`` at the repository root, named parallel layouts,
full-size shapes; seeded random values and the random checkpoint ``convert make-tiny`` writes),
``builder`` (a bridge's Megatron model at a layout, on CPU or GPU), ``cpu_specs`` and
``cpu_stand_ins`` (CPU builds of Transformer Engine specs and modules: local modules with the GPU
build's parameters) and ``cpu_forward`` (Megatron's forward on CPU, for ``convert verify-refit``).
Used by the CLI, the scripts and the tests; test-only tooling lives in ``mbridge_refit.testing``.
"""

__all__: list[str] = []
