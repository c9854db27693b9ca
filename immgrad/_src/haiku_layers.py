"""Haiku's weight-carrying modules, as immediate layers.

Each function here computes one Haiku module's ``__call__`` (given as
``original``, bound to the module) with the module's parameters going
through :func:`immgrad.immediate_layer`. Inside
``immgrad.value_and_grad`` it fetches the parameters with the names and
shapes Haiku uses and routes them, and only them, through the immediate
primitive; what is not a parameter (a normalisation's statistics, an
activation) stays outside it, so ``mode="updated"`` costs no extra FLOPs.
Outside a step it calls ``original``, so initialisation (names, shapes,
dtypes, initialisers, random numbers) is Haiku's, bit for bit.

The same functions serve the modules in ``immgrad.haiku`` (``Linear`` and
friends, subclasses of Haiku's) and ``immgrad.haiku.immediate``, which
routes the calls of an unmodified model's ``hk.Linear`` and friends here.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from immgrad._src import context
from immgrad._src import layer as layer_lib
from immgrad._src import reparam


def _stepping() -> bool:
  return context.current() is not None


def public_name(module: hk.Module) -> str:
  """``module``'s Haiku class as users write it (``hk.Conv2D``)."""
  base = next(
    c for c in type(module).__mro__ if c.__module__.startswith("haiku.")
  )
  return f"hk.{base.__name__}"


def _original(compute_dtype) -> bool:
  """Whether Haiku's own ``__call__`` computes the module here.

  Outside a step, unless the module computes in ``compute_dtype``: then it
  casts inside an immediate layer (an ordinary function outside a step),
  so plain training runs the very arithmetic a step runs. At init it is
  always Haiku's, which creates the parameters.
  """
  return not _stepping() and (compute_dtype is None or hk.running_init())


def _apply(module: hk.Module, fun, x, params, compute_dtype=None):
  """``fun(x, params)`` as an immediate layer named after ``module``.

  Refuses first if ``params`` holds an array computed from the params tree
  (``reparam.py``): a custom getter changed the module's weights.
  """
  base_name = public_name(module)
  reparam.check_parameters(
    "immgrad.haiku.immediate",
    f"{base_name} {module.module_name!r}",
    base_name,
    params,
    "made by a custom getter, such as hk.custom_getter or "
    "hk.mixed_precision's cast, or by a cast of the params",
  )
  return layer_lib.immediate_layer(
    fun, name=module.module_name, compute_dtype=compute_dtype
  )(x, params)


def linear(
  module: hk.Linear, original, inputs, *, precision=None, compute_dtype=None
):
  """``hk.Linear.__call__``, immediate inside a step."""
  if _original(compute_dtype):
    return original(inputs, precision=precision)
  inputs = jnp.asarray(inputs)
  if not inputs.shape:
    raise ValueError("Input must not be scalar.")
  module.input_size = inputs.shape[-1]
  dtype = inputs.dtype
  params = {
    "w": hk.get_parameter("w", [inputs.shape[-1], module.output_size], dtype)
  }
  if module.with_bias:
    params["b"] = hk.get_parameter("b", [module.output_size], dtype)

  def affine(x, p):
    out = jnp.dot(x, p["w"], precision=precision)
    if "b" in p:
      out = out + jnp.broadcast_to(p["b"], out.shape)
    return out

  return _apply(module, affine, inputs, params, compute_dtype)


