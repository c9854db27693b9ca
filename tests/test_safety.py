"""Parameters a step leaves untouched keep their weights and state exactly.

The errors that stop other silent corruption are in test_bad_input.py.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import tiny


def _of(state, name):
  """The moments of parameter group ``name`` in a shim's (optax) state."""
  return [
    s.mu[name]
    for s in jax.tree.leaves(
      state.inner, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ], [
    s.nu[name]
    for s in jax.tree.leaves(
      state.inner, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ]


def _count(state):
  (adam,) = [
    s
    for s in jax.tree.leaves(
      state.inner, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ]
  return int(adam.count)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_layer_not_reached_keeps_weights_and_state(jit):
  def loss_fn(params, x, y):  # l2 is skipped this step.
    h = jax.nn.relu(tiny.dense(x, params["l1"]))
    return jnp.mean((tiny.dense(h, params["l3"]) - y) ** 2)

  params = tiny.params()
  tx, step = tiny.train_step(loss_fn, jit=jit)
  state = tx.init(params)
  new_params, new_state = step(params, state, *tiny.data())
  chex.assert_trees_all_equal(new_params["l2"], params["l2"])
  chex.assert_trees_all_equal(_of(new_state, "l2"), _of(state, "l2"))
  # The others did step (and the shared adam count moved on).
  for name in ("l1", "l3"):
    assert not jnp.array_equal(new_params[name]["w"], params[name]["w"])
    assert not jnp.array_equal(
      _of(new_state, name)[0][0]["w"], _of(state, name)[0][0]["w"]
    )
  assert _count(new_state) == 1


def test_layer_whose_output_is_unused_keeps_weights_and_state():
  def loss_fn(params, x, y):
    tiny.dense(x, params["l2"])  # Reached, but nothing depends on it.
    return jnp.mean((tiny.dense(x, params["l1"])[:, :2] - y) ** 2)

  params = tiny.params()
  tx, step = tiny.train_step(loss_fn)
  state = tx.init(params)
  new_params, new_state = step(params, state, *tiny.data())
  chex.assert_trees_all_equal(new_params["l2"], params["l2"])
  chex.assert_trees_all_equal(_of(new_state, "l2"), _of(state, "l2"))
  assert not jnp.array_equal(new_params["l1"]["w"], params["l1"]["w"])


def test_stop_gradient_parameter_is_left_alone():
  def loss_fn(params, x, y):
    h = jax.lax.stop_gradient(params["l2"]["w"])
    return jnp.mean((tiny.dense(x @ h, params["l1"])[:, :2] - y) ** 2)

  params = tiny.params()
  tx, step = tiny.train_step(loss_fn, optax.adamw(1e-2, weight_decay=0.1))
  state = tx.init(params)
  new_params, new_state = step(params, state, *tiny.data())
  chex.assert_trees_all_equal(new_params["l2"]["w"], params["l2"]["w"])
  chex.assert_trees_all_equal(
    [m["w"] for m in sum(_of(new_state, "l2"), [])],
    [m["w"] for m in sum(_of(state, "l2"), [])],
  )
