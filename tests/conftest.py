"""Shared pytest setup.

XLA reads XLA_FLAGS once, when jax first initialises its backends, so the flag
must be set here, before any test module imports jax: every test then sees 8
fake CPU devices and the sharding tests can build a real multi-device mesh.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
