"""Flax's weight-carrying modules (NNX and Linen), as immediate layers.

Each function here computes one Flax module's ``__call__`` inside
``immgrad.value_and_grad``, with the module's parameter arrays, exactly the
objects in the params tree, going through :func:`immgrad.immediate_layer`.
It is Flax's own arithmetic, in Flax's order, so that ``mode="current"``
is plain training: dtype promotion (the module's ``promote_dtype``),
``precision``, ``preferred_element_type``, the module's ``dot_general``,
``einsum_op`` or ``conv_general_dilated``, ``use_bias``, masks, padding
modes and ``feature_group_count``. What is not a parameter (input padding,
a normalisation's statistics) is computed outside the immediate primitive,
so ``mode="updated"`` costs no extra FLOPs. An option these functions do not
reproduce is refused with a ``ValueError`` rather than computed
differently.

Each function is called as ``f(module, original, *args, **kwargs)``, with
the call's arguments and ``original``, the module's own method (bound), for
what has no parameter to step (a ``LayerNorm`` without scale or bias).
``flax_immediate.py`` calls them only inside a step.

Private Flax helpers used (no public equivalent): the normalisations'
``_compute_stats`` and ``_canonicalize_axes`` (``flax.linen.normalization``,
``flax.nnx.nn.normalization``) and ``nnx.Einsum``'s ``_einsum_str_check``
and ``_infer_broadcasted_bias_shape``. ``tests/test_flax.py`` pins each
module bitwise against Flax (flax 0.12.8); a change there fails it.
"""
# pylint: disable=protected-access  # The Flax helpers named above.

from flax import linen as nn
from flax import nnx
from flax.core import meta
from flax.linen import dtypes as linen_dtypes
from flax.linen import linear as linen_linear
from flax.linen import normalization as linen_norm
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn import normalization as nnx_norm
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from immgrad._src import layer as layer_lib
from immgrad._src import reparam

_SUSPECTS = {
  "nn": "made by a wrapper or transform such as nn.WeightNorm, "
  "nn.SpectralNorm or nn.map_variables, or by a cast",
  "nnx": "made by a wrapper such as nnx.WeightNorm or nnx.SpectralNorm, by "
  "a property or by a cast",
}


def base_class(module) -> tuple[type, str]:
  """The supported Flax class ``module`` is one of, and its public name."""
  supported = NNX if isinstance(module, nnx.Module) else LINEN_CLASSES
  base = next(c for c in type(module).__mro__ if c in supported)
  return base, f"{'nnx' if base in NNX else 'nn'}.{base.__name__}"


def _apply(module, fun, x, params):
  """``fun(x, params)`` as an immediate layer named after ``module``.

  Refuses first if ``params`` holds an array computed from the params tree
  (``reparam.py``): the module's weights are reparametrised.
  """
  base, base_name = base_class(module)
  culprit = base_name
  if type(module) is not base:
    culprit = f"{base_name} subclass {type(module).__name__}"
  if isinstance(module, nnx.Module):
    name = _nnx_name(module)
  else:
    name = linen_name(module)
    culprit = f"{culprit} {name!r}"
  reparam.check_parameters(
    "immgrad.flax.immediate",
    culprit,
    base_name,
    params,
    _SUSPECTS[base_name.split(".")[0]],
  )
  return layer_lib.immediate_layer(fun, name=name)(x, params)


def _refuse(name: str, option: str, why: str):
  raise ValueError(
    f"immgrad.flax.immediate: {name} was called with {option}, which it "
    f"cannot reproduce bit for bit ({why}). Leave that module out of "
    "`modules=`, so that it keeps ordinary gradients, or drop the option."
  )


def _bias(y, bias, shape):
  return y if bias is None else y + jnp.reshape(bias, shape)


# -- NNX ---------------------------------------------------------------------


def _nnx_name(module) -> str:
  return f"nnx.{type(module).__name__}"


