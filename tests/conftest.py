"""Shared pytest setup.

XLA reads XLA_FLAGS once, when jax first initialises its backends, so the flag
must be set here, before any test module imports jax: every test then sees 8
fake CPU devices and the sharding tests can build a real multi-device mesh.

Tests run on the CPU even where a GPU is installed: the bitwise-resume and
8-device tests hold only there. `ZEBRA_JAX_TEST_GPU=1 pytest -m gpu` runs the
GPU smoke tests on the GPU instead.
"""

import os

if os.environ.get("ZEBRA_JAX_TEST_GPU") != "1":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("XLA_FLAGS",
                        "--xla_force_host_platform_device_count=8")
