"""zebra_jax: ZebraLSTM (striped LSTM) language models in JAX/Flax.

Importing the package changes nothing in the process (no allocator, logging,
environment or flag settings; tests/test_architecture.py checks it): the
entry points set what they need (runtime/host_memory.py).
"""

__version__ = "0.1.0"
