"""Flax integration: unmodified NNX and Linen models made immediate.

``DEFAULT_MODULES``: Flax's weight-carrying modules, to extend in
``modules=``. Needs Flax: ``pip install "immgrad[flax]"``.
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
