"""Averaging over a data-parallel axis, the same under pmap and shard_map.

Under ``shard_map(check_vma=True)`` the gradient of an axis-invariant weight
comes back already summed over the axis; these helpers keep an immediate
layer's gradient local and average every gradient once, a layer's leaves in
one ``lax.pmean`` (in ``reduce_dtype`` if one is set).
"""

from typing import Any, Hashable, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from immgrad._src import compat

AxisName = Hashable | Sequence[Hashable] | None


def _names(axis_name: AxisName) -> tuple:
  if axis_name is None:
    return ()
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def _varying(x: Any) -> frozenset:
  return compat.varying_axes(x)


def check_bound(axis_name: AxisName, front: str) -> None:
  """Raises a clear error if ``axis_name`` is not bound where it is used
  (``front``: the function the user called, for the message).
  """
  for name in _names(axis_name):
    try:
      lax.axis_index(name)
    except NameError as e:
      raise ValueError(
        f"{front}(axis_name={axis_name!r}): axis {name!r} "
        "is not bound. Call the training step inside jax.pmap or "
        "jax.shard_map over that axis, or pass axis_name=None (for "
        "example under plain jit over a sharded batch)."
      ) from e


def tracks_vma(axis_name: AxisName) -> bool:
  """Whether JAX tracks variance over ``axis_name`` (shard_map check_vma)."""
  return any(
    name in _varying(lax.axis_index(name)) for name in _names(axis_name)
  )


def local(tree: Any, axis_name: AxisName) -> Any:
  """Casts axis-invariant leaves to varying, so their gradients stay local."""
  names = _names(axis_name)
  if not names or not tracks_vma(axis_name):
    return tree

  def cast(x):
    missing = tuple(n for n in names if n not in _varying(x))
    return compat.to_varying(x, missing) if missing else x

  return jax.tree.map(cast, tree)


def reduce_dtype_of(reduce_dtype: Any, axis_name: AxisName, front: str) -> Any:
  """``reduce_dtype`` as a dtype (or None), checked (``front``: the
  function the user called, for the message).
  """
  if reduce_dtype is None:
    return None
  try:
    dtype = jnp.dtype(reduce_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
      f"{front}(reduce_dtype=...): expected a floating dtype "
      f"such as jnp.bfloat16 or jnp.float32, got {reduce_dtype!r}. It is "
      "the dtype gradients are averaged over axis_name in; pass None to "
      "average them in their own dtype."
    )
  if axis_name is None:
    raise ValueError(
      f"{front}(reduce_dtype={dtype.name}) needs an "
      "axis_name: it sets the dtype of the average over that axis, and "
      "with axis_name=None immgrad averages nothing (under plain jit over "
      "a sharded batch XLA reduces in the gradients' own dtype). Pass the "
      "pmap/shard_map axis, or leave reduce_dtype=None."
    )
  return dtype


def mean(tree: Any, axis_name: AxisName, dtype: Any = None) -> Any:
  """Averages local values over ``axis_name`` (identity when it is None).

  With ``dtype``, each leaf is cast to it for the collective and back to
  its own dtype after. All leaves go through one ``lax.pmean``.
  """
  if axis_name is None:
    return tree
  if dtype is None:
    return lax.pmean(tree, axis_name)
  averaged = lax.pmean(jax.tree.map(lambda x: x.astype(dtype), tree), axis_name)
  return jax.tree.map(lambda m, x: m.astype(x.dtype), averaged, tree)


def mean_of_cotangent(
  cotangent: jax.Array, primal: jax.Array, axis_name: AxisName, dtype=None
) -> jax.Array:
  """The mean over ``axis_name`` of an ordinary parameter's gradient.

  Averaged in ``dtype`` where immgrad averages it; where JAX already summed
  it (see above), JAX did so in the gradient's own dtype.
  """
  names = _names(axis_name)
  summed = ()
  if names and tracks_vma(axis_name):
    # JAX already summed it over the axes the weight is invariant on.
    summed = tuple(n for n in names if n not in _varying(primal))
  for name in summed:
    cotangent = cotangent / lax.axis_size(name)
  rest = tuple(n for n in names if n not in summed)
  return mean(cotangent, rest, dtype) if rest else cotangent
