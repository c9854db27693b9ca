"""Every way a weight could be silently corrupted: unchanged, or an error."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import immgrad


@immgrad.immediate_layer
def dense(x, p):
  return x @ p["w"] + p["b"]


def _params():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  return {
      "l1": {"w": jax.random.normal(k1, (4, 4)) / 2, "b": jnp.full((4,), .1)},
      "l2": {"w": jax.random.normal(k2, (4, 4)) / 2, "b": jnp.full((4,), .2)},
      "l3": {"w": jax.random.normal(k3, (4, 2)) / 2, "b": jnp.full((2,), .3)},
  }


def _data():
  return jnp.linspace(-1, 1, 32).reshape(8, 4), jnp.ones((8, 2))


def _train_step(loss_fn, opt=None, jit=True):
  tx = immgrad.shim(opt or optax.adam(1e-2))

  def step(params, state, *batch):
    _, grads = immgrad.value_and_grad(loss_fn, tx)(params, state, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, (jax.jit(step) if jit else step)


def _path(*keys):
  return re.escape("".join(f"[{k!r}]" for k in keys))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_layer_not_reached_keeps_weights_and_state(jit):
  def loss_fn(params, x, y):  # l2 is skipped this step.
    h = jax.nn.relu(dense(x, params["l1"]))
    return jnp.mean((dense(h, params["l3"]) - y) ** 2)

  params = _params()
  tx, step = _train_step(loss_fn, jit=jit)
  state = tx.init(params)
  new_params, new_state = step(params, state, *_data())
  chex.assert_trees_all_equal(new_params["l2"], params["l2"])
  chex.assert_trees_all_equal(new_state.inner["l2"], state.inner["l2"])
  # The others did step (and their adam count moved on).
  for name in ("l1", "l3"):
    assert not jnp.array_equal(new_params[name]["w"], params[name]["w"])
    assert int(new_state.inner[name]["w"][0].count) == 1


def test_layer_whose_output_is_unused_keeps_weights_and_state():
  def loss_fn(params, x, y):
    dense(x, params["l2"])  # Reached, but nothing depends on it.
    return jnp.mean((dense(x, params["l1"])[:, :2] - y) ** 2)

  params = _params()
  tx, step = _train_step(loss_fn)
  state = tx.init(params)
  new_params, new_state = step(params, state, *_data())
  chex.assert_trees_all_equal(new_params["l2"], params["l2"])
  chex.assert_trees_all_equal(new_state.inner["l2"], state.inner["l2"])
  assert not jnp.array_equal(new_params["l1"]["w"], params["l1"]["w"])


def test_stop_gradient_parameter_is_left_alone():
  def loss_fn(params, x, y):
    h = jax.lax.stop_gradient(params["l2"]["w"])
    return jnp.mean((dense(x @ h, params["l1"])[:, :2] - y) ** 2)

  params = _params()
  tx, step = _train_step(loss_fn, optax.adamw(1e-2, weight_decay=0.1))
  state = tx.init(params)
  new_params, new_state = step(params, state, *_data())
  chex.assert_trees_all_equal(new_params["l2"]["w"], params["l2"]["w"])
  chex.assert_trees_all_equal(new_state.inner["l2"]["w"],
                              state.inner["l2"]["w"])


def test_weight_in_two_immediate_calls_is_an_error():
  def loss_fn(params, x, y):
    h = dense(x, params["l1"])
    return jnp.mean((dense(h, params["l1"])[:, :2] - y) ** 2)

  tx, step = _train_step(loss_fn)
  with pytest.raises(ValueError, match="reaches two immediate layer calls"):
    step(_params(), tx.init(_params()), *_data())


def test_same_weight_twice_in_one_call_is_an_error():
  def loss_fn(params, x, y):
    both = {"w": params["l2"]["w"], "b": params["l2"]["b"],
            "again": params["l2"]["w"]}
    out = immgrad.immediate_layer(lambda x, p: x @ p["w"] @ p["again"])(
        x, both)
    return jnp.mean((out[:, :2] - y) ** 2)

  tx, step = _train_step(loss_fn)
  with pytest.raises(ValueError, match=_path("l2", "w")):
    step(_params(), tx.init(_params()), *_data())


def test_immediate_and_ordinary_use_is_an_error():
  def loss_fn(params, x, y):  # Tied weights: l1.w used again, undecorated.
    h = jax.nn.relu(dense(x, params["l1"]))
    h = h @ params["l1"]["w"].T
    return jnp.mean((dense(h, params["l3"]) - y) ** 2)

  tx, step = _train_step(loss_fn)
  with pytest.raises(ValueError, match=_path("l1", "w") + ".*'dense'"):
    step(_params(), tx.init(_params()), *_data())


def test_regulariser_on_immediate_weight_is_an_error():
  def loss_fn(params, x, y):
    out = dense(x, params["l1"])[:, :2]
    return jnp.mean((out - y) ** 2) + 1e-3 * jnp.sum(params["l1"]["w"] ** 2)

  tx, step = _train_step(loss_fn)
  with pytest.raises(ValueError, match="also by an ordinary operation"):
    step(_params(), tx.init(_params()), *_data())


@pytest.mark.parametrize("transform", [
    lambda w: w.astype(jnp.bfloat16),
    lambda w: 2.0 * w,
    lambda w: w + 0.0,
    lambda w: jnp.stack([w, w])[0],
    lambda w: w.T.T,
], ids=["cast", "scale", "arithmetic", "stack_and_index", "transpose"])
def test_weight_transformed_before_the_layer_is_an_error(transform):
  def loss_fn(params, x, y):
    p = {"w": transform(params["l1"]["w"]), "b": params["l1"]["b"]}
    return jnp.mean((dense(x, p)[:, :2] - y) ** 2)

  tx, step = _train_step(loss_fn)
  with pytest.raises(ValueError,
                     match=r"'dense' got params\['w'\] that is not a "
                     r"parameter"):
    step(_params(), tx.init(_params()), *_data())


def _scan_closed_over(params, x):
  def body(h, _):
    return jnp.tanh(dense(h, params["l1"])), None
  return jax.lax.scan(body, x, None, length=3)[0]


def _scan_stacked(params, x):
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), params["l1"],
                         params["l2"])
  return jax.lax.scan(lambda h, p: (dense(h, p), None), x, stacked)[0]


def _cond(params, x):
  return jax.lax.cond(x[0, 0] > 0, lambda h: dense(h, params["l1"]),
                      lambda h: h, x)


def _checkpoint(params, x):
  return jax.checkpoint(lambda h: dense(h, params["l1"]))(x)


def _vmap(params, x):
  return jax.vmap(lambda row: dense(row, params["l1"]))(x)


@pytest.mark.parametrize("where", [_scan_closed_over, _scan_stacked, _cond,
                                   _checkpoint, _vmap],
                         ids=["scan_closure", "scan_stacked", "cond",
                              "checkpoint", "vmap"])
def test_layer_inside_a_transformation_is_an_error(where):
  def loss_fn(params, x, y):
    return jnp.mean((where(params, x)[:, :2] - y) ** 2)

  tx, step = _train_step(loss_fn)
  with pytest.raises(ValueError, match="'dense'"):
    step(_params(), tx.init(_params()), *_data())
