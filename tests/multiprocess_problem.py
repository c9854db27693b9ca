"""The model, data and optimizer of the multi-process test, shared by the
worker processes and the single-process reference.
"""

import jax
import optax

import immgrad
import oracles

MODE = "updated"
CHAIN, _PARAMS = oracles.mlp([8, 16, 16, 4], jax.random.PRNGKey(0))
loss_fn = CHAIN.loss_fn(immgrad.immediate_layer)


def params():
  return jax.device_get(_PARAMS)


def optimizer():
  return optax.adam(1e-2)


def batches():
  return jax.device_get(
    oracles.batches(jax.random.PRNGKey(1), 3, (16, 8), (16, 4))
  )
