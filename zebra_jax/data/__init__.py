"""Text to token ids: sources, tokenizers, the id cache and batchers.

`pipeline` is the only reader of `config.data`. Imports nothing from the rest
of the package but `zebra_jax.errors`.
"""
