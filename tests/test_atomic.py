"""A non-finite gradient in a middle layer rejects the whole step.

Every test runs both commits (``commit.by_select``): a ``lax.cond`` per
parameter, what the CPU runs, and an elementwise select, what a TPU or GPU
runs; CI has no accelerator, so the select is checked here on the CPU.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import immgrad
from immgrad._src import commit
import oracles


@pytest.fixture(autouse=True, params=["cond", "select"])
def commit_by(request, monkeypatch):
  monkeypatch.setattr(commit, "by_select", lambda: request.param == "select")
  return request.param


@jax.custom_vjp
def poison(h, flag):
  """Identity; its backward rule makes the cotangent NaN when flag is 1."""
  del flag
  return h


poison.defvjp(
  lambda h, flag: (h, flag),
  lambda flag, ct: (
    jnp.where(flag > 0, jnp.nan, 1.0) * ct,
    jnp.zeros_like(flag),
  ),
)


def _setup():
  _, params = oracles.mlp([6, 16, 16, 16, 3], jax.random.PRNGKey(0))
  layer = immgrad.immediate_layer(oracles.dense)

  def loss_fn(params, x, y, flag):
    h = jax.nn.relu(layer(x, params["layer0"]))
    h = jax.nn.relu(poison(layer(h, params["layer1"]), flag))  # The middle.
    h = jax.nn.relu(layer(h, params["layer2"]))
    return jnp.mean((layer(h, params["layer3"]) - y) ** 2)

  return (
    loss_fn,
    params,
    oracles.batches(jax.random.PRNGKey(1), 2, (8, 6), (8, 3)),
  )


def _step_fn(loss_fn, tx, mode):
  @jax.jit
  def step(params, state, x, y, flag):
    _, grads = immgrad.value_and_grad(loss_fn, tx, mode=mode)(
      params, state, x, y, flag
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


@pytest.mark.parametrize("mode", ["updated", "current"])
def test_nan_in_a_middle_layer_rejects_the_whole_step(mode):
  loss_fn, params, data = _setup()
  tx = immgrad.shim(optax.adam(1e-2))
  step = _step_fn(loss_fn, tx, mode)
  state = tx.init(params)
  params = jax.tree.map(
    lambda p: p.at[0].set(-0.0) if p.ndim == 1 else p, params
  )  # A -0.0 must survive too.

  poisoned_params, poisoned_state = step(params, state, *data[0], 1.0)
  chex.assert_trees_all_equal(poisoned_params, params)  # Bit for bit.
  chex.assert_trees_all_equal(poisoned_state.inner, state.inner)
  assert jnp.signbit(poisoned_params["layer0"]["b"][0])
  assert int(poisoned_state.rejected) == 1

  # The next clean step is exactly a clean step from the start.
  after, after_state = step(poisoned_params, poisoned_state, *data[1], 0.0)
  clean, clean_state = step(params, state, *data[1], 0.0)
  chex.assert_trees_all_equal(after, clean)
  chex.assert_trees_all_equal(after_state.inner, clean_state.inner)
  assert int(after_state.rejected) == 1
  assert not jnp.array_equal(after["layer3"]["w"], params["layer3"]["w"])


def test_without_atomic_the_step_is_half_applied():
  """What atomic=True prevents: later layers stepped, earlier ones NaN."""
  loss_fn, params, data = _setup()
  tx = immgrad.shim(optax.adam(1e-2), atomic=False)
  new, state = _step_fn(loss_fn, tx, "updated")(
    params, tx.init(params), *data[0], 1.0
  )
  assert jnp.all(jnp.isfinite(new["layer3"]["w"]))
  assert not jnp.array_equal(new["layer3"]["w"], params["layer3"]["w"])
  assert jnp.all(jnp.isnan(new["layer1"]["w"]))
  assert int(state.rejected) == 0


def _check_rejected(new, new_state, params, state):
  """A rejected step: every weight and state bit for bit, counted once."""
  chex.assert_trees_all_equal(new, params)
  chex.assert_trees_all_equal(new_state.inner, state.inner)
  assert int(new_state.rejected) == int(state.rejected) + 1


@pytest.mark.parametrize("mode", ["updated", "current"])
def test_nan_in_one_scanned_layer_rejects_the_whole_step(mode):
  """Stacked layers commit layer by layer, in place: all or none of them."""
  _, params = oracles.mlp([6, 6, 6, 6, 3], jax.random.PRNGKey(0))
  layer = immgrad.immediate_layer(oracles.dense)
  params = {
    "blocks": jax.tree.map(
      lambda *a: jnp.stack(a),
      params["layer0"],
      params["layer1"],
      params["layer2"],
    ),
    "head": params["layer3"],
  }

  def loss_fn(params, x, y, flag):
    def body(h, xs):
      p, i = xs
      h = jax.nn.relu(layer(h, p))
      return jnp.where(i == 1, poison(h, flag), h), None  # Layer 1 only.

    h, _ = immgrad.scan(body, x, (params["blocks"], jnp.arange(3)))
    return jnp.mean((layer(h, params["head"]) - y) ** 2)

  tx = immgrad.shim(optax.adam(1e-2))
  step = _step_fn(loss_fn, tx, mode)
  state = tx.init(params)
  x, y = oracles.batches(jax.random.PRNGKey(1), 1, (8, 6), (8, 3))[0]
  _check_rejected(*step(params, state, x, y, 1.0), params, state)
  clean, _ = step(params, state, x, y, 0.0)
  for i in range(3):  # Clean, every layer of the stack moves.
    assert not jnp.array_equal(
      clean["blocks"]["w"][i], params["blocks"]["w"][i]
    )


def test_non_finite_new_state_from_finite_gradients_is_rejected():
  """adam squares the gradient: 1e20 is finite, its square is not."""
  layer = immgrad.immediate_layer(oracles.dense)
  params = {"l": {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}}
  tx = immgrad.shim(optax.adam(1e-2))

  def loss_fn(params, x, y, flag):
    del flag
    return jnp.sum(layer(x, params["l"]) * y)

  step = _step_fn(loss_fn, tx, "current")
  state = tx.init(params)
  x, y = jnp.full((1, 2), 1e20), jnp.ones((1, 2))
  _check_rejected(*step(params, state, x, y, 0.0), params, state)


def test_non_finite_ordinary_gradient_rejects_the_whole_step():
  """An ordinary parameter's gradient is checked by the shim itself."""
  _, params = oracles.mlp([6, 16, 3], jax.random.PRNGKey(0))
  layer = immgrad.immediate_layer(oracles.dense)
  params["scale"] = jnp.ones(3)

  def loss_fn(params, x, y, flag):
    h = jax.nn.relu(layer(x, params["layer0"]))
    out = layer(h, params["layer1"]) * poison(params["scale"], flag)
    return jnp.mean((out - y) ** 2)

  tx = immgrad.shim(optax.adam(1e-2))
  step = _step_fn(loss_fn, tx, "updated")
  state = tx.init(params)
  x, y = oracles.batches(jax.random.PRNGKey(1), 1, (8, 6), (8, 3))[0]
  _check_rejected(*step(params, state, x, y, 1.0), params, state)
  clean, _ = step(params, state, x, y, 0.0)
  assert not jnp.array_equal(clean["scale"], params["scale"])


def test_an_unchecked_step_is_checked_by_an_atomic_shim():
  """Gradients from a value_and_grad whose shim was not atomic carry no
  finiteness flag; an atomic shim then checks them itself.
  """
  loss_fn, params, data = _setup()
  loose = immgrad.shim(optax.adam(1e-2), atomic=False)
  tx = immgrad.shim(optax.adam(1e-2))
  state = tx.init(params)

  @jax.jit
  def step(params, state, x, y, flag):
    _, grads = immgrad.value_and_grad(loss_fn, loose)(params, state, x, y, flag)
    assert all(
      g.nonfinite is None
      for g in jax.tree.leaves(
        grads, is_leaf=lambda g: isinstance(g, immgrad.ImmediateGrad)
      )
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  _check_rejected(*step(params, state, *data[0], 1.0), params, state)
  clean, _ = step(params, state, *data[0], 0.0)
  assert not jnp.array_equal(clean["layer0"]["w"], params["layer0"]["w"])
