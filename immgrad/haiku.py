"""Haiku integration: unmodified Haiku models made immediate.

``immediate`` and ``layer_stack`` for any Haiku model; ``Linear``,
``ConvND``, ``LayerNorm``, ...: Haiku's modules (thin subclasses) whose calls
go through ``immediate``; ``DEFAULT_MODULES``: the weight-carrying modules,
to extend in ``modules=``.
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
