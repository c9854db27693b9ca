"""mode="updated" equals the hand-written sequential re-linearization.

The reference (oracles.sequential_steps) walks the layers from last to
first with jax.vjp and optax: dW at the old weights, the layer's own optax
step, then dX at the new weights. Same tolerance and reasoning as
test_current.py (atol=1e-6, rtol=1e-5: a few dozen float32 ulps from XLA
fusing the optimizer differently); the same models trained with dX from the
old weights land more than 1e-3 away, which the last test checks, so a
mode that silently fell back to "current" fails here.
"""

import jax
import optax
import pytest

import immgrad
import oracles

ATOL, RTOL = 1e-6, 1e-5

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.05),
  "momentum": lambda: optax.sgd(0.05, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
}


def _setup(act):
  chain, params = oracles.mlp(
    [6, 16, 16, 16, 3], jax.random.PRNGKey(0), act=act
  )
  data = oracles.batches(jax.random.PRNGKey(1), 5, (8, 6), (8, 3))
  return chain, params, data


@pytest.mark.parametrize(
  "act", [jax.nn.relu, jax.numpy.tanh], ids=["relu", "tanh"]
)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updated_equals_sequential_relinearization(name, act):
  chain, params, data = _setup(act)
  opt = OPTIMIZERS[name]()
  expected = oracles.sequential_steps(chain, opt, params, data)
  got = oracles.immediate_steps(
    chain.loss_fn(immgrad.immediate_layer), opt, params, data, mode="updated"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_updated_differs_from_current(name):
  """The two modes train measurably apart: the tests above can fail."""
  chain, params, data = _setup(jax.nn.relu)
  opt = OPTIMIZERS[name]()
  loss_fn = chain.loss_fn(immgrad.immediate_layer)
  updated, _ = oracles.immediate_steps(
    loss_fn, opt, params, data, mode="updated"
  )
  current, _ = oracles.immediate_steps(
    loss_fn, opt, params, data, mode="current"
  )
  assert oracles.max_abs_diff(updated[-1], current[-1]) > 1e-3
