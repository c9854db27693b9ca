"""A jitted step with donated params and state: correct, and traced once."""

import chex
import jax
import optax

import immgrad
import oracles


def test_donated_jitted_step_does_not_retrace():
  chain, params = oracles.mlp([6, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 4, (8, 6), (8, 3))
  opt = optax.adam(1e-2)
  expected, _ = oracles.sequential_steps(chain, opt, params, data)
  tx = immgrad.shim(opt)
  loss_fn = chain.loss_fn(immgrad.immediate_layer)

  chex.clear_trace_counter()

  @chex.assert_max_traces(n=1)
  def train_step(params, state, x, y):
    loss, grads = immgrad.value_and_grad(loss_fn, tx)(params, state, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  train_step = jax.jit(train_step, donate_argnums=(0, 1))
  state = tx.init(params)
  params = jax.tree.map(lambda a: a.copy(), params)  # Ours to donate.
  for i, (x, y) in enumerate(data):  # New data each call, one trace.
    old = params
    params, state, _ = train_step(params, state, x, y)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    chex.assert_trees_all_close(params, expected[i], atol=1e-6, rtol=1e-5)
