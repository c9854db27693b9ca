"""save_checkpoint / restore_checkpoint: bit-exact resume, Haiku interop."""

import os

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
import oracles


def test_resumed_run_is_bitwise_identical(tmp_path):
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 6, (8, 6), (8, 3))
  tx = immgrad.shim(optax.adamw(optax.cosine_decay_schedule(1e-2, 6)))

  @jax.jit
  def step(params, state, x, y):
    _, grads = immgrad.value_and_grad(
      chain.loss_fn(immgrad.immediate_layer), tx
    )(params, state, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def run(params, state, batches):
    for batch in batches:
      params, state = step(params, state, *batch)
    return params, state

  straight = run(params, tx.init(params), data)
  halfway = run(params, tx.init(params), data[:3])
  path = str(tmp_path / "ckpt.npz")
  immgrad.save_checkpoint(path, {"params": halfway[0], "opt_state": halfway[1]})
  fresh = {"params": params, "opt_state": tx.init(params)}  # Only a template.
  restored = immgrad.restore_checkpoint(path, fresh)
  chex.assert_trees_all_equal(restored["params"], halfway[0])
  chex.assert_trees_all_equal(restored["opt_state"], halfway[1])
  resumed = run(restored["params"], restored["opt_state"], data[3:])
  chex.assert_trees_all_equal(resumed, straight)


def test_odd_dtypes_round_trip_bit_for_bit(tmp_path):
  tree = {
    "bf16": jnp.array([1.5, -0.0, jnp.inf], jnp.bfloat16),
    "count": jnp.array(2**31 - 1, jnp.int32),
    "nan": jnp.array([jnp.nan, -0.0]),
    "flag": jnp.array(True),
    "mlp/~/linear_0": jnp.arange(3.0),
  }  # Haiku's names have slashes.
  path = str(tmp_path / "odd.npz")
  immgrad.save_checkpoint(path, tree)
  back = immgrad.restore_checkpoint(path, tree)
  for key in tree:
    assert back[key].dtype == tree[key].dtype
    np.testing.assert_array_equal(
      np.asarray(back[key]).reshape(-1).view(np.uint8),
      np.asarray(tree[key]).reshape(-1).view(np.uint8),
    )


def test_mismatch_names_the_key(tmp_path):
  path = str(tmp_path / "c.npz")
  immgrad.save_checkpoint(path, {"layer": {"w": jnp.ones((2, 3))}})
  with pytest.raises(
    ValueError,
    match=r"\['layer'\]\['w'\] is stored as "
    r"float32\[2, 3\] but expected float32\[3, 3\]",
  ):
    immgrad.restore_checkpoint(path, {"layer": {"w": jnp.ones((3, 3))}})
  with pytest.raises(ValueError, match=r"has no \[\"\['layer'\]\['b'\]\"\]"):
    immgrad.restore_checkpoint(
      path, {"layer": {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}}
    )


def test_write_is_atomic_and_replaces(tmp_path):
  path = str(tmp_path / "c.npz")
  immgrad.save_checkpoint(path, {"w": jnp.zeros(2)})
  immgrad.save_checkpoint(path, {"w": jnp.ones(2)})
  assert os.listdir(tmp_path) == ["c.npz"]  # No temporary left behind.
  chex.assert_trees_all_equal(
    immgrad.restore_checkpoint(path, {"w": jnp.zeros(2)}), {"w": jnp.ones(2)}
  )


@immgrad.immediate_layer
def _affine(x, p):
  return x @ p["w"] + p["b"]


class ImmediateLinear(hk.Module):
  """hk.Linear's parameter names and init, through an immediate layer."""

  def __init__(self, size, name="linear"):
    super().__init__(name=name)
    self.size = size

  def __call__(self, x):
    w_init = hk.initializers.TruncatedNormal(1.0 / np.sqrt(x.shape[-1]))
    w = hk.get_parameter("w", (x.shape[-1], self.size), init=w_init)
    b = hk.get_parameter("b", (self.size,), init=jnp.zeros)
    return _affine(x, {"w": w, "b": b})


def _model(linear):
  def forward(x):
    h = jax.nn.relu(linear(8)(x))
    return linear(2)(h)

  return hk.without_apply_rng(hk.transform(forward))


def test_plain_haiku_checkpoint_loads_into_immediate_model_and_back(tmp_path):
  plain, immediate = _model(hk.Linear), _model(ImmediateLinear)
  x = jnp.linspace(-1, 1, 20).reshape(5, 4)
  plain_params = plain.init(jax.random.PRNGKey(0), x)
  path = str(tmp_path / "plain.npz")
  immgrad.save_checkpoint(path, plain_params)

  template = immediate.init(jax.random.PRNGKey(1), x)
  params = immgrad.restore_checkpoint(path, template)
  chex.assert_trees_all_equal(params, plain_params)
  chex.assert_trees_all_equal(
    immediate.apply(params, x), plain.apply(plain_params, x)
  )

  tx = immgrad.shim(optax.adam(1e-2))
  loss_fn = lambda p, x: jnp.mean(immediate.apply(p, x) ** 2)
  _, grads = immgrad.value_and_grad(loss_fn, tx)(params, tx.init(params), x)
  updates, _ = tx.update(grads, tx.init(params), params)
  params = optax.apply_updates(params, updates)
  assert all(
    isinstance(g, immgrad.ImmediateGrad)
    for g in jax.tree.leaves(
      grads, is_leaf=lambda g: isinstance(g, immgrad.ImmediateGrad)
    )
  )

  immgrad.save_checkpoint(path, params)
  back = immgrad.restore_checkpoint(path, plain_params)
  chex.assert_trees_all_equal(back, params)
  chex.assert_trees_all_equal(plain.apply(back, x), immediate.apply(params, x))