def conv(
  module: hk.ConvND, original, inputs, *, precision=None, compute_dtype=None
):
  """``hk.ConvND.__call__`` (``Conv1D``/``2D``/``3D``), immediate in a step."""
  if _original(compute_dtype):
    return original(inputs, precision=precision)
  inputs = jnp.asarray(inputs)
  unbatched_rank = module.num_spatial_dims + 1
  if inputs.ndim not in (unbatched_rank, unbatched_rank + 1):
    raise ValueError(
      f"Input to {module.module_name} needs to have rank in "
      f"{[unbatched_rank, unbatched_rank + 1]}, but input has shape "
      f"{inputs.shape}."
    )
  unbatched = inputs.ndim == unbatched_rank
  if unbatched:
    inputs = jnp.expand_dims(inputs, axis=0)
  channels = inputs.shape[module.channel_index]
  if channels % module.feature_group_count:
    raise ValueError(
      f"Inputs channels {channels} should be a multiple of "
      f"feature_group_count {module.feature_group_count}"
    )
  w_shape = tuple(module.kernel_shape) + (
    channels // module.feature_group_count,
    module.output_channels,
  )
  params = {"w": hk.get_parameter("w", w_shape, inputs.dtype)}
  if module.with_bias:
    if module.channel_index == -1:
      bias_shape = (module.output_channels,)
    else:
      bias_shape = (module.output_channels,) + (1,) * module.num_spatial_dims
    params["b"] = hk.get_parameter("b", bias_shape, inputs.dtype)

  def convolution(x, p):
    w = p["w"] if module.mask is None else p["w"] * module.mask
    out = jax.lax.conv_general_dilated(
      x,
      w,
      window_strides=module.stride,
      padding=module.padding,
      lhs_dilation=module.lhs_dilation,
      rhs_dilation=module.kernel_dilation,
      dimension_numbers=module.dimension_numbers,
      feature_group_count=module.feature_group_count,
      precision=precision,
    )
    if "b" in p:
      out = out + jnp.broadcast_to(p["b"], out.shape)
    return out

  out = _apply(module, convolution, inputs, params, compute_dtype)
  return jnp.squeeze(out, axis=0) if unbatched else out


def _abs_axes(axis, ndim: int) -> tuple[int, ...]:
  if isinstance(axis, slice):
    return tuple(range(ndim)[axis])
  if isinstance(axis, int):
    axis = (axis,)
  return tuple(sorted({a % ndim for a in axis}))


def _param_shape(param_axis, inputs) -> tuple[int, ...]:
  param_axis = _abs_axes(param_axis, inputs.ndim)
  if param_axis == (inputs.ndim - 1,):
    return tuple(inputs.shape[-1:])
  return tuple(
    inputs.shape[i] if i in param_axis else 1 for i in range(inputs.ndim)
  )


def _broadcast(a, shape):
  if jax.config.jax_numpy_rank_promotion != "allow":
    return jnp.broadcast_to(a, shape)
  return a


def layer_norm(module: hk.LayerNorm, original, inputs, scale=None, offset=None):
  """``hk.LayerNorm.__call__``; its scale and offset immediate in a step.

  The statistics are computed outside the immediate primitive, which is
  ``(scale * rsqrt(var + eps)) * (x - mean) + offset``: Haiku's own
  arithmetic, in Haiku's order.
  """
  if not _stepping() or not (module.create_scale or module.create_offset):
    return original(inputs, scale, offset)
  inputs = jnp.asarray(inputs)
  if module.create_scale and scale is not None:
    raise ValueError("Cannot pass `scale` at call time if `create_scale=True`.")
  if module.create_offset and offset is not None:
    raise ValueError(
      "Cannot pass `offset` at call time if `create_offset=True`."
    )
  axis = _abs_axes(module.axis, inputs.ndim)
  mean = jnp.mean(inputs, axis=axis, keepdims=True)
  if module.use_fast_variance:
    mean_of_squares = jnp.mean(jnp.square(inputs), axis=axis, keepdims=True)
    variance = mean_of_squares - jnp.square(mean)
  else:
    variance = jnp.var(inputs, axis=axis, keepdims=True)
  param_shape = _param_shape(module.param_axis, inputs)
  params, x = {}, {}
  if module.create_scale:
    params["scale"] = hk.get_parameter("scale", param_shape, inputs.dtype)
  elif scale is not None:
    x["scale"] = scale  # A call-time scale keeps its gradient, through x.
  if module.create_offset:
    params["offset"] = hk.get_parameter("offset", param_shape, inputs.dtype)
  elif offset is not None:
    x["offset"] = offset
  eps = jax.lax.convert_element_type(module.eps, variance.dtype)
  x["rsqrt"] = jax.lax.rsqrt(variance + eps)
  x["centred"] = inputs - _broadcast(mean, inputs.shape)
  one, zero = np.array(1.0, inputs.dtype), np.array(0.0, inputs.dtype)

  def affine(x, p):
    shape = x["centred"].shape
    s = _broadcast(p.get("scale", x.get("scale", one)), shape)
    o = _broadcast(p.get("offset", x.get("offset", zero)), shape)
    return (s * x["rsqrt"]) * x["centred"] + o

  return _apply(module, affine, x, params)