def _nnx_params(module, *names) -> dict:
  """The arrays of ``module``'s Variables ``names`` (None ones left out).

  ``variable[...]`` is how the module reads them: the stored array itself.
  """
  return {
    name: getattr(module, name)[...]
    for name in names
    if getattr(module, name) is not None
  }


def _nnx_dot_kwargs(module, out_sharding) -> dict:
  kwargs = {"out_sharding": out_sharding}
  if module.preferred_element_type is not None:
    kwargs["preferred_element_type"] = module.preferred_element_type
  return kwargs


def nnx_linear(module: nnx.Linear, original, inputs, out_sharding=None):
  """``nnx.Linear.__call__``."""
  del original
  kwargs = _nnx_dot_kwargs(module, out_sharding)

  def affine(x, p):
    x, kernel, bias = module.promote_dtype(
      (x, p["kernel"], p.get("bias")), dtype=module.dtype
    )
    y = module.dot_general(
      x,
      kernel,
      (((x.ndim - 1,), (0,)), ((), ())),
      precision=module.precision,
      **kwargs,
    )
    return _bias(y, bias, (1,) * (y.ndim - 1) + (-1,))

  return _apply(module, affine, inputs, _nnx_params(module, "kernel", "bias"))


def _normalize_axes(axes, ndim: int) -> tuple[int, ...]:
  return tuple(sorted(a if a >= 0 else ndim + a for a in axes))


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def nnx_linear_general(
  module: nnx.LinearGeneral, original, inputs, out_sharding=None
):
  """``nnx.LinearGeneral.__call__`` (the projections of attention)."""
  del original
  inputs = jnp.asarray(inputs)
  ndim = inputs.ndim
  axis = _normalize_axes(module.axis, ndim)
  batch_axis = _normalize_axes(tuple(module.batch_axis.keys()), ndim)
  n_batch, n_axis = len(batch_axis), len(axis)
  expanded_batch_shape = tuple(
    inputs.shape[a] if a in batch_axis else 1
    for a in range(ndim)
    if a not in axis
  )
  dot_general = _operation(module, "dot_general", lax.dot_general)
  numbers = (
    (axis, tuple(range(n_batch, n_batch + n_axis))),
    (batch_axis, tuple(range(n_batch))),
  )
  kwargs = _nnx_dot_kwargs(module, out_sharding)

  def affine(x, p):
    x, kernel, bias = module.promote_dtype(
      (x, p["kernel"], p.get("bias")), dtype=module.dtype
    )
    y = dot_general(x, kernel, numbers, precision=module.precision, **kwargs)
    return _bias(y, bias, (*expanded_batch_shape, *module.out_features))

  return _apply(module, affine, inputs, _nnx_params(module, "kernel", "bias"))


def nnx_einsum(
  module: nnx.Einsum, original, inputs, einsum_str=None, out_sharding=None
):
  """``nnx.Einsum.__call__``."""
  del original
  einsum_str = einsum_str if einsum_str is not None else module.einsum_str
  if einsum_str is None:
    raise ValueError(
      "No `einsum_str` argument was provided to Einsum as "
      "either a __call__ argument, or class attribute."
    )
  einsum_str = einsum_str.replace(" ", "")
  module._einsum_str_check(einsum_str)
  kwargs = _nnx_dot_kwargs(module, out_sharding)

  def contract(x, p):
    x, kernel, bias = module.promote_dtype(
      (x, p["kernel"], p.get("bias")), dtype=module.dtype
    )
    y = module.einsum_op(
      einsum_str, x, kernel, precision=module.precision, **kwargs
    )
    if bias is None:
      return y
    infer_shape = module._infer_broadcasted_bias_shape
    return _bias(y, bias, infer_shape(einsum_str, x, kernel))

  return _apply(module, contract, inputs, _nnx_params(module, "kernel", "bias"))


