"""The network: ZebraLSTM layers, their hand-written backward pass, heads, the LM.

Imports nothing from the rest of the package but `zebra_jax.errors`.
"""
