"""The decorator outside a step, its options, has_aux, integer inputs.

Errors for bad calls are in test_bad_input.py.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import immgrad


def affine(x, p):
  return x @ p["w"] + p["b"]


PARAMS = {"w": jnp.arange(6.0).reshape(3, 2) / 6, "b": jnp.ones(2)}
X = jnp.linspace(-1, 1, 12).reshape(4, 3)


@pytest.mark.parametrize(
  "decorate",
  [
    immgrad.immediate_layer,
    immgrad.immediate_layer(name="affine"),
    immgrad.immediate_layer(),
  ],
  ids=["bare", "named", "empty_options"],
)
def test_outside_a_step_the_layer_is_fun(decorate):
  layer = decorate(affine)
  loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(x, p)))
  chex.assert_trees_all_equal(layer(X, PARAMS), affine(X, PARAMS))
  chex.assert_trees_all_equal(
    jax.grad(loss(layer))(PARAMS, X), jax.grad(loss(affine))(PARAMS, X)
  )
  chex.assert_trees_all_equal(
    jax.jit(jax.grad(loss(layer)))(PARAMS, X),
    jax.jit(jax.grad(loss(affine)))(PARAMS, X),
  )


def test_layer_name_appears_in_errors():
  layer = immgrad.immediate_layer(affine, name="encoder/dense_3")
  tx = immgrad.shim(optax.sgd(0.1))

  def loss_fn(params, x):
    return jnp.sum(layer(x, {"w": 2 * params["w"], "b": params["b"]}))

  with pytest.raises(ValueError, match="'encoder/dense_3'"):
    immgrad.value_and_grad(loss_fn, tx)(PARAMS, tx.init(PARAMS), X)


def test_has_aux():
  layer = immgrad.immediate_layer(affine)
  tx = immgrad.shim(optax.sgd(0.1))

  def loss_fn(params, x):
    y = layer(x, params)
    return jnp.mean(y**2), {"mean": jnp.mean(y)}

  (loss, aux), grads = immgrad.value_and_grad(loss_fn, tx, has_aux=True)(
    PARAMS, tx.init(PARAMS), X
  )
  y = affine(X, PARAMS)
  chex.assert_trees_all_close(loss, jnp.mean(y**2))
  chex.assert_trees_all_close(aux["mean"], jnp.mean(y))
  assert isinstance(grads["w"], immgrad.ImmediateGrad)


def test_integer_inputs_pass_through():
  """An embedding lookup: x is integer, its cotangent is float0."""
  embed = immgrad.immediate_layer(lambda ids, p: p["table"][ids])
  tx = immgrad.shim(optax.sgd(1.0))
  params = {"table": jnp.arange(8.0).reshape(4, 2)}
  ids = jnp.array([0, 2, 2])
  state = tx.init(params)
  _, grads = jax.jit(
    immgrad.value_and_grad(lambda p, i: jnp.sum(embed(i, p)), tx)
  )(params, state, ids)
  updates, _ = tx.update(grads, state, params)
  expected = params["table"] - jnp.array([[1, 1], [0, 0], [2, 2], [0, 0]])
  chex.assert_trees_all_equal(
    optax.apply_updates(params, updates)["table"], expected
  )