def _conv_setup(module, inputs):
  """Flax's input preparation for ``Conv``: flatten, pad, dimension numbers.

  Returns the prepared inputs, the convolution's arguments after the two
  operands, and the input batch shape to restore (None for one batch axis).
  """
  inputs = jnp.asarray(inputs)
  kernel_size = _as_tuple(module.kernel_size)
  n = len(kernel_size)

  def broadcast(value):
    value = 1 if value is None else value
    return (value,) * n if isinstance(value, int) else tuple(value)

  batch_dims = inputs.ndim - (n + 1)
  batch_shape = None
  if batch_dims != 1:
    batch_shape = inputs.shape[:batch_dims]
    inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
  strides = broadcast(module.strides)
  lhs_dilation = broadcast(module.input_dilation)
  rhs_dilation = broadcast(module.kernel_dilation)
  padding = linen_linear.canonicalize_padding(module.padding, n)
  if padding in ("CIRCULAR", "REFLECT"):
    dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, rhs_dilation)]
    pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
    mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
    inputs, padding = jnp.pad(inputs, pads, mode=mode), "VALID"
  elif padding == "CAUSAL":
    if n != 1:
      raise ValueError(
        "Causal padding is only implemented for 1D convolutions."
      )
    left = rhs_dilation[0] * (kernel_size[0] - 1)
    inputs, padding = jnp.pad(inputs, [(0, 0), (left, 0), (0, 0)]), "VALID"
  ndim = inputs.ndim
  lhs_spec = (0, ndim - 1) + tuple(range(1, ndim - 1))
  rhs_spec = (ndim - 1, ndim - 2) + tuple(range(ndim - 2))
  options = dict(
    lhs_dilation=lhs_dilation,
    rhs_dilation=rhs_dilation,
    dimension_numbers=lax.ConvDimensionNumbers(lhs_spec, rhs_spec, lhs_spec),
    feature_group_count=module.feature_group_count,
    precision=module.precision,
  )
  return inputs, (strides, padding), options, batch_shape


def _conv(module, conv_fn, inputs, params, unbox, promote, extra):
  """A ``Conv`` call of either API, ``promote`` its dtype promotion."""
  inputs, positional, options, batch_shape = _conv_setup(module, inputs)
  options.update(extra)
  if module.mask is not None and module.mask.shape != params["kernel"].shape:
    raise ValueError(
      "Mask needs to have the same shape as weights. Shapes are: "
      f"{module.mask.shape}, {params['kernel'].shape}"
    )

  def convolution(x, p):
    p = unbox(p)
    kernel = p["kernel"]
    if module.mask is not None:
      kernel = kernel * module.mask
    x, kernel, bias = promote(x, kernel, p.get("bias"))
    y = conv_fn(x, kernel, *positional, **options)
    if bias is None:
      return y
    return _bias(y, bias, (1,) * (y.ndim - bias.ndim) + bias.shape)

  y = _apply(module, convolution, inputs, params)
  return y if batch_shape is None else jnp.reshape(y, batch_shape + y.shape[1:])


def nnx_conv(module: nnx.Conv, original, inputs, out_sharding=None):
  """``nnx.Conv.__call__``."""
  del original

  def promote(*args):
    return module.promote_dtype(args, dtype=module.dtype)

  return _conv(
    module,
    module.conv_general_dilated,
    inputs,
    _nnx_params(module, "kernel", "bias"),
    lambda p: p,
    promote,
    _nnx_dot_kwargs(module, out_sharding),
  )


def _scale_and_offset(
  x, statistics, params, dtype, feature_shape, param_dtype=None
):
  """Flax's ``_normalize`` after the statistics, both APIs (``x`` is
  ``{"y": x - mean, "mul": rsqrt(var + eps)}``): ``mul *= scale``, ``y *=
  mul``, ``y += bias``, then the cast to the output dtype.
  """
  y, mul = x["y"], x["mul"]
  args = list(statistics)
  if "scale" in params:
    scale = params["scale"].reshape(feature_shape)
    if param_dtype is not None:
      scale = jnp.asarray(scale, param_dtype)
    mul = mul * scale
    args.append(np.zeros((), scale.dtype))
  y = y * mul
  if "bias" in params:
    bias = params["bias"].reshape(feature_shape)
    if param_dtype is not None:
      bias = jnp.asarray(bias, param_dtype)
    y = y + bias
    args.append(np.zeros((), bias.dtype))
  return jnp.asarray(y, linen_dtypes.canonicalize_dtype(*args, dtype=dtype))


