"""Scripts on top of the library: benchmarks, the GPU report, the stripes
experiment, plots and fault injection (python -m zebra_jax.tools.NAME)."""
