"""Optimizer state of a stacked parameter, split per layer.

``immgrad.scan`` hands each iteration one layer's slice of a stacked
parameter (leading axis: the layer), and the layer steps that slice with
that layer's slice of the optimizer state. The state ``tx.init`` made for
the whole stack splits per layer when each of its leaves either has the
layer axis in front of what ``tx.init`` makes for one slice (adam's
moments: sliced), or equals it in shape (optax's step ``count``, an
injected hyperparameter: *shared*, every layer reads the same value and
steps it the same way). Anything else (Adafactor factoring the stack over
its layer axis, a per-tensor statistic that each layer would make anew) has
no per-layer split and is refused.

The same split serves the backward loop (which slices the state for each
layer) and the shim (which commits each layer's slice: a per-tensor rule
such as ``immgrad.clip_by_layer_norm`` sees one layer, as for unrolled
layers).
"""

from typing import Any

import jax
import jax.numpy as jnp

_UNSPLITTABLE = (
    "immgrad.scan: the optimizer state of stacked parameter {path} has a "
    "leaf of shape {big} (dtype {dtype}) where one layer's state has shape "
    "{small}. Only state with a leading layer axis, or a value shared by "
    "all layers (such as the step count), can be split per layer. Use a "
    "per-element optimizer (sgd, adam, lion, ...) for stacked layers, or "
    "unroll them.")


def state_axes(tx, leaf: Any, state: Any, path: str) -> Any:
  """The split of ``state`` (``tx``'s state of the stack ``leaf``) per layer.

  Returns:
    A tree like ``state`` holding ``0`` for each leaf sliced along the layer
    axis and ``None`` for each leaf shared by all layers (the ``in_axes`` of
    a ``jax.vmap`` over the layers).

  Raises:
    ValueError: if ``leaf`` has no layer axis, or ``state`` does not split.
  """
  if not jnp.ndim(leaf):
    raise ValueError(
        f"immgrad.scan: parameter {path} in xs is a scalar; stacked "
        "parameters need a leading layer axis.")
  layers = jnp.shape(leaf)[0]
  like = jax.eval_shape(
      tx.init, jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], jnp.result_type(leaf)))
  if jax.tree.structure(like) != jax.tree.structure(state):
    raise ValueError(
        f"immgrad.scan: the optimizer state of stacked parameter {path} is "
        f"not built like one layer's state ({jax.tree.structure(state)} vs "
        f"{jax.tree.structure(like)}).")

  def axis(big, small):
    big_shape, small_shape = jnp.shape(big), jnp.shape(small)
    if big_shape == (layers,) + small_shape:
      return 0
    if big_shape == small_shape:
      return None
    raise ValueError(_UNSPLITTABLE.format(
        path=path, big=big_shape, small=small_shape,
        dtype=jnp.result_type(big)))

  split = jax.tree.map(axis, state, like)
  # A shared value must stay shared: the same new value in every layer.
  leaves = jax.ShapeDtypeStruct(jnp.shape(leaf), jnp.result_type(leaf))
  try:
    jax.eval_shape(jax.vmap(lambda g, s, p: tx.update(g, s, p)[1],
                            in_axes=(0, split, 0), out_axes=split),
                   leaves, state, leaves)
  except ValueError as e:
    raise ValueError(
        f"immgrad.scan: the optimizer state of stacked parameter {path} has "
        "a value of the same shape as one layer's, which the layers would "
        "share, but the optimizer makes it anew from each layer's gradient "
        "(a per-tensor statistic). Use a per-element optimizer (sgd, adam, "
        "lion, ...) for stacked layers, or unroll them.") from e
  return split
