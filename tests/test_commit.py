"""The shim commits, bit for bit, the weights each layer took dX at.

An immediate layer steps its weights in its backward rule (``dX`` at the
new weights in ``mode="updated"``); the shim steps them again from the same
gradient, state and weights to commit the step. These tests observe both
exactly: the layer is ``x @ w`` with an output cotangent ``C`` whose rows
are one-hot, so ``dX = C @ w_new.T`` holds each new weight as a product with
1 plus sums of exact zeros, i.e. bit for bit; ``x`` is an ordinary
parameter, so ``dX`` comes back as its gradient. No tolerance anywhere.

The shim hands its new weights ``new`` to optax as the update
``new - p`` (``-0.0`` where they are equal), which ``optax.apply_updates``
turns back into ``new`` exactly unless the step is large against the weight
(see ``test_shim.py``). So the tests check that the weights committed are
``p + landing(used)`` with ``used`` the weights dX was taken at, which holds
only if the shim's ``new`` is ``used``; and that they land on ``used``
itself almost everywhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad

# Bit for bit as XLA compiles by default (tests/xla_flags.py).
pytestmark = pytest.mark.xla_defaults

N, M = 6, 4  # x: (N, N), w: (N, M); C: (N, M) with C[i, i] = 1.

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.3),
  "momentum": lambda: optax.sgd(0.3, momentum=0.9, nesterov=True),
  "adam": lambda: optax.adam(0.05),
  "adamw": lambda: optax.adamw(optax.cosine_decay_schedule(0.05, 10)),
  "lion": lambda: optax.lion(0.01),
  "rmsprop": lambda: optax.rmsprop(0.01),
  "adafactor": lambda: optax.adafactor(0.05),
  "clipped adam": lambda: optax.chain(
    immgrad.clip_by_layer_norm(0.5), optax.adam(0.05)
  ),
  "injected": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=0.05),
}

layer = immgrad.immediate_layer(lambda x, p: x @ p["w"])


def _cotangent():
  return jnp.eye(N, M)


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {
    "x": jax.random.normal(k1, (N, N)),
    "layer": {"w": jax.random.normal(k2, (N, M))},
  }


def _loss(params):
  # Linear in y, so d loss / d y is exactly C; x feeds only the layer, so
  # its gradient is exactly the layer's dX.
  return jnp.sum(layer(params["x"], params["layer"]) * _cotangent())


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_committed_weights_are_those_dx_was_taken_at(name, atomic):
  tx = immgrad.shim(OPTIMIZERS[name](), atomic=atomic)
  grad_fn = immgrad.value_and_grad(_loss, tx, mode="updated")

  @jax.jit
  def step(params, state):
    _, grads = grad_fn(params, state)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    # dX = C @ w_new.T, so rows :M of dX are w_new.T, exactly.
    used = grads["x"][:M].T
    return new, state, used, _landed(params["layer"]["w"], used)

  params, state = _params(), tx.init(_params())
  exact = 0
  for i in range(6):
    before = params["layer"]["w"]
    params, state, used, landed = step(params, state)
    np.testing.assert_array_equal(
      params["layer"]["w"], landed, err_msg=f"{name}, step {i + 1}"
    )
    assert not np.array_equal(used, before)  # The weights did move.
    exact += int(np.sum(params["layer"]["w"] == used))
  assert exact >= 0.9 * 6 * N * M, exact


def _landed(p, new):
  """What ``optax.apply_updates`` makes of the shim's update to ``new``."""
  return p + jnp.where(new == p, -0.0, new - p)


def test_stacked_layers_commit_what_each_layer_used():
  """Under immgrad.scan: layer i's input is slice i of an ordinary stacked
  parameter, so its gradient is layer i's dX, exactly.
  """
  layers = 3
  tx = immgrad.shim(optax.adam(0.05))

  def loss(params):
    def body(carry, xs):
      x, p = xs
      return carry + jnp.sum(layer(x, p) * _cotangent()), None

    total, _ = immgrad.scan(body, 0.0, (params["x"], params["blocks"]))
    return total

  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  params = {
    "x": jax.random.normal(k1, (layers, N, N)),
    "blocks": {"w": jax.random.normal(k2, (layers, N, M))},
  }
  grad_fn = immgrad.value_and_grad(loss, tx, mode="updated")

  @jax.jit
  def step(params, state):
    _, grads = grad_fn(params, state)
    updates, state = tx.update(grads, state, params)
    used = jnp.swapaxes(grads["x"][:, :M], 1, 2)
    return (
      optax.apply_updates(params, updates),
      state,
      used,
      _landed(params["blocks"]["w"], used),
    )

  state = tx.init(params)
  for _ in range(4):
    before = params["blocks"]["w"]
    params, state, used, landed = step(params, state)
    np.testing.assert_array_equal(params["blocks"]["w"], landed)
    assert not np.any(np.all(used == before, axis=(1, 2)))  # Each moved.
