"""compute_dtype: bfloat16 arithmetic, float32 weights and updates."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import optax

import immgrad
import immgrad.haiku


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
  _, grads = jax.jit(immgrad.value_and_grad(loss_fn, tx))(params, state, x, y)
  updates, _ = tx.update(grads, state, params)
  stepped = optax.apply_updates(params, updates)
  new = stepped["w"]
  assert new.dtype == jnp.float32
  step = jnp.abs(new - 1.0)
  assert jnp.all((step > 0) & (step < 2.0**-8))
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
  assert (
    jax.grad(lambda p: jnp.sum(layer(jnp.ones((1, 4)), p)))(params)["w"].dtype
    == jnp.float32
  )


# -- immgrad.haiku.immediate(compute_dtype=...) ---------------------------

BF16 = jnp.bfloat16


def _haiku_mlp(x):
  h = jax.nn.relu(hk.Linear(16)(hk.LayerNorm(-1, True, True)(x)))
  return hk.Linear(3)(h)


def _hand_cast_mlp(params, x):
  """The same model by hand: matrix products in bfloat16, the norm in f32."""
  c = lambda a: a.astype(BF16)
  ln, l0, l1 = params["layer_norm"], params["linear"], params["linear_1"]
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.var(x, -1, keepdims=True)
  h = (ln["scale"] * jax.lax.rsqrt(var + 1e-5)) * (x - mean) + ln["offset"]
  h = jax.nn.relu(c(h) @ c(l0["w"]) + c(l0["b"]))
  return c(h) @ c(l1["w"]) + c(l1["b"])


def test_haiku_compute_dtype_plain_and_immediate_match_a_hand_cast_model():
  model = hk.without_apply_rng(
    hk.transform(immgrad.haiku.immediate(_haiku_mlp, compute_dtype=BF16))
  )
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 8))
  y = jax.random.normal(jax.random.PRNGKey(1), (32, 3))
  params = model.init(jax.random.PRNGKey(2), x)
  assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype("float32")}
  out = model.apply(params, x)
  assert out.dtype == BF16
  # Outside a step the model is the hand-cast one: the same operations.
  chex.assert_trees_all_equal(out, _hand_cast_mlp(params, x))

  def loss(out):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)

  opt = optax.adam(1e-2)
  reference, plain = params, params
  ref_state, plain_state = opt.init(params), opt.init(params)
  tx = immgrad.shim(opt)
  got, state = params, tx.init(params)
  ref_step = jax.jit(jax.grad(lambda p: loss(_hand_cast_mlp(p, x))))
  plain_step = jax.jit(jax.grad(lambda p: loss(model.apply(p, x))))
  step = jax.jit(
    immgrad.value_and_grad(
      lambda p: loss(model.apply(p, x)), tx, mode="current"
    )
  )
  for _ in range(4):
    updates, ref_state = opt.update(ref_step(reference), ref_state, reference)
    reference = optax.apply_updates(reference, updates)
    updates, plain_state = opt.update(plain_step(plain), plain_state, plain)
    plain = optax.apply_updates(plain, updates)
    _, grads = step(got, state)
    updates, state = tx.update(grads, state, got)
    got = optax.apply_updates(got, updates)
  # Plain training of the wrapped model is the hand-cast model's, and the
  # immediate step steps float32 weights on the same bfloat16 gradients.
  # Tolerance: 2e-6 absolute, a few float32 ulps of weights of order 0.1-1
  # after 4 adam steps of 1e-2 (differently fused programs round the f32
  # parts apart; a bfloat16 rounding difference would be ~1e-3).
  chex.assert_trees_all_close(plain, reference, atol=2e-6, rtol=0)
  chex.assert_trees_all_close(got, reference, atol=2e-6, rtol=0)
  assert {a.dtype for a in jax.tree.leaves(got)} == {jnp.dtype("float32")}
  # float32 compute lands measurably elsewhere: the cast is really there.
  f32 = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(_haiku_mlp)))
  assert (
    float(
      jnp.max(
        jnp.abs(
          f32.apply(params, x).astype(jnp.float32) - out.astype(jnp.float32)
        )
      )
    )
    > 1e-3
  )
