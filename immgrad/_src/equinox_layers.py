"""Equinox's weight-carrying modules, as immediate layers.

Each function here computes one Equinox module's ``__call__`` with the
module's own parameter arrays (``module.weight``, ``module.bias``, passed
unchanged, so that the step finds them by identity) going through
:func:`immgrad.immediate_layer`, and reproduces Equinox's arithmetic, in
Equinox's order and dtypes, bit for bit. What is not a parameter (padding,
a normalisation's statistics) stays outside the immediate primitive, so
``mode="updated"`` costs no extra FLOPs.

Equinox layers are per-example: a model is called under ``jax.vmap``, and
so is each layer here; ``immediate_layer`` then steps the weights once, on
the whole batch's gradient (``layer.py``).

``immgrad.equinox.immediate`` routes the calls here, and only inside a step;
``original`` is the module's own ``__call__``, used where nothing is to be
stepped (a normalisation without weight and bias).
"""

import functools

import equinox as eqx
import jax
from jax import lax
import jax.numpy as jnp

from immgrad._src import layer as layer_lib
from immgrad._src import reparam

_NO_STATE = object()  # A normalisation called without Equinox's ``state``.


def _apply(module: eqx.Module, fun, x, params):
  """``fun(x, params)`` as an immediate layer named after ``module``.

  Refuses first (``reparam.py``) a subclass overriding a method of the
  Equinox class (``eqx.nn.Conv``'s ``_nonzero_pad``, which ``conv`` does
  not call), or ``params`` holding an array computed from the params tree:
  a wrapper changed the module's weights.
  """
  base = next(c for c in type(module).__mro__ if c in IMPLEMENTATIONS)
  culprit = base_name = f"eqx.nn.{base.__name__}"
  reparam.check_overrides("immgrad.equinox.immediate", module, base, base_name)
  if type(module) is not base:
    culprit = f"{base_name} subclass {type(module).__name__}"
  reparam.check_parameters(
    "immgrad.equinox.immediate",
    culprit,
    base_name,
    params,
    "made by a wrapper such as eqx.nn.WeightNorm or eqx.nn.SpectralNorm, "
    "or by a cast",
  )
  name = f"{type(module).__name__} (Equinox)"
  return layer_lib.immediate_layer(fun, name=name)(x, params)


def _affine(x, p):
  y = p["weight"] @ x
  if "bias" in p:
    y = y + p["bias"]
  return y


def linear(module: eqx.nn.Linear, original, x, *, key=None):
  """``eqx.nn.Linear.__call__``, immediate."""
  del original, key
  if module.in_features == "scalar":
    if jnp.shape(x) != ():
      raise ValueError("x must have scalar shape")
    x = jnp.broadcast_to(x, (1,))
  params = {"weight": module.weight}
  if module.bias is not None:
    params["bias"] = module.bias
  y = _apply(module, _affine, x, params)
  if module.out_features == "scalar":
    y = jnp.squeeze(y)
  return y


def _pad(module: eqx.nn.Conv, x):
  """Equinox's padding for ``padding_mode`` other than ``"ZEROS"``."""
  if isinstance(module.padding, str):
    rhs_shape = tuple(
      d * (k - 1) + 1 for k, d in zip(module.kernel_size, module.dilation)
    )
    padding = lax.padtype_to_pads(
      x.shape[1:], rhs_shape, module.stride, module.padding
    )
  else:
    padding = list(module.padding)
  mode = {"REFLECT": "reflect", "REPLICATE": "edge", "CIRCULAR": "wrap"}[
    module.padding_mode
  ]
  return jnp.pad(x, [(0, 0)] + padding, mode)