def rms_norm(module: hk.RMSNorm, original, inputs):
  """``hk.RMSNorm.__call__``; its scale immediate in a step."""
  if not _stepping() or not module.create_scale:
    return original(inputs)
  inputs = jnp.asarray(inputs)
  axis = _abs_axes(module.axis, inputs.ndim)
  params = {
    "scale": hk.get_parameter(
      "scale", _param_shape(module.param_axis, inputs), inputs.dtype
    )
  }
  mean_squared = jnp.mean(jnp.square(inputs), axis=axis, keepdims=True)
  mean_squared = jnp.broadcast_to(mean_squared, inputs.shape)
  x = {"inputs": inputs, "rsqrt": jax.lax.rsqrt(mean_squared + module.eps)}

  def scaled(x, p):
    return (
      x["inputs"] * jnp.broadcast_to(p["scale"], x["inputs"].shape) * x["rsqrt"]
    )

  return _apply(module, scaled, x, params)


def embed(
  module: hk.Embed,
  original,
  ids,
  lookup_style=None,
  precision=None,
  *,
  compute_dtype=None,
):
  """``hk.Embed.__call__``, immediate in a step."""
  if _original(compute_dtype):
    return original(ids, lookup_style, precision)
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(
      "hk.Embed's __call__ method must take an array of integer dtype but "
      f"was called with an array of {ids.dtype}"
    )
  style = lookup_style or module.lookup_style
  if isinstance(style, str):
    style = getattr(hk.EmbedLookupStyle, style.upper())
  params = {"embeddings": module.embeddings}
  if style == hk.EmbedLookupStyle.ARRAY_INDEX:

    def lookup(i, p):
      return jnp.asarray(p["embeddings"])[(i,)]
  elif style == hk.EmbedLookupStyle.ONE_HOT:
    precision = module.precision if precision is None else precision

    def lookup(i, p):
      one_hot = jax.nn.one_hot(i, module.vocab_size)
      return jnp.dot(one_hot, p["embeddings"], precision=precision)
  else:
    raise NotImplementedError(f"{style} is not supported by hk.Embed.")
  return _apply(module, lookup, ids, params, compute_dtype)


# Those that compute in ``immediate(compute_dtype=...)``: the matrix
# products. Normalisations keep their inputs' dtype (float32 in usual mixed
# precision practice).
CASTING = (hk.Linear, hk.ConvND, hk.Embed)

# The Haiku class that defines each supported ``__call__``, and ours for it.
IMPLEMENTATIONS = {
  hk.Linear: linear,
  hk.ConvND: conv,
  hk.LayerNorm: layer_norm,
  hk.RMSNorm: rms_norm,
  hk.Embed: embed,
}


class Linear(hk.Linear):
  """``hk.Linear`` whose weights update immediately in ``value_and_grad``.

  Same constructor, parameter names, shapes, dtypes and initialisers as
  ``hk.Linear``: checkpoints move between the two unchanged.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import immgrad.haiku
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda x: immgrad.haiku.Linear(2)(x)))
    >>> g = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(2)(x)))
    >>> x = jnp.ones((1, 3))
    >>> key = jax.random.PRNGKey(0)
    >>> jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
    ...              f.init(key, x), g.init(key, x))
    {'linear': {'b': True, 'w': True}}
  """

  def __call__(self, inputs, *, precision=None):
    return linear(self, super().__call__, inputs, precision=precision)


class ConvND(hk.ConvND):
  """``hk.ConvND`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return conv(self, super().__call__, inputs, precision=precision)


class Conv1D(hk.Conv1D):
  """``hk.Conv1D`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return conv(self, super().__call__, inputs, precision=precision)


class Conv2D(hk.Conv2D):
  """``hk.Conv2D`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return conv(self, super().__call__, inputs, precision=precision)


class Conv3D(hk.Conv3D):
  """``hk.Conv3D`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return conv(self, super().__call__, inputs, precision=precision)


class LayerNorm(hk.LayerNorm):
  """``hk.LayerNorm`` whose scale and offset update immediately."""

  def __call__(self, inputs, scale=None, offset=None):
    return layer_norm(self, super().__call__, inputs, scale, offset)


class RMSNorm(hk.RMSNorm):
  """``hk.RMSNorm`` whose scale updates immediately."""

  def __call__(self, inputs):
    return rms_norm(self, super().__call__, inputs)


class Embed(hk.Embed):
  """``hk.Embed`` whose embeddings update immediately."""

  def __call__(self, ids, lookup_style=None, precision=None):
    return embed(self, super().__call__, ids, lookup_style, precision)
