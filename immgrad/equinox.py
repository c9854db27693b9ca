"""Equinox integration: unmodified Equinox models made immediate.

* ``immediate(fn, modules=None)``: every parameter of an unmodified
  Equinox model in ``fn`` updates immediately inside
  ``immgrad.value_and_grad``; ``modules=`` (a tuple of classes) restricts
  that to those modules'. The params tree stays Equinox's own
  (``eqx.partition(model, eqx.is_inexact_array)``).
* ``DEFAULT_MODULES``: Equinox's weight-carrying modules
  (``eqx.nn.Linear``, ``eqx.nn.Conv*``, ``eqx.nn.LayerNorm``,
  ``eqx.nn.RMSNorm``, ``eqx.nn.Embedding``): ``modules=DEFAULT_MODULES +
  (MyModule,)`` is those and yours.

Needs Equinox: ``pip install "immgrad[equinox]"``.
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
