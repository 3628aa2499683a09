"""The names of the device mesh's axes, as the model sees them.

The model splits each layer's stripes over the "stripe" axis and the batch
over "data"; `runtime/parallel.py` builds the mesh with these names. They
live on the model's floor so that the model needs nothing from above it.
"""

DATA_AXIS = "data"
STRIPE_AXIS = "stripe"


def stripe_devices(mesh) -> int:
  """The size of the mesh's stripe axis (1 for a mesh without one)."""
  return dict(mesh.shape).get(STRIPE_AXIS, 1)