def _nnx_norm(module, original, x, mask, names, use_mean):
  params = _nnx_params(module, *names)
  if not params:
    return original(x, mask=mask)
  if module.promote_dtype is not nnx_dtypes.promote_dtype:
    _refuse(
      _nnx_name(module),
      "a custom promote_dtype",
      "NNX promotes the input together with the scale and bias before "
      "the statistics, and only the default promotion can be split "
      "from them",
    )
  x = jnp.asarray(x)
  # NNX promotes x together with the parameters: their dtypes, not their
  # values, decide the statistics' dtype; the parameters are cast inside.
  dtype = nnx_dtypes.canonicalize_dtype(x, *params.values(), dtype=module.dtype)
  x = jnp.asarray(x, dtype)
  mean, var = nnx_norm._compute_stats(
    x,
    module.reduction_axes,
    module.dtype,
    module.axis_name,
    module.axis_index_groups,
    use_mean=use_mean,
    use_fast_variance=module.use_fast_variance,
    mask=mask,
  )
  axes = nnx_norm._canonicalize_axes
  stats_shape = list(x.shape)
  for a in axes(x.ndim, module.reduction_axes):
    stats_shape[a] = 1
  feature_shape = [1] * x.ndim
  for a in axes(x.ndim, module.feature_axes):
    feature_shape[a] = x.shape[a]
  inputs = {
    "y": x - mean.reshape(stats_shape),
    "mul": lax.rsqrt(var.reshape(stats_shape) + module.epsilon),
  }

  def scale_and_offset(x, p):
    p = {k: jnp.asarray(v, dtype) for k, v in p.items()}
    return _scale_and_offset(
      x, [np.zeros((), dtype)], p, module.dtype, feature_shape
    )

  return _apply(module, scale_and_offset, inputs, params)


def nnx_layer_norm(module: nnx.LayerNorm, original, x, *, mask=None):
  """``nnx.LayerNorm.__call__``; its scale and bias immediate."""
  return _nnx_norm(module, original, x, mask, ("scale", "bias"), True)


def nnx_rms_norm(module: nnx.RMSNorm, original, x, mask=None):
  """``nnx.RMSNorm.__call__``; its scale immediate."""
  return _nnx_norm(module, original, x, mask, ("scale",), False)


def _check_ids(ids):
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError("Input type must be an integer or unsigned integer.")
  return ids


def _lookup(module, promote, out_sharding=None):
  def lookup(ids, p):
    (embedding,) = promote(p["embedding"])
    if module.num_embeddings == 1:
      return jnp.broadcast_to(embedding, ids.shape + (module.features,))
    if out_sharding is not None:  # As nnx.Embed does: jnp.take has none.
      take = lambda e, i: jnp.take(e, i, axis=0)
      return jax.sharding.auto_axes(take, out_sharding=out_sharding)(
        embedding, ids
      )
    return jnp.take(embedding, ids, axis=0)

  return lookup


def nnx_embed(module: nnx.Embed, original, inputs, out_sharding=None):
  """``nnx.Embed.__call__`` (``attend`` stays ordinary)."""
  del original
  promote = lambda e: module.promote_dtype(
    (e,), dtype=module.dtype, inexact=False
  )
  return _apply(
    module,
    _lookup(module, promote, out_sharding),
    _check_ids(inputs),
    _nnx_params(module, "embedding"),
  )


# The NNX classes that define each supported ``__call__``, and ours for it.
NNX = {
  nnx.Linear: nnx_linear,
  nnx.LinearGeneral: nnx_linear_general,
  nnx.Einsum: nnx_einsum,
  nnx.Conv: nnx_conv,
  nnx.LayerNorm: nnx_layer_norm,
  nnx.RMSNorm: nnx_rms_norm,
  nnx.Embed: nnx_embed,
}