def conv(module: eqx.nn.Conv, original, x, *, key=None):
  """``eqx.nn.Conv.__call__`` (``Conv1d``/``2d``/``3d``), immediate."""
  del original, key
  rank = module.num_spatial_dims + 1
  if x.ndim != rank:
    raise ValueError(
      f"Input to `Conv` needs to have rank {rank}, but input has shape "
      f"{x.shape}."
    )
  padding = module.padding
  if module.padding_mode != "ZEROS":
    x, padding = _pad(module, x), "VALID"
  params = {"weight": module.weight}
  if module.use_bias:
    params["bias"] = module.bias

  def convolution(x, p):
    y = lax.conv_general_dilated(
      lhs=jnp.expand_dims(x, axis=0),
      rhs=p["weight"],
      window_strides=module.stride,
      padding=padding,
      rhs_dilation=module.dilation,
      feature_group_count=module.groups,
    )
    y = jnp.squeeze(y, axis=0)
    if "bias" in p:
      y = y + p["bias"]
    return y

  return _apply(module, convolution, x, params)


def _scale_shift(dtype, out_dtype, normalised, p):
  """A normalisation's weight and bias, in Equinox's order and dtypes."""
  if "weight" in p:
    normalised = p["weight"].astype(dtype) * normalised
  if "bias" in p:
    normalised = normalised + p["bias"].astype(dtype)
  return normalised.astype(out_dtype)


def _normalise(module, original, x, state, statistics):
  """LayerNorm and RMSNorm: ``statistics(x)`` outside, the affine inside."""
  name = type(module).__name__
  if not (module.use_weight or module.use_bias):
    return original(x) if state is _NO_STATE else original(x, state)
  if x.shape != module.shape:
    raise ValueError(
      f"`{name}(shape)(x)` must satisfy the invariant `shape == x.shape`. "
      f"Received `shape={module.shape}` and `x.shape={x.shape}`. You might "
      "need to call it under `jax.vmap`."
    )
  out_dtype = x.dtype
  with jax.numpy_dtype_promotion("standard"):
    dtype = jnp.result_type(x.dtype, jnp.float32)
  normalised = statistics(x.astype(dtype))
  params = {}
  if module.use_weight:
    params["weight"] = module.weight
  if module.use_bias:
    params["bias"] = module.bias
  fun = functools.partial(_scale_shift, dtype, out_dtype)
  y = _apply(module, fun, normalised, params)
  return y if state is _NO_STATE else (y, state)


def layer_norm(
  module: eqx.nn.LayerNorm, original, x, state=_NO_STATE, *, key=None
):
  """``eqx.nn.LayerNorm.__call__``; its weight and bias immediate."""
  del key

  def statistics(x):
    mean = jnp.mean(x, keepdims=True)
    variance = jnp.maximum(0.0, jnp.var(x, keepdims=True))
    return (x - mean) * lax.rsqrt(variance + module.eps)

  return _normalise(module, original, x, state, statistics)


def rms_norm(module: eqx.nn.RMSNorm, original, x, state=_NO_STATE, *, key=None):
  """``eqx.nn.RMSNorm.__call__``; its weight and bias immediate."""
  del key

  def statistics(x):
    return lax.rsqrt(jnp.mean(x**2) + module.eps) * x

  return _normalise(module, original, x, state, statistics)


def _lookup(index, p):
  return p["weight"][index]


def embedding(module: eqx.nn.Embedding, original, x, *, key=None):
  """``eqx.nn.Embedding.__call__``, immediate."""
  del original, key
  if not (eqx.is_array_like(x) and jnp.shape(x) == ()):
    raise ValueError(
      "`eqx.nn.Embedding()(x)` should be called with a scalar index `x`. "
      "Use `jax.vmap` if you would like to index with multiple values."
    )
  return _apply(module, _lookup, x, {"weight": module.weight})


# The Equinox class that defines each supported ``__call__``, and ours for it.
IMPLEMENTATIONS = {
  eqx.nn.Linear: linear,
  eqx.nn.Conv: conv,
  eqx.nn.LayerNorm: layer_norm,
  eqx.nn.RMSNorm: rms_norm,
  eqx.nn.Embedding: embedding,
}
