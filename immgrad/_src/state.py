"""Optimizer state on the cotangent channel.

An immediate layer returns its new optimizer state through the cotangent
slot of a state input. A float leaf travels as itself. An integer leaf (for
example optax's int32 ``count``) cannot: JAX gives integer inputs ``float0``
cotangents. It travels instead as two float32 numbers, the high and the low
16 bits of its 32-bit pattern, each an integer below 2**16 and therefore
exact in float32. Every value of int32, uint32 and narrower integer or bool
types survives the round trip bit for bit, so a step count is exact up to
int32's own limit, not float32's 2**24.

Example:
  >>> import jax.numpy as jnp
  >>> from immgrad._src import state
  >>> count = jnp.array(2**31 - 1, jnp.int32)
  >>> carried = state.encode(count)
  >>> carried.dtype, carried.shape
  (dtype('float32'), (2,))
  >>> int(state.decode(carried, count))
  2147483647
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_HALF = 16


def _check(leaf: jax.Array) -> None:
  dtype = jnp.result_type(leaf)
  if jnp.issubdtype(dtype, jnp.floating):
    return
  if (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_) and (
      np.dtype(dtype).itemsize <= 4):
    return
  raise TypeError(
      f"immgrad cannot carry an optimizer state leaf of dtype {dtype} "
      "through a backward rule: only float, bool and integer leaves of at "
      "most 32 bits are supported.")


def _encode_leaf(leaf: jax.Array) -> jax.Array:
  _check(leaf)
  if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
    return leaf
  bits = jnp.asarray(leaf).astype(jnp.int32).view(jnp.uint32)
  high = (bits >> _HALF).astype(jnp.float32)
  low = (bits & 0xFFFF).astype(jnp.float32)
  return jnp.stack([high, low])


def _decode_leaf(carried: jax.Array, like: Any) -> jax.Array:
  dtype = jnp.result_type(like)
  if jnp.issubdtype(dtype, jnp.floating):
    return carried
  high = carried[0].astype(jnp.uint32) << _HALF
  low = carried[1].astype(jnp.uint32)
  return (high | low).view(jnp.int32).astype(dtype)


def encode(tree: Any) -> Any:
  """Returns ``tree`` with every integer or bool leaf made exact float32."""
  return jax.tree.map(_encode_leaf, tree)


def decode(carried: Any, like: Any) -> Any:
  """Inverts :func:`encode`; ``like`` gives the original dtypes."""
  return jax.tree.map(_decode_leaf, carried, like)
