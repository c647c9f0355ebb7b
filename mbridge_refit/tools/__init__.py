"""Tools around the library: launching ranks, tiny model recipes, the CPU model builder, a CPU
forward pass and the refit verifier. Used by the CLI, the scripts and the tests."""
