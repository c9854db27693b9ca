"""compute_dtype: bfloat16 arithmetic, float32 weights and updates."""

import chex
import jax
import jax.numpy as jnp
import optax

import immgrad


def affine(x, p):
  return x @ p["w"] + p["b"]


def test_update_below_a_bfloat16_ulp_survives():
  layer = immgrad.immediate_layer(affine, compute_dtype=jnp.bfloat16)
  params = {"w": jnp.ones((4, 2), jnp.float32), "b": jnp.zeros(2)}
  x = jnp.full((8, 4), 0.5)
  y = jnp.full((8, 2), 2.1)

  def loss_fn(params, x, y):
    return jnp.mean((layer(x, params).astype(jnp.float32) - y) ** 2)

  opt = optax.sgd(1e-3)  # Steps of about 1e-4: bfloat16's ulp at 1 is 2**-7.
  tx = immgrad.shim(opt)
  state = tx.init(params)
  _, grads = jax.jit(immgrad.value_and_grad(loss_fn, tx))(
      params, state, x, y)
  updates, _ = tx.update(grads, state, params)
  stepped = optax.apply_updates(params, updates)
  new = stepped["w"]
  assert new.dtype == jnp.float32
  step = jnp.abs(new - 1.0)
  assert jnp.all((step > 0) & (step < 2.0 ** -8))
  assert jnp.all(new.astype(jnp.bfloat16) == 1)  # bf16 would have lost it.

  # Independent reference: the same casts by hand, plain grad and sgd.
  def reference_loss(params):
    cast = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
    out = affine(cast(x), cast(params)).astype(jnp.float32)
    return jnp.mean((out - y) ** 2)

  updates, _ = opt.update(jax.grad(reference_loss)(params), opt.init(params))
  expected = optax.apply_updates(params, updates)
  chex.assert_trees_all_close(stepped, expected, atol=0, rtol=1e-6)


def test_outside_a_step_compute_dtype_applies_too():
  layer = immgrad.immediate_layer(affine, compute_dtype=jnp.bfloat16)
  params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
  assert layer(jnp.ones((1, 4)), params).dtype == jnp.bfloat16
  assert jax.grad(lambda p: jnp.sum(layer(jnp.ones((1, 4)), p)))(
      params)["w"].dtype == jnp.float32
