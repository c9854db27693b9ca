"""immgrad: weight updates applied during the backward pass, for JAX."""

from importlib import metadata as _metadata

from immgrad._src.auto import Layers as Layers
from immgrad._src.auto import immediate as immediate
from immgrad._src.auto import layers as layers
from immgrad._src.base import ImmediateGrad as ImmediateGrad
from immgrad._src.base import ShimState as ShimState
from immgrad._src.base import ShimTransformation as ShimTransformation
from immgrad._src.base import Stepped as Stepped
from immgrad._src.clipping import clip_by_layer_norm as clip_by_layer_norm
from immgrad._src.grad import value_and_grad as value_and_grad
from immgrad._src.layer import immediate_layer as immediate_layer
from immgrad._src.ordinary import OrdinaryWarning as OrdinaryWarning
from immgrad._src.remat import checkpoint as checkpoint
from immgrad._src.scan import scan as scan
from immgrad._src.serialization import restore_checkpoint as restore_checkpoint
from immgrad._src.serialization import save_checkpoint as save_checkpoint
from immgrad._src.shim import shim as shim
from immgrad._src.shim import shim_state_from_optax as shim_state_from_optax
from immgrad._src.shim import shim_state_to_optax as shim_state_to_optax
from immgrad._src.train_step import train_step as train_step


def __getattr__(name):
  """``immgrad.haiku``, ``immgrad.flax``, ``immgrad.equinox``: imported on use.

  So ``import immgrad`` loads no model library.
  """
  if name in ("haiku", "flax", "equinox"):
    import importlib

    return importlib.import_module(f"immgrad.{name}")
  raise AttributeError(f"module 'immgrad' has no attribute {name!r}")


try:
  __version__ = _metadata.version("immgrad")
except _metadata.PackageNotFoundError:  # Imported from a source tree.
  __version__ = "0+unknown"

__all__ = (
  "ImmediateGrad",
  "Layers",
  "OrdinaryWarning",
  "ShimState",
  "ShimTransformation",
  "Stepped",
  "checkpoint",
  "clip_by_layer_norm",
  "immediate",
  "immediate_layer",
  "layers",
  "restore_checkpoint",
  "save_checkpoint",
  "scan",
  "shim",
  "shim_state_from_optax",
  "shim_state_to_optax",
  "train_step",
  "value_and_grad",
)
