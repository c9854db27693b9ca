"""Equinox integration: unmodified Equinox models made immediate.

``DEFAULT_MODULES``: Equinox's weight-carrying modules, to extend in
``modules=``. Needs Equinox: ``pip install "immgrad[equinox]"``.
"""

try:
  import equinox as _equinox  # noqa: F401
except ImportError as e:
  raise ImportError(
    'immgrad.equinox needs Equinox: pip install "immgrad[equinox]"'
  ) from e

from immgrad._src.adapters.equinox import DEFAULT_MODULES as DEFAULT_MODULES
from immgrad._src.adapters.equinox import immediate as immediate

__all__ = (
  "DEFAULT_MODULES",
  "immediate",
)
