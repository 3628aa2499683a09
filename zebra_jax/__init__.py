"""zebra_jax: ZebraLSTM (striped LSTM) language models in JAX/Flax.

  import zebra_jax
  model = zebra_jax.load("runs/demo")        # a trained workdir
  model.generate(["The "], zebra_jax.SamplingParams(temperature=0.7))

Importing the package changes nothing in the process (no allocator, logging,
environment or flag settings; tests/test_architecture.py checks it): the
entry points set what they need (runtime/host_memory.py). Nor does it start
JAX: `load` and `Model` (api.py) are imported when first named.
"""

__version__ = "0.1.0"

__all__ = ["load", "Model", "SamplingParams", "__version__"]


def __getattr__(name: str):
  """The public names, imported on first use (PEP 562)."""
  # pylint: disable=g-import-not-at-top
  if name in ("load", "Model"):
    from zebra_jax import api
    return getattr(api, name)
  if name == "SamplingParams":
    from zebra_jax.engine import SamplingParams
    return SamplingParams
  raise AttributeError(f"module 'zebra_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted(set(globals()) | {"load", "Model", "SamplingParams"})
