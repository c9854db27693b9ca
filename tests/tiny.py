"""A three-layer model of immediate dense layers, shared by small tests."""

import jax
import jax.numpy as jnp
import optax

import immgrad


@immgrad.immediate_layer
def dense(x, p):
  return x @ p["w"] + p["b"]


def params():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  return {
    "l1": {"w": jax.random.normal(k1, (4, 4)) / 2, "b": jnp.full((4,), 0.1)},
    "l2": {"w": jax.random.normal(k2, (4, 4)) / 2, "b": jnp.full((4,), 0.2)},
    "l3": {"w": jax.random.normal(k3, (4, 2)) / 2, "b": jnp.full((2,), 0.3)},
  }


def data():
  return jnp.linspace(-1, 1, 32).reshape(8, 4), jnp.ones((8, 2))


def train_step(loss_fn, opt=None, jit=True):
  tx = immgrad.shim(opt or optax.adam(1e-2))

  def step(params, state, *batch):
    _, grads = immgrad.value_and_grad(loss_fn, tx)(params, state, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return tx, (jax.jit(step) if jit else step)
