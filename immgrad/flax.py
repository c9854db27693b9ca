"""Flax integration: unmodified NNX and Linen models made immediate.

* ``immediate(fn, modules=None)``: :func:`immgrad.immediate` for ``fn``,
  stepping every parameter of its NNX or Linen model immediately inside
  ``immgrad.value_and_grad``; ``modules=`` (a tuple of classes) restricts
  that to those modules'. Flax's own code runs unchanged; the params tree
  is Flax's own (``nnx.split(model, nnx.Param)``'s state, Linen's
  ``params``).
* ``DEFAULT_MODULES``: Flax's weight-carrying modules (NNX ``nnx.Linear``,
  ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``, ``nnx.LayerNorm``,
  ``nnx.RMSNorm``, ``nnx.Embed``; Linen ``nn.Dense``, ``nn.DenseGeneral``,
  ``nn.Conv``, ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.Embed``):
  ``modules=DEFAULT_MODULES + (MyModule,)`` is those and yours.

Needs Flax: ``pip install "immgrad[flax]"``.
"""

try:
  import flax  # noqa: F401
except ImportError as e:
  raise ImportError(
    "immgrad.flax needs Flax, which is not installed: "
    'pip install "immgrad[flax]"'
  ) from e

from immgrad._src.adapters.flax import DEFAULT_MODULES as DEFAULT_MODULES
from immgrad._src.adapters.flax import immediate as immediate

__all__ = (
  "DEFAULT_MODULES",
  "immediate",
)
