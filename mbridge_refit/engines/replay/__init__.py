"""The replay of an engine's own loader, engine- and transport-agnostic: what every refit path
stands on to write the engine's parameters.

``apply_plan`` (the copies an engine's loader performs, recorded once and replayed each step),
``shard_remap`` (a loader recorded against full-size tensors, its reads moved into a shard),
``copy_batches`` (with ``copy_kernels``: the replay's copies as few launches) and ``fingerprint``
(exact per-tensor checksums, proving a replay writes what the loader wrote).
"""