# -- Linen -------------------------------------------------------------------


def linen_name(module: nn.Module) -> str:
  return "/".join(module.path) or type(module).__name__


def _linen_params(module: nn.Module, *names):
  """``module``'s params ``names`` as the step sees them, and an unboxing.

  Returns ``(params, unbox)``: ``params`` maps each name to the array in the
  params tree itself (inside an ``nn.Partitioned`` or other metadata box,
  the box's array), and ``unbox(p)`` does, inside the layer, what
  ``Module.param`` does to it (``nn.Partitioned`` adds its sharding
  constraint there).
  """
  params, boxes = {}, {}
  for name in names:
    value = module.get_variable("params", name)
    if value is None:
      return None, None  # Not there: let Flax raise its own error.
    if isinstance(value, meta.AxisMetadata):
      leaves, treedef = jax.tree.flatten(value)
      if len(leaves) != 1:
        raise ValueError(
          f"immgrad.flax.immediate: parameter {name!r} of "
          f"{linen_name(module)} is a {type(value).__name__} box holding "
          f"{len(leaves)} arrays; only boxes of one array (such as "
          "nn.Partitioned) can be stepped. Unbox it "
          "(flax.core.meta.unbox) before the step."
        )
      value, boxes[name] = leaves[0], treedef
    params[name] = value

  def unbox(p):
    return {
      name: meta.unbox(jax.tree.unflatten(boxes[name], [v]))
      if name in boxes
      else v
      for name, v in p.items()
    }

  return params, unbox


def _operation(module, name: str, default):
  """The module's ``name`` operation: its ``name_cls()``, its ``name``, or
  ``default``, in the order Flax's modules choose.
  """
  if getattr(module, f"{name}_cls") is not None:
    return getattr(module, f"{name}_cls")()
  if getattr(module, name) is not None:
    return getattr(module, name)
  return default


def linen_dense(module: nn.Dense, original, inputs):
  """``nn.Dense.__call__``."""
  params, unbox = _linen_params(
    module, "kernel", *(("bias",) if module.use_bias else ())
  )
  if params is None:
    return original(inputs)
  dot_general = _operation(module, "dot_general", lax.dot_general)

  def affine(x, p):
    p = unbox(p)
    x, kernel, bias = module.promote_dtype(
      x, p["kernel"], p.get("bias"), dtype=module.dtype
    )
    y = dot_general(
      x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=module.precision
    )
    return _bias(y, bias, (1,) * (y.ndim - 1) + (-1,))

  return _apply(module, affine, inputs, params)


def linen_dense_general(module: nn.DenseGeneral, original, inputs):
  """``nn.DenseGeneral.__call__``."""
  params, unbox = _linen_params(
    module, "kernel", *(("bias",) if module.use_bias else ())
  )
  if params is None:
    return original(inputs)
  inputs = jnp.asarray(inputs)
  ndim = inputs.ndim
  features = _as_tuple(module.features)
  axis = _normalize_axes(_as_tuple(module.axis), ndim)
  batch_dims = _normalize_axes(_as_tuple(module.batch_dims), ndim)
  n_batch, n_axis = len(batch_dims), len(axis)
  expanded_batch_shape = tuple(
    inputs.shape[a] if a in batch_dims else 1
    for a in range(ndim)
    if a not in axis
  )
  numbers = (
    (axis, tuple(range(n_batch, n_batch + n_axis))),
    (batch_dims, tuple(range(n_batch))),
  )
  dot_general = _operation(module, "dot_general", lax.dot_general)

  def affine(x, p):
    p = unbox(p)
    x, kernel, bias = module.promote_dtype(
      x, p["kernel"], p.get("bias"), dtype=module.dtype
    )
    y = dot_general(x, kernel, numbers, precision=module.precision)
    return _bias(y, bias, expanded_batch_shape + features)

  return _apply(module, affine, inputs, params)


