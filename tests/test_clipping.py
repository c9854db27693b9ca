"""One-pass clipping inside the shim, instead of global-norm clipping."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
import oracles

ATOL, RTOL = 1e-6, 1e-5  # As in test_current.py.


def _problem():
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 4, (8, 6), (8, 3))
  return chain, params, data


def test_layer_norm_clip_by_hand():
  """One sgd step: w - lr * g / max(1, ||g|| / max_norm), per tensor."""
  chain, params, data = _problem()
  max_norm, lr = 0.5, 0.5
  grads = jax.grad(chain.loss_fn())(params, *data[0])
  norms = {
    k: {n: float(np.linalg.norm(np.asarray(g))) for n, g in v.items()}
    for k, v in grads.items()
  }
  assert (
    min(min(v.values()) for v in norms.values())
    < max_norm
    < max(max(v.values()) for v in norms.values())
  )  # Some clip, some do not.
  expected = jax.tree.map(
    lambda p, g, n: p - lr * g / max(1.0, n / max_norm), params, grads, norms
  )
  got = oracles.immediate_steps(
    chain.loss_fn(immgrad.immediate_layer),
    optax.chain(immgrad.clip_by_layer_norm(max_norm), optax.sgd(lr)),
    params,
    data[:1],
    mode="current",
  )[0][0]
  chex.assert_trees_all_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
  "opt",
  [
    optax.chain(immgrad.clip_by_layer_norm(0.1), optax.adam(1e-2)),
    optax.chain(
      optax.scale_by_adam(),
      optax.clip_by_block_rms(0.5),
      optax.scale_by_learning_rate(1e-2),
    ),
  ],
  ids=["layer_norm_then_adam", "adalomo_update_rms"],
)
def test_clipped_training_matches_references(opt):
  chain, params, data = _problem()
  oracles.assert_runs_close(
    oracles.immediate_steps(
      chain.loss_fn(immgrad.immediate_layer), opt, params, data, mode="current"
    ),
    oracles.plain_steps(chain.loss_fn(), opt, params, data),
    atol=ATOL,
    rtol=RTOL,
  )
  oracles.assert_runs_close(
    oracles.immediate_steps(
      chain.loss_fn(immgrad.immediate_layer), opt, params, data, mode="updated"
    ),
    oracles.sequential_steps(chain, opt, params, data),
    atol=ATOL,
    rtol=RTOL,
  )


def test_max_norm_must_be_positive():
  with pytest.raises(ValueError, match="max_norm must be positive"):
    immgrad.clip_by_layer_norm(0.0)


def test_bfloat16_gradient_keeps_its_dtype():
  clip = immgrad.clip_by_layer_norm(1.0)
  g = jnp.full((4,), 3.0, jnp.bfloat16)
  out, _ = clip.update(g, clip.init(g))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), 0.5, rtol=1e-2)
