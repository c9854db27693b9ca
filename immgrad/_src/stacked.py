"""Optimizer state of a stacked parameter, split per layer.

``immgrad.scan`` steps each layer's slice of a stacked parameter with that
layer's slice of the optimizer state, as if the layers were unrolled; the
backward loop and the shim split the state the same way (:func:`state_axes`).
"""

import functools
from typing import Any, Sequence

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

from immgrad._src import jaxpr as jaxpr_lib
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

_NOT_PER_LAYER = (
  "immgrad.scan: the optimizer steps stacked parameter {path} differently "
  "as one {shape} tensor, as plain training steps it, than one layer of it "
  "at a time, as immgrad.scan must (largest difference {diff:.3g}, on "
  "sample values). It treats the stack as one tensor: a statistic of the "
  "whole tensor (LAMB's or LARS's trust ratio, clip_by_block_rms, "
  "immgrad.clip_by_layer_norm), or a mask or label chosen by the "
  "parameter's shape (ndim) that a layer's slice does not share. Choose "
  "masks and labels by the parameter's path, use a per-element optimizer "
  "(sgd, adam, lion, ...) for stacked layers, or unroll them."
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
  parts: Sequence[jax.Array | jax.ShapeDtypeStruct],
  shared: Sequence[int],
  path: str,
) -> list[int | None]:
  """How the state parts ``whole`` reads split into ``layer``'s, per layer.

  The layer's program (cut by ``plan.py`` for one layer) must be the stack's
  step on each layer; a rule that steps the stack otherwise (a statistic of
  the whole tensor, a mask chosen by its ``ndim``) is refused. A state leaf
  splits when it has the layer axis in front of what the layer's program
  expects (adam's moments: sliced) or belongs to no parameter (optax's step
  ``count``, an injected hyperparameter: shared, read whole by every layer).
  Anything else (Adafactor factoring the stack over its layer axis, a
  per-tensor statistic, a PRNG key every layer would draw the same noise from)
  has no per-layer split and is refused.

  Args:
    whole: the program of the stacked parameter as one tensor.
    layer: the program of one layer of it (``plan.sliced``).
    parts: the state leaves ``whole`` reads (the stack's), or their shapes.
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
  diff = _difference(whole, layer, tuple(split))
  if diff:
    raise ValueError(
      _NOT_PER_LAYER.format(path=path, shape=whole.param_aval.shape, diff=diff)
    )
  return split


def _difference(
  whole: plan_lib.LeafProgram, layer: plan_lib.LeafProgram, split: tuple
) -> float:
  """How far ``layer``, run per layer, is from ``whole`` on the stack.

  Both programs are run on the same sample values (a gradient and weights
  of either sign hashed from their positions, positive state, a step
  count of 3), ``layer`` under ``jax.vmap`` over the layers with
  ``split``; ``0.0`` if every output
  agrees to a relative 1e-6 (the same arithmetic on each element agrees
  exactly, in any dtype; a weight decay of 1e-5 of adam's update does
  not), else the largest difference. A rule that reads a layer's slice as it reads the
  stack (adam, lion, a mask by path) agrees; one that looks at the whole
  tensor or at its shape does not. Programs that take keys or other
  non-numbers, or whose effects return values, are taken to agree.
  Compiled and run once per pair of programs alike (the stacked leaves of
  one shape, in every layer of a model, share it).
  """
  return _compare(_Pair(whole, layer, split))


class _Pair:
  """Two programs and a split, equal to another by their text."""

  def __init__(self, whole, layer, split):
    self.programs = whole, layer, split
    self.text = tuple(
      (str(p.jaxpr), tuple(map(id, p.jaxpr.consts))) for p in (whole, layer)
    ) + (split,)

  def __hash__(self):
    return hash(self.text)

  def __eq__(self, other):
    return self.text == other.text


@functools.lru_cache(maxsize=256)
def _compare(pair: _Pair) -> float:
  whole, layer, split = pair.programs
  avals = (whole.param_aval, whole.param_aval, *whole.read_avals)
  whole_fun, layer_fun = _pure(whole.jaxpr), _pure(layer.jaxpr)
  if whole_fun is None or layer_fun is None:
    return 0.0
  if not all(np.issubdtype(a.dtype, np.number) for a in avals):
    return 0.0

  def sample(zero, seed: int, aval, signed: bool):
    if np.issubdtype(aval.dtype, np.integer):
      return jnp.full(aval.shape, 3 + zero.astype(aval.dtype), aval.dtype)
    # Uniform in [0.5, 1.5), by a hash of the position (jax.random costs
    # seconds on a CPU for a large stack).
    n = jnp.arange(np.prod(aval.shape, dtype=int), dtype=jnp.float32) + zero
    hashed = jnp.sin(n * 12.9898 + 78.233 * seed) * 43758.5453
    values = 0.5 + hashed - jnp.floor(hashed)
    if signed:
      values = jnp.where(jnp.sin(n * 7.7 + seed) > 0, values, -values)
    return values.reshape(aval.shape).astype(aval.dtype)

  def worst_difference(zero):
    inputs = [sample(zero, i, a, i < 2) for i, a in enumerate(avals)]
    expected = whole_fun(*inputs)
    got = jax.vmap(layer_fun, in_axes=(0, 0, *split))(*inputs)
    worst = jnp.zeros((), jnp.float32)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
      a, b = a.astype(jnp.float32), b.astype(jnp.float32)
      off = ~jnp.isclose(a, b, rtol=1e-6, atol=0.0, equal_nan=True)
      gap = jnp.where(jnp.isnan(a - b), jnp.inf, jnp.abs(a - b))
      worst = jnp.maximum(worst, jnp.max(jnp.where(off, gap, 0.0), initial=0.0))
    return worst

  # Sampled and compared in one program, on the CPU: XLA's TPU compiler
  # took 43 s over the check of a 16x2048x2048 stack on a v5e (plain
  # training's step compiles in 2.3 s there), the CPU's 0.2 s. The samples
  # start from an argument (zero), so that no compiler folds them as
  # constants. Each operation rounded to its dtype, as its HLO says: XLA
  # would otherwise keep bfloat16 intermediates in float32 where it fuses,
  # and fuse the two programs differently.
  exact: dict[str, Any] = {"xla_allow_excess_precision": False}
  zero = np.zeros((), np.float32)
  with jax.default_device(_check_device()):
    lowered = jax.jit(worst_difference).lower(zero)
    return float(lowered.compile(compiler_options=exact)(zero))


def _check_device():
  """The CPU, or the default device where JAX runs without it
  (``JAX_PLATFORMS=tpu``).
  """
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


def _is_key(x) -> bool:
  dtype = jnp.result_type(x)
  return jnp.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.uint32


def _pure(closed):
  """``closed`` as a function, without its effects (a ``jax.debug.print``
  in the rule must not run on sample values), or None where an effect
  returns a value the program uses.
  """
  if any(e.outvars for e in closed.jaxpr.eqns if e.effects):
    return None
  eqns = [e for e in closed.jaxpr.eqns if not e.effects]
  return jax_core.jaxpr_as_fun(jaxpr_lib.subprogram(closed, eqns))