def linen_conv(module: nn.Conv, original, inputs):
  """``nn.Conv.__call__`` (Linen's ``_Conv``, shared weights)."""
  params, unbox = _linen_params(
    module, "kernel", *(("bias",) if module.use_bias else ())
  )
  if params is None:
    return original(inputs)
  conv_fn = _operation(module, "conv_general_dilated", lax.conv_general_dilated)

  def promote(*args):
    return module.promote_dtype(*args, dtype=module.dtype)

  return _conv(module, conv_fn, inputs, params, unbox, promote, {})


def _linen_norm(module, original, x, mask, use_mean, use_bias):
  names = (("scale",) if module.use_scale else ()) + (
    ("bias",) if use_bias else ()
  )
  params, unbox = _linen_params(module, *names)
  if not params:
    return original(x, mask=mask)
  x = jnp.asarray(x)
  mean, var = linen_norm._compute_stats(
    x,
    module.reduction_axes,
    module.dtype,
    module.axis_name,
    module.axis_index_groups,
    use_mean=use_mean,
    use_fast_variance=module.use_fast_variance,
    mask=mask,
    force_float32_reductions=module.force_float32_reductions,
  )
  axes = linen_norm._canonicalize_axes
  reduction_axes = axes(x.ndim, module.reduction_axes)
  feature_shape = [1] * x.ndim
  for a in axes(x.ndim, module.feature_axes):
    feature_shape[a] = x.shape[a]
  inputs = {
    "y": x - jnp.expand_dims(mean, reduction_axes),
    "mul": lax.rsqrt(jnp.expand_dims(var, reduction_axes) + module.epsilon),
  }
  param_dtype = (
    None if module.force_float32_reductions else (module.param_dtype)
  )
  x_dtype = x.dtype

  def scale_and_offset(x, p):
    return _scale_and_offset(
      x,
      [np.zeros((), x_dtype)],
      unbox(p),
      module.dtype,
      feature_shape,
      param_dtype,
    )

  return _apply(module, scale_and_offset, inputs, params)


def linen_layer_norm(module: nn.LayerNorm, original, x, *, mask=None):
  """``nn.LayerNorm.__call__``; its scale and bias immediate."""
  return _linen_norm(module, original, x, mask, True, module.use_bias)


def linen_rms_norm(module: nn.RMSNorm, original, x, *, mask=None):
  """``nn.RMSNorm.__call__``; its scale immediate."""
  return _linen_norm(module, original, x, mask, False, False)


def linen_embed(module: nn.Embed, original, inputs):
  """``nn.Embed.__call__`` (``attend`` stays ordinary)."""
  params, unbox = _linen_params(module, "embedding")
  if params is None:
    return original(inputs)

  def promote(embedding):
    embedding = unbox({"embedding": embedding})["embedding"]
    return module.promote_dtype(embedding, dtype=module.dtype, inexact=False)

  return _apply(module, _lookup(module, promote), _check_ids(inputs), params)


def _undecorated(method):
  return method.__wrapped__  # What Linen's method wrapper wraps.


# The supported Linen classes.
LINEN_CLASSES = (
  nn.Dense,
  nn.DenseGeneral,
  nn.Conv,
  nn.LayerNorm,
  nn.RMSNorm,
  nn.Embed,
)

# The undecorated Linen ``__call__`` of each supported module, and ours for
# it. ``nn.Conv.__call__`` is ``_Conv``'s, shared with ``nn.ConvLocal``,
# which is no ``nn.Conv`` and so never chosen.
LINEN = {
  _undecorated(nn.Dense.__call__): linen_dense,
  _undecorated(nn.DenseGeneral.__call__): linen_dense_general,
  _undecorated(nn.Conv.__call__): linen_conv,
  _undecorated(nn.LayerNorm.__call__): linen_layer_norm,
  _undecorated(nn.RMSNorm.__call__): linen_rms_norm,
  _undecorated(nn.Embed.__call__): linen_embed,
}
