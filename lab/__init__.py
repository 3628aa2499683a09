"""The lab beside the package: benchmarks, the GPU report, the stripes
experiment, the scaling model, chaos and the latency and data benches.

Each script runs from a checkout as `python3 -m lab.NAME`; lab/benchmarks/
holds what they share. The lab imports zebra_jax, never the reverse, and the
wheel ships zebra_jax alone.
"""
