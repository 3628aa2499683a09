"""Command-line plumbing shared by zebra_jax.main and the tools."""
