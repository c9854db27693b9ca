"""Stepping a parameter, and writing the step in place.

An immediate parameter is stepped twice from the same values: in its
layer's backward rule (for ``dX`` in ``mode="updated"``, and to check the
step), and by the shim, which commits it once the whole step is known to be
finite. :func:`step_parameter` is that one computation.

Atomic commits write nothing until the step's single finiteness flag is
known, and then write in place, as plain training's update does. For an
unstacked parameter the shim runs the commit under a ``lax.cond``. A
stacked parameter (``immgrad.scan``) is one large leaf, whose update would
need a buffer as large as its gradient; :func:`commit_layers` instead writes
it layer by layer into the gradient's own buffer and the state's, in place.

The two computations are the same optax arithmetic, compiled twice: XLA may
fuse them differently (contract a multiply and an add into one fused
multiply-add in one of them), and then they differ by that rounding, about
an ulp of the weight.
``tests/test_commit.py`` measures them bit for bit equal for the rules and
models it runs.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from immgrad._src import stacked


@functools.partial(jax.jit, static_argnums=0)
def step_parameter(tx: optax.GradientTransformation, grad, state, weights):
  """One parameter's new weights and optimizer state under ``tx``.

  Jitted only so that JAX traces it once per shape: a model's many
  parameters of one shape share the trace (XLA inlines it).
  """
  updates, state = tx.update(grad, state, weights)
  return optax.apply_updates(weights, updates), state


def step_layers(tx, grad, state, weights, layer_axes: int, path: str):
  """:func:`step_parameter`, one layer at a time over ``layer_axes`` axes.

  A per-tensor rule (``immgrad.clip_by_layer_norm``) thus sees one layer
  of a stacked parameter, as it did in that layer's backward rule.
  """
  if not layer_axes:
    return step_parameter(tx, grad, state, weights)
  split = stacked.state_axes(tx, weights, state, path)
  return jax.vmap(
      lambda g, s, w: step_layers(tx, g, s, w, layer_axes - 1, path),
      in_axes=(0, split, 0), out_axes=(0, split))(grad, state, weights)


def landing(new: jax.Array, param: jax.Array) -> jax.Array:
  """The update that ``optax.apply_updates`` turns ``param`` into ``new`` by.

  ``-0.0`` where they are equal, so that ``param + update`` is ``param``
  bit for bit (``-0.0`` and infinities included).
  """
  return jnp.where(new == param, jnp.asarray(-0.0, param.dtype), new - param)


def commit_layers(tx, grad, state, weights, ok, layer_axes: int, path: str):
  """The update and new state of a stacked parameter, or none if not ``ok``.

  A loop over the layers, each layer's step under its own ``lax.cond``:
  layer ``i``'s update is written over its gradient slice and its new state
  over its old state slice, so no second buffer the size of the stack is
  made. Returns what :func:`landing` and :func:`step_layers` would, or
  ``-0.0`` updates and the old state where ``ok`` is false.
  """
  split = stacked.state_axes(tx, weights, state, path)
  state_leaves, state_def = jax.tree.flatten(state)
  axes = jax.tree.leaves(split, is_leaf=lambda a: a is None)

  def step(grad, state, weights):
    new, state = step_layers(tx, grad, state_def.unflatten(state), weights,
                             layer_axes - 1, path)
    return landing(new, weights), jax.tree.leaves(state)

  def keep(grad, state, weights):
    del grad
    return jnp.full_like(weights, -0.0), state

  def body(i, carry):
    grad, sliced = carry
    # A shared leaf is read from the original state: every layer steps it
    # from the same value.
    old = [s[i] if axis == 0 else first for s, first, axis in
           zip(sliced, state_leaves, axes)]
    update, new = lax.cond(ok, step, keep, grad[i], old, weights[i])
    sliced = [s.at[i].set(n) if axis == 0 else n
              for s, n, axis in zip(sliced, new, axes)]
    return grad.at[i].set(update), sliced

  updates, sliced = lax.fori_loop(0, jnp.shape(weights)[0], body,
                                  (grad, state_leaves))
  return updates, state_def.unflatten(sliced)


def all_finite(tree: Any) -> jax.Array:
  """Whether every float value in ``tree`` is finite, as one bool.

  With as few reductions as the shapes allow: arrays of one shape (a
  weight, its gradient, its moments) are checked together, and so are
  those whose shape broadcasts to a larger one's (a bias to its weight).
  XLA compiles each reduction on its own, and a reduction per array made
  the check most of an atomic step's compile time.
  """
  groups = {}  # Shape -> the elementwise "is finite" of its arrays.
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      shape = jnp.shape(x)
      finite = jnp.isfinite(x)
      groups[shape] = finite if shape not in groups else (
          groups[shape] & finite)
  checks = []
  for shape in sorted(groups, key=math.prod, reverse=True):
    if shape not in groups:  # Merged into a larger shape's check already.
      continue
    finite = groups.pop(shape)
    for small in [s for s in groups if _broadcasts(s, shape)]:
      finite = finite & groups.pop(small)
    checks.append(jnp.all(finite))
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _broadcasts(small: tuple, big: tuple) -> bool:
  try:
    return np.broadcast_shapes(small, big) == big
  except ValueError:
    return False
