"""The shim: per-parameter rules only, exact state, exact landing."""

import copy

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad


@immgrad.immediate_layer
def dense(x, p):
  return x @ p["w"] + p["b"]


def _loss(params, x, y):
  return jnp.mean(
    (dense(jnp.tanh(dense(x, params["l1"])), params["l2"]) - y) ** 2
  )


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "l1": {"w": jax.random.normal(k1, (3, 5)), "b": jnp.zeros(5)},
    "l2": {"w": jax.random.normal(k2, (5, 2)), "b": jnp.zeros(2)},
  }


def _data():
  return jnp.linspace(-1, 1, 12).reshape(4, 3), jnp.ones((4, 2))


@pytest.mark.parametrize(
  "tx",
  [
    optax.sgd(0.1, momentum=0.9, nesterov=True),
    optax.adam(1e-3),
    optax.adamw(optax.cosine_decay_schedule(1e-3, 100)),
    optax.lion(1e-3),
    optax.rmsprop(1e-3),
    optax.adafactor(1e-3),
    optax.lamb(1e-3),
    optax.chain(optax.clip(1.0), optax.adam(1e-3)),
    optax.chain(optax.clip_by_block_rms(1.0), optax.sgd(1e-2)),
    optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
  ],
)
def test_per_parameter_transformations_are_accepted(tx):
  immgrad.shim(tx)


@pytest.mark.parametrize("start", [2**24, 2**31 - 2])
def test_integer_step_count_is_exact_past_float32(start):
  """2**24 + 1 is not a float32; 2**31 - 1 is int32's last value."""
  tx = immgrad.shim(optax.adam(1e-3))
  params = _params()
  state = tx.init(params)
  state = state._replace(
    inner=jax.tree.map(
      lambda s: (
        s._replace(count=jnp.asarray(start, jnp.int32))
        if isinstance(s, optax.ScaleByAdamState)
        else s
      ),
      state.inner,
      is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState),
    )
  )
  _, grads = jax.jit(immgrad.value_and_grad(_loss, tx))(params, state, *_data())
  _, state = tx.update(grads, state, params)
  counts = [
    s.count
    for s in jax.tree.leaves(
      state.inner, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
    )
    if isinstance(s, optax.ScaleByAdamState)
  ]
  assert len(counts) == 1  # Optax's layout: one count for all parameters.
  for count in counts:
    assert count.dtype == jnp.int32
    assert int(count) == start + 1


def test_schedule_runs_at_true_step_speed():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  tx = immgrad.shim(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
  step = jax.jit(immgrad.value_and_grad(_loss, tx))
  params = _params()
  state = tx.init(params)
  for _ in range(4):
    _, grads = step(params, state, *_data())
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  for leaf_state in jax.tree.leaves(
    state.inner, is_leaf=lambda s: isinstance(s, optax.InjectHyperparamsState)
  ):
    if isinstance(leaf_state, optax.InjectHyperparamsState):
      assert int(leaf_state.count) == 4
      # The rate used in step 4 was schedule(3); the stored one is for it.
      np.testing.assert_allclose(
        leaf_state.hyperparams["learning_rate"], schedule(3), rtol=1e-6
      )


def _ulp(x):
  return np.spacing(np.abs(x).astype(np.float32))


def test_apply_updates_lands_on_smuggled_weights():
  """Bitwise in the Sterbenz range, within 1 ulp of max(|p|, |new|) always."""
  rng = np.random.default_rng(0)
  n = 200_000
  p = (
    rng.choice([-1, 1], n)
    * rng.uniform(1, 2, n)
    * 2.0 ** rng.integers(-20, 20, n)
  ).astype(np.float32)
  new = (
    rng.choice([-1, 1], n)
    * rng.uniform(1, 2, n)
    * 2.0 ** rng.integers(-20, 20, n)
  ).astype(np.float32)
  new[: n // 2] = (p[: n // 2] * rng.uniform(0.5, 2, n // 2)).astype(
    np.float32
  )  # Half of them a step of less than half the weight.
  tx = immgrad.shim(optax.sgd(1.0))
  params = {"w": jnp.asarray(p)}
  state = tx.init(params)
  grads = {"w": immgrad.Stepped(jnp.asarray(new))}
  updates, _ = tx.update(grads, state, params)
  landed = np.asarray(optax.apply_updates(params, updates)["w"])
  bound = _ulp(np.maximum(np.abs(p), np.abs(new)))
  assert np.all(np.abs(landed.astype(np.float64) - new) <= bound)
  ratio = new / p
  sterbenz = (ratio >= 0.5) & (ratio <= 2)
  assert sterbenz.sum() >= n // 2
  np.testing.assert_array_equal(landed[sterbenz], new[sterbenz])


def test_plain_gradients_train_like_tx():
  """Gradients from jax.grad through the shim: tx leaf by leaf.

  Not bitwise: XLA compiles adam on one leaf and on the whole tree with
  different vectorisation, an ulp apart. rtol=1e-6 is a few ulps over 3
  steps.
  """
  opt = optax.adam(1e-2)
  tx = immgrad.shim(opt)
  params = _params()
  plain = jax.jit(jax.grad(_loss))
  a, sa = params, tx.init(params)
  b, sb = params, opt.init(params)
  for _ in range(3):
    ua, sa = tx.update(plain(a, *_data()), sa, a)
    ub, sb = opt.update(plain(b, *_data()), sb, b)
    a, b = optax.apply_updates(a, ua), optax.apply_updates(b, ub)
  chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-8)


def test_shim_keeps_its_inner_tx_through_copies_and_tree_maps():
  """``inner`` and ``atomic`` are fields: copies and tree maps keep them.

  ``immgrad.value_and_grad`` reads both from the shim it is given, so a
  shim rebuilt by ``copy`` or ``jax.tree.map`` (as a library holding the
  optimizer may do) must still carry them.
  """
  opt = optax.adam(1e-3)
  tx = immgrad.shim(opt, atomic=False)
  assert isinstance(tx, optax.GradientTransformation)
  init, update = tx
  assert (init, update) == (tx.init, tx.update)
  for rebuilt in (copy.copy(tx), copy.deepcopy(tx), jax.tree.map(id, tx)):
    assert type(rebuilt) is immgrad.ShimTransformation
    assert rebuilt.inner == opt
    assert rebuilt.atomic is False
