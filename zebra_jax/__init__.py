"""zebra_jax: ZebraLSTM (striped LSTM) language models in JAX/Flax."""

from zebra_jax.runtime import host_memory as _host_memory

__version__ = "0.1.0"

# Before JAX starts its backend, whichever entry point imported the package
# (runtime/host_memory.py says why).
_host_memory.reuse_freed_host_memory()
