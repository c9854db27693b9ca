"""``mode=a`` (dX at ``W + a * (W_new - W)``) and ``measure_dx``.

References are built without immgrad: ``oracles.sequential_steps`` walks
the layers last to first, steps each with optax and takes dX at
``W + a * (W_new - W)``, and measures ``|dX(W_new) - dX(W)| / |dX(W)|`` on
the ``dz`` the layer received. Tolerance as in test_updated.py (atol=1e-6,
rtol=1e-5 over 5 steps: float32 rounding of differently fused programs);
the measurements are ratios of norms, compared with rtol=1e-4 (a norm of a
difference of two nearly equal dX's loses a few more bits). ``a = 0`` and
``a = 1`` must be the two named modes bit for bit: the same program.
Measuring must not change training: the weights after 5 steps agree to
MEASURED_RTOL=1e-6 and MEASURED_ATOL=1e-7, a few float32 ulps (eps
1.2e-7; the atol an ulp of a unit weight, for entries near zero that a
rounding difference in a sum moves by more, relatively). Not bit for bit: the
extra dX product can change how XLA fuses the step's arithmetic, which
moved weights by one ulp (8.7e-8 relative) on jax 0.7.0's CPU and (2.5e-7)
on an H200 GPU, while jax 0.10.2's CPU gave identical bits.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
import oracles

ATOL, RTOL = 1e-6, 1e-5
CHANGE_RTOL = 1e-4
MEASURED_RTOL, MEASURED_ATOL = 1e-6, 1e-7


def _setup():
  chain, params = oracles.mlp(
    [6, 16, 16, 3], jax.random.PRNGKey(0), act=jnp.tanh
  )
  data = oracles.batches(jax.random.PRNGKey(1), 5, (8, 6), (8, 3))
  return chain, params, data


def _bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
  "a, name",
  [(0, "current"), (1, "updated"), (0.0, "current"), (1.0, "updated")],
)
def test_endpoints_are_the_named_modes_bitwise(a, name):
  chain, params, data = _setup()
  loss_fn = chain.loss_fn(immgrad.immediate_layer)
  opt = optax.adam(1e-2)
  got = oracles.immediate_steps(loss_fn, opt, params, data, mode=a)
  expected = oracles.immediate_steps(loss_fn, opt, params, data, mode=name)
  _bitwise(got, expected)


@pytest.mark.parametrize("a", [0.5, -0.5, 1.7])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_fraction_equals_sequential_reference(a, opt_name):
  chain, params, data = _setup()
  opt = optax.sgd(0.2) if opt_name == "sgd" else optax.adam(1e-2)
  expected = oracles.sequential_steps(chain, opt, params, data, at=a)
  got = oracles.immediate_steps(
    chain.loss_fn(immgrad.immediate_layer), opt, params, data, mode=a
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  # The fraction is really used: a = 0 and a = 1 land measurably apart.
  for other in (0.0, 1.0):
    away = oracles.sequential_steps(chain, opt, params, data, at=other)
    assert oracles.max_abs_diff(got[0][-1], away[0][-1]) > 1e-4


def _measured_steps(loss_fn, opt, params, data, mode):
  tx = immgrad.shim(opt)

  @jax.jit
  def step(params, state, x, y):
    loss, grads, change = immgrad.value_and_grad(
      loss_fn, tx, mode=mode, measure_dx=True
    )(params, state, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, change

  state, changes = tx.init(params), []
  for x, y in data:
    params, state, change = step(params, state, x, y)
    changes.append(change)
  return params, changes


@pytest.mark.parametrize("mode", ["current", "updated", 0.5])
def test_measure_dx_equals_reference(mode):
  chain, params, data = _setup()
  opt = optax.sgd(0.2)
  at = {"current": 0.0, "updated": 1.0}.get(mode, mode)
  *_, expected = oracles.sequential_steps(
    chain, opt, params, data, at=at, measure=True
  )
  final, got = _measured_steps(
    chain.loss_fn(immgrad.immediate_layer), opt, params, data, mode
  )
  for step, (g, e) in enumerate(zip(got, expected)):
    for name in chain.names:
      assert float(e[name]) > 1e-3  # A real change, not a zero to match.
      for leaf in ("w", "b"):  # Every leaf of the layer holds its value.
        np.testing.assert_allclose(
          g[name][leaf],
          e[name],
          rtol=CHANGE_RTOL,
          err_msg=f"step {step + 1}, {name}",
        )
  # Measuring changes nothing about the training itself (but rounding).
  trained = oracles.immediate_steps(
    chain.loss_fn(immgrad.immediate_layer), opt, params, data, mode=mode
  )
  chex.assert_trees_all_close(
    final, trained[0][-1], rtol=MEASURED_RTOL, atol=MEASURED_ATOL
  )


def test_measure_dx_per_layer_of_a_scan():
  """A stacked parameter reports one value per layer, as if unrolled."""
  layers, width = 3, 5
  chain, unrolled = oracles.mlp(
    [width] * (layers + 1) + [3], jax.random.PRNGKey(0), act=jnp.tanh
  )
  scan_loss = oracles.scanned_loss()
  stacked = oracles.stacked(unrolled)
  data = oracles.batches(jax.random.PRNGKey(1), 3, (8, width), (8, 3))
  opt = optax.sgd(0.2)
  *_, expected = oracles.sequential_steps(
    chain, opt, unrolled, data, at=1.0, measure=True
  )
  _, got = _measured_steps(scan_loss, opt, stacked, data, "updated")
  for g, e in zip(got, expected):
    assert g["blocks"]["w"].shape == (layers,)
    np.testing.assert_allclose(
      g["blocks"]["w"],
      [e[f"layer{i}"] for i in range(layers)],
      rtol=CHANGE_RTOL,
    )
    np.testing.assert_allclose(
      g["head"]["b"], e[f"layer{layers}"], rtol=CHANGE_RTOL
    )


def test_measure_dx_leaves_ordinary_parameters_none():
  def loss_fn(params, x):
    h = immgrad.immediate_layer(oracles.dense)(x, params["layer"])
    return jnp.mean((h * params["scale"]) ** 2)

  params = {
    "layer": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)},
    "scale": jnp.ones(3),
  }
  tx = immgrad.shim(optax.sgd(0.1))
  _, _, change = immgrad.value_and_grad(loss_fn, tx, measure_dx=True)(
    params, tx.init(params), jnp.ones((4, 2))
  )
  assert change["scale"] is None
  chex.assert_shape(change["layer"]["w"], ())


@pytest.mark.parametrize(
  "bad", ["update", "", True, float("nan"), float("inf"), None, [0.5]]
)
def test_bad_mode_is_a_clear_error(bad):
  tx = immgrad.shim(optax.sgd(0.1))
  with pytest.raises(ValueError, match="mode must be"):
    immgrad.value_and_grad(lambda p: jnp.sum(p), tx, mode=bad)


def test_measure_dx_through_checkpoint():
  """immgrad.checkpoint carries the probe: the values of the plain model."""
  chain, params, data = _setup()
  dense = immgrad.immediate_layer(oracles.dense)

  def loss_fn(remat):
    block = lambda h, p: jnp.tanh(dense(h, p))
    block = immgrad.checkpoint(block) if remat else block

    def loss(params, x, y):
      h = block(block(x, params["layer0"]), params["layer1"])
      return oracles.mse(dense(h, params["layer2"]), y)

    return loss

  opt = optax.sgd(0.2)
  _, got = _measured_steps(loss_fn(True), opt, params, data, "updated")
  *_, expected = oracles.sequential_steps(
    chain, opt, params, data, measure=True
  )
  for g, e in zip(got, expected):
    for name in chain.names:
      np.testing.assert_allclose(g[name]["w"], e[name], rtol=CHANGE_RTOL)


def test_measure_dx_of_a_layer_with_integer_input_is_zero():
  """An embedding's token ids have no dX (float0): nothing to change."""
  embed = immgrad.immediate_layer(lambda ids, p: p["table"][ids])
  dense = immgrad.immediate_layer(oracles.dense)

  def loss_fn(params, ids):
    return jnp.mean(dense(embed(ids, params["embed"]), params["out"]) ** 2)

  params = {
    "embed": {"table": jnp.linspace(-1, 1, 12).reshape(4, 3)},
    "out": {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)},
  }
  tx = immgrad.shim(optax.sgd(0.5))
  _, _, change = immgrad.value_and_grad(loss_fn, tx, measure_dx=True)(
    params, tx.init(params), jnp.array([0, 2, 3])
  )
  assert float(change["embed"]["table"]) == 0.0
  assert float(change["out"]["w"]) > 1e-3
