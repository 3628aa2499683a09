"""A trained model put to use: loading parameters, sampling, scoring,
serving over HTTP and exporting (jax.export + a Triton repository)."""
