"""Haiku integration: immediate modules, and unmodified models made immediate.

* ``Linear``, ``Conv1D``, ``Conv2D``, ``Conv3D``, ``ConvND``, ``LayerNorm``,
  ``RMSNorm``, ``Embed``: Haiku's modules (subclasses, with Haiku's
  constructors, parameter names, shapes, dtypes and initialisers) whose
  weights update immediately inside ``immgrad.value_and_grad``.
* ``immediate(fn, modules=...)``: the same for every call of those Haiku
  modules inside an unmodified forward function.
* ``layer_stack``: ``hk.layer_stack`` over immediate layers.
"""

from immgrad._src.haiku_immediate import DEFAULT_MODULES as DEFAULT_MODULES
from immgrad._src.haiku_immediate import immediate as immediate
from immgrad._src.haiku_immediate import layer_stack as layer_stack
from immgrad._src.haiku_layers import Conv1D as Conv1D
from immgrad._src.haiku_layers import Conv2D as Conv2D
from immgrad._src.haiku_layers import Conv3D as Conv3D
from immgrad._src.haiku_layers import ConvND as ConvND
from immgrad._src.haiku_layers import Embed as Embed
from immgrad._src.haiku_layers import LayerNorm as LayerNorm
from immgrad._src.haiku_layers import Linear as Linear
from immgrad._src.haiku_layers import RMSNorm as RMSNorm

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
