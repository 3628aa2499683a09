"""Command-line plumbing shared by zebra_jax.main and the lab's scripts."""
