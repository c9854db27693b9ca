"""mode="current" reproduces ordinary training: jax.value_and_grad + optax.

Tolerance: parameters are O(1) and float32 (eps 1.2e-7). The arithmetic is
the same, but XLA fuses the optimizer step differently when it runs inside
the backward pass (FMA contraction, a division folded into a multiply), so
an element can differ by an ulp or two per step, and five steps through the
chain rule grow that to a few dozen ulps. atol=1e-6, rtol=1e-5 allows that
and nothing more: the smallest real difference we guard against, dX from
the updated weights, moves these models by more than 1e-3 in five steps
(checked in test_updated.py).
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import immgrad
import models
import oracles

ATOL, RTOL = 1e-6, 1e-5

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.05),
  "momentum": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
  "adam": lambda: optax.adam(1e-2),
  "adamw_schedule": lambda: optax.adamw(
    optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5), weight_decay=1e-2
  ),
  "adafactor": lambda: optax.adafactor(1e-2),
  "lion": lambda: optax.lion(1e-3),
  "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.5),
  "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
    learning_rate=optax.linear_schedule(1e-2, 1e-3, 5)
  ),
  # Per-layer gradient norms: per parameter leaf, so per-leaf state is
  # right (once refused, because a cond in its update looked coupling).
  "novograd": lambda: optax.novograd(1e-2),
}


def _mlp():
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 5, (8, 6), (8, 3))
  return (chain.loss_fn(), chain.loss_fn(immgrad.immediate_layer), params, data)


def _mixed():
  return (
    models.loss_fn(),
    models.loss_fn(immgrad.immediate_layer),
    models.init(jax.random.PRNGKey(2)),
    models.batches(jax.random.PRNGKey(3), 5),
  )


@pytest.mark.parametrize("model", [_mlp, _mixed], ids=["mlp", "mixed"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_current_equals_plain_training(model, name):
  plain_loss, immediate_loss, params, data = model()
  opt = OPTIMIZERS[name]()
  expected = oracles.plain_steps(plain_loss, opt, params, data)
  got = oracles.immediate_steps(
    immediate_loss, opt, params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.xla_defaults
@pytest.mark.parametrize("name", ["sgd", "momentum"])
def test_first_step_new_weights_are_bitwise(name):
  """One step from the same weights: the same float operations.

  Only for rules whose step XLA compiles to the same instructions in both
  programs; adam's square root and division fuse differently when the
  step is taken one parameter at a time (within the tolerance above, not
  bitwise). The shim hands its new weights ``new`` to optax as the update
  ``new - p`` (``-0.0`` where equal), which lands on ``new`` exactly unless
  the step is large against the weight; so the weights must be plain
  training's new weights, landed that way.
  """
  plain_loss, immediate_loss, params, data = _mlp()
  opt = OPTIMIZERS[name]()
  expected, _ = oracles.plain_steps(plain_loss, opt, params, data[:1])
  got, _ = oracles.immediate_steps(
    immediate_loss, opt, params, data[:1], mode="current"
  )
  landed = jax.tree.map(
    lambda p, new: p + jnp.where(new == p, -0.0, new - p), params, expected[0]
  )
  chex.assert_trees_all_equal(got[0], landed)
