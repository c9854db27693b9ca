"""``stacked.py`` directly: how a stacked parameter's optimizer state splits
per layer (``state_axes``), checked against shapes built by hand.

The programs are ``plan.py``'s: the stack's (a (3, 2, 4) weight as one
tensor) and one layer's (its (2, 4) slice).
"""

import jax
import jax.numpy as jnp
import optax
import pytest

from immgrad._src import plan
from immgrad._src import stacked

_LAYERS = 3
_STACK = {"w": jax.ShapeDtypeStruct((_LAYERS, 2, 4), jnp.float32)}


def _programs(tx):
  whole = plan.make(tx, _STACK)
  layer = plan.sliced(tx, _STACK, {0: 1})
  return whole.leaves[0], layer.leaves[0], whole.shared_positions


def _f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_adam_s_moments_are_scanned_and_its_count_shared():
  whole, layer, shared = _programs(optax.adam(0.1))
  # Adam's state flattened: (count, mu['w'], nu['w']).
  assert whole.reads == (0, 1, 2) and shared == (0,)
  parts = [jax.ShapeDtypeStruct((), jnp.int32), _f32(3, 2, 4), _f32(3, 2, 4)]
  assert stacked.state_axes(whole, layer, parts, shared, "['w']") == [
    None,
    0,
    0,
  ]


def test_injected_hyperparameters_are_shared_by_every_layer():
  """State: (inject's count, b1, b2, eps, eps_root, learning_rate, adam's
  count, mu, nu); the step reads all but inject's count, and only the
  moments have the layer axis.
  """
  tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
  whole, layer, shared = _programs(tx)
  assert whole.reads == tuple(range(1, 9)) and shared == tuple(range(7))
  scalar = _f32()
  parts = [scalar] * 5 + [jax.ShapeDtypeStruct((), jnp.int32)]
  parts += [_f32(3, 2, 4), _f32(3, 2, 4)]
  split = stacked.state_axes(whole, layer, parts, shared, "['w']")
  assert split == [None] * 6 + [0, 0]


def test_state_without_the_layer_axis_in_front_is_refused():
  """Moments whose leading axes disagree (3 and 5 layers) have no split
  that is a vmap's ``in_axes``.
  """
  whole, layer, shared = _programs(optax.adam(0.1))
  parts = [jax.ShapeDtypeStruct((), jnp.int32), _f32(3, 2, 4), _f32(5, 2, 4)]
  with pytest.raises(
    ValueError, match=r"\['w'\] has a leaf of shape \(5, 2, 4\).*\(2, 4\)"
  ):
    stacked.state_axes(whole, layer, parts, shared, "['w']")


@pytest.mark.parametrize(
  "tx",
  [optax.clip_by_block_rms(0.1), optax.lamb(0.1)],
  ids=["clip_by_block_rms", "lamb"],
)
def test_a_statistic_of_the_whole_stack_is_refused(tx):
  """Both read the whole tensor's norm: the stack's step is not its
  layers' steps side by side, though the state splits by shape.
  """
  whole, layer, shared = _programs(tx)
  with pytest.raises(
    ValueError, match=r"steps stacked parameter \['w'\] differently"
  ):
    stacked.state_axes(whole, layer, whole.read_avals, shared, "['w']")


def test_a_key_shared_by_all_layers_is_refused():
  """``optax.add_noise`` keeps one PRNG key for all parameters: every
  layer would draw the same noise.
  """
  whole, layer, shared = _programs(optax.add_noise(0.1, 0.5, key=0))
  with pytest.raises(ValueError, match="draws random numbers"):
    stacked.state_axes(whole, layer, whole.read_avals, shared, "['w']")
