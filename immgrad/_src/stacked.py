"""Optimizer state of a stacked parameter, split per layer.

``immgrad.scan`` hands each iteration one layer's slice of a stacked
parameter (leading axis: the layer), and the layer steps that slice with
that layer's slice of the optimizer state: the program ``plan.py`` cuts
for one layer, as if the layers were unrolled. The state ``tx.init`` made
for the whole stack splits per layer when each leaf the layer reads either
has the layer axis in front of what the layer's program expects (adam's
moments: sliced) or belongs to no parameter (optax's step ``count``, an
injected hyperparameter: *shared*, read whole by every layer). Anything
else (Adafactor factoring the stack over its layer axis, a per-tensor
statistic that each layer would make anew, a PRNG key every layer would
draw the same noise from) has no per-layer split and is refused.

The same split serves the backward loop (which slices the state for each
layer) and the shim (which commits each layer's slice: a per-tensor rule
such as ``immgrad.clip_by_layer_norm`` sees one layer, as for unrolled
layers).
"""

from typing import Sequence

import jax
import jax.numpy as jnp

from immgrad._src import plan as plan_lib

_UNSPLITTABLE = (
  "immgrad.scan: the optimizer state of stacked parameter {path} has a "
  "leaf of shape {big} (dtype {dtype}) where one layer's state has shape "
  "{small}. Only state with a leading layer axis, or a value shared by "
  "all parameters (such as the step count), can be split per layer. Use a "
  "per-element optimizer (sgd, adam, lion, ...) for stacked layers, or "
  "unroll them."
)

_NOT_LIKE_ONE_LAYER = (
  "immgrad.scan: the optimizer steps stacked parameter {path} from other "
  "parts of its state than one layer of it ({why}): it treats the stack "
  "as one tensor. Use a per-element optimizer (sgd, adam, lion, ...) for "
  "stacked layers, or unroll them."
)

_RANDOM = (
  "immgrad.scan: the optimizer draws random numbers for stacked parameter "
  "{path} from a key it shares with the other parameters: every layer "
  "would draw the same noise. Unroll the layers, or add the noise "
  "outside the optimizer."
)


def state_axes(
  whole: plan_lib.LeafProgram,
  layer: plan_lib.LeafProgram,
  parts: Sequence[jax.Array],
  shared: Sequence[int],
  path: str,
) -> list[int | None]:
  """How the state parts ``whole`` reads split into ``layer``'s, per layer.

  Args:
    whole: the program of the stacked parameter as one tensor.
    layer: the program of one layer of it (``plan.layer_program``).
    parts: the state leaves ``whole`` reads (the stack's).
    shared: the positions of the state that belongs to no parameter.
    path: the parameter, for errors.

  Returns:
    Per part, ``0`` if sliced along the layer axis, ``None`` if shared by
    all layers (the ``in_axes`` of a ``jax.vmap`` over the layers).

  Raises:
    ValueError: if the state does not split per layer.
  """
  if whole.reads != layer.reads or whole.writes != layer.writes:
    why = "it reads or writes other state leaves for one layer"
    raise ValueError(_NOT_LIKE_ONE_LAYER.format(path=path, why=why))
  layers = None
  split = []
  for position, big, small in zip(whole.reads, parts, layer.read_avals):
    big_shape, small_shape = jnp.shape(big), small.shape
    if position in shared:
      if _is_key(big):
        raise ValueError(_RANDOM.format(path=path))
      split.append(None)
    elif (
      big_shape[1:] == small_shape
      and big_shape
      and layers in (None, big_shape[0])
    ):
      layers = big_shape[0]
      split.append(0)
    else:
      raise ValueError(
        _UNSPLITTABLE.format(
          path=path,
          big=big_shape,
          small=small_shape,
          dtype=jnp.result_type(big),
        )
      )
  for big, small in zip(whole.write_avals, layer.write_avals):
    if big.shape[1:] != small.shape or not big.shape:
      raise ValueError(
        _UNSPLITTABLE.format(
          path=path, big=big.shape, small=small.shape, dtype=big.dtype
        )
      )
  return split


def _is_key(x) -> bool:
  dtype = jnp.result_type(x)
  return jnp.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.uint32
