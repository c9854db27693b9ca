"""Haiku integration: immediate modules, and unmodified models made immediate.

* ``immediate(fn, modules=None)``: every parameter an unmodified forward
  function reads updates immediately inside ``immgrad.value_and_grad``;
  ``modules=`` (a tuple of classes) restricts that to those modules'.
* ``DEFAULT_MODULES``: Haiku's weight-carrying modules (``hk.Linear``,
  ``hk.ConvND``, ``hk.LayerNorm``, ``hk.RMSNorm``, ``hk.Embed``):
  ``modules=DEFAULT_MODULES + (MyModule,)`` is those and yours.
* ``Linear``, ``Conv1D``, ``Conv2D``, ``Conv3D``, ``ConvND``, ``LayerNorm``,
  ``RMSNorm``, ``Embed``: Haiku's modules (thin subclasses, with Haiku's
  constructors, parameter names, shapes, dtypes, initialisers and code)
  whose calls go through ``immediate``.
* ``layer_stack``: ``hk.layer_stack`` through ``immediate``.
"""

from immgrad._src.adapters.haiku import DEFAULT_MODULES as DEFAULT_MODULES
from immgrad._src.adapters.haiku import Conv1D as Conv1D
from immgrad._src.adapters.haiku import Conv2D as Conv2D
from immgrad._src.adapters.haiku import Conv3D as Conv3D
from immgrad._src.adapters.haiku import ConvND as ConvND
from immgrad._src.adapters.haiku import Embed as Embed
from immgrad._src.adapters.haiku import LayerNorm as LayerNorm
from immgrad._src.adapters.haiku import Linear as Linear
from immgrad._src.adapters.haiku import RMSNorm as RMSNorm
from immgrad._src.adapters.haiku import immediate as immediate
from immgrad._src.adapters.haiku import layer_stack as layer_stack

__all__ = (
  "Conv1D",
  "Conv2D",
  "Conv3D",
  "ConvND",
  "DEFAULT_MODULES",
  "Embed",
  "LayerNorm",
  "Linear",
  "RMSNorm",
  "immediate",
  "layer_stack",
)
