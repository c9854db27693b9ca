"""Immediate layers under ``jax.vmap``: one step per layer, on the batch.

A per-example model under ``jax.vmap`` (Equinox's idiom, ``hk.vmap``) must
step each layer once, from the gradient of the whole batch, exactly as
plain training does: never once per example, never a sum of new weights
(which is what a ``custom_vjp`` under ``vmap`` alone would give, B times
the weights). References: plain ``jax.value_and_grad`` + optax of the same
model with undecorated layers (``mode="current"``), and the sequential
re-linearization on the whole batch (``mode="updated"``,
``oracles.sequential_steps``). Both never call immgrad.

Tolerance: atol=1e-6, rtol=1e-5 over 5 steps, as in tests/test_current.py:
float32 rounding of differently fused programs (the layer's batched dW is
one dot_general over the batch, plain training's the transpose of vmap's;
they differ by an ulp or two). A sum of per-example steps would be off by
the size of the weights.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import immgrad
import oracles

ATOL, RTOL = 1e-6, 1e-5
STEPS = 5
SIZES = (5, 8, 8, 3)
dense = immgrad.immediate_layer(oracles.dense, name="dense")


def _setup(key=0, batch=(8,)):
  chain, params = oracles.mlp(SIZES, jax.random.PRNGKey(key))
  data = oracles.batches(
    jax.random.PRNGKey(key + 1),
    STEPS,
    batch + (SIZES[0],),
    batch + (SIZES[-1],),
  )
  return chain, params, data


def _per_example(layer, params, row):
  """The MLP on one example, as Equinox and ``hk.vmap`` users write it."""
  h = row
  for i in range(len(SIZES) - 1):
    h = layer(h, params[f"layer{i}"])
    if i < len(SIZES) - 2:
      h = jax.nn.relu(h)
  return h


def _vmapped_loss(layer, how):
  """The MSE loss of the per-example MLP, vmapped over the batch ``how``."""

  def loss_fn(params, x, y):
    if how == "closure":
      out = jax.vmap(lambda row: _per_example(layer, params, row))(x)
    elif how == "in_axes_none":
      out = jax.vmap(
        lambda p, row: _per_example(layer, p, row), in_axes=(None, 0)
      )(params, x)
    elif how == "nested":  # x: (4, 2, features), two vmaps deep.
      out = jax.vmap(jax.vmap(lambda row: _per_example(layer, params, row)))(x)
    elif how == "in_axes_1":  # The batch on axis 1 in and out.
      out = jax.vmap(
        lambda row: _per_example(layer, params, row), in_axes=1, out_axes=1
      )(x.T).T
    return oracles.mse(out, y)

  return loss_fn


def _batch(how):
  return (4, 2) if how == "nested" else (8,)


@pytest.mark.parametrize(
  "how, opt",
  [
    ("closure", "sgd"),
    ("closure", "adam"),
    ("in_axes_none", "sgd"),
    ("nested", "adam"),
    ("in_axes_1", "adam"),
  ],
)
def test_current_under_vmap_equals_plain_training(how, opt):
  opt = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-2)}[opt]
  _, params, data = _setup(batch=_batch(how))
  expected = oracles.plain_steps(
    _vmapped_loss(oracles.dense, how), opt, params, data
  )
  got = oracles.immediate_steps(
    _vmapped_loss(dense, how), opt, params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("how", ["closure", "nested"])
def test_updated_under_vmap_equals_sequential_on_the_batch(how):
  """dX at the new weights, for the whole batch: the batched reference."""
  chain, params, data = _setup(batch=_batch(how))
  opt = optax.adam(1e-2)
  expected = oracles.sequential_steps(chain, opt, params, data)
  got = oracles.immediate_steps(
    _vmapped_loss(dense, how), opt, params, data, mode="updated"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_every_layer_is_stepped_once_by_its_layer():
  _, params, data = _setup()
  tx = immgrad.shim(optax.sgd(0.1))
  _, grads = immgrad.value_and_grad(
    _vmapped_loss(dense, "closure"), tx, mode="current"
  )(params, tx.init(params), *data[0])
  kinds = jax.tree.leaves(
    grads, is_leaf=lambda g: isinstance(g, immgrad.ImmediateGrad)
  )
  assert all(isinstance(g, immgrad.ImmediateGrad) for g in kinds), kinds
  # The gradient it stepped with is the whole batch's, as plain training's.
  plain = jax.grad(_vmapped_loss(oracles.dense, "closure"))(params, *data[0])
  chex.assert_trees_all_close(
    [g.grad for g in kinds], jax.tree.leaves(plain), atol=ATOL, rtol=RTOL
  )


def _centred_loss(layer):
  """A model with a collective over the vmap axis, outside the layers."""

  def loss_fn(params, x, y):
    def per_example(row):
      h = jax.nn.relu(layer(row, params["layer0"]))
      h = h - jax.lax.pmean(h, "batch")  # Centre over the batch.
      return layer(h, params["layer1"])

    out = jax.vmap(per_example, axis_name="batch")(x)
    return oracles.mse(out, y)

  return loss_fn


def test_vmap_axis_name_with_a_collective_in_the_model():
  _, params, data = _setup()
  params = {k: params[k] for k in ("layer0", "layer1")}
  params["layer1"] = {
    "w": params["layer1"]["w"][:, :3],
    "b": params["layer1"]["b"][:3],
  }
  opt = optax.adam(1e-2)
  expected = oracles.plain_steps(
    _centred_loss(oracles.dense), opt, params, data
  )
  got = oracles.immediate_steps(
    _centred_loss(dense), opt, params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def _stacked_loss(layer, scan, checkpoint):
  """vmap inside a scanned block, and inside a rematerialised block."""

  def loss_fn(params, x, y):
    def block(h, p):
      return jax.vmap(lambda row: jnp.tanh(layer(row, p)))(h), None

    h, _ = scan(block, x, params["blocks"])
    head = checkpoint(lambda h, p: jax.vmap(lambda row: layer(row, p))(h))
    return oracles.mse(head(h, params["head"]), y)

  return loss_fn


@pytest.mark.parametrize("mode", ["current", "updated"])
def test_vmap_inside_immgrad_scan_and_checkpoint(mode):
  keys = jax.random.split(jax.random.PRNGKey(3), 3)
  params = {
    "blocks": {
      "w": jax.random.normal(keys[0], (3, 5, 5)) / 5**0.5,
      "b": 0.1 * jax.random.normal(keys[1], (3, 5)),
    },
    "head": {
      "w": jax.random.normal(keys[2], (5, 3)) / 5**0.5,
      "b": jnp.zeros(3),
    },
  }
  data = oracles.batches(jax.random.PRNGKey(4), STEPS, (8, 5), (8, 3))
  opt = optax.adam(1e-2)
  got = oracles.immediate_steps(
    _stacked_loss(dense, immgrad.scan, immgrad.checkpoint),
    opt,
    params,
    data,
    mode=mode,
  )
  if mode == "current":
    expected = oracles.plain_steps(
      _stacked_loss(oracles.dense, jax.lax.scan, jax.checkpoint),
      opt,
      params,
      data,
    )
  else:  # The same layers unrolled, walked from the last one.
    names = ("block0", "block1", "block2", "head")
    unrolled = {
      f"block{i}": jax.tree.map(lambda a, i=i: a[i], params["blocks"])
      for i in range(3)
    }
    unrolled["head"] = params["head"]
    chain = oracles.Chain(
      (oracles.dense,) * 4,
      names,
      (jnp.tanh,) * 3 + (oracles.identity,),
      oracles.mse,
    )
    history, losses = oracles.sequential_steps(chain, opt, unrolled, data)
    restack = lambda p: {
      "blocks": jax.tree.map(
        lambda *a: jnp.stack(a), *[p[n] for n in names[:3]]
      ),
      "head": p["head"],
    }
    expected = [restack(p) for p in history], losses
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_atomic_step_under_vmap_rejects_a_nonfinite_batch():
  _, params, data = _setup()
  x, y = data[0]
  x = x.at[3, 0].set(jnp.nan)  # One bad example poisons the batch gradient.
  tx = immgrad.shim(optax.adam(1e-2))
  state = tx.init(params)
  loss, grads = immgrad.value_and_grad(_vmapped_loss(dense, "closure"), tx)(
    params, state, x, y
  )
  updates, new_state = tx.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert not jnp.isfinite(loss)
  assert int(new_state.rejected) == 1
  chex.assert_trees_all_equal(new, params)
  chex.assert_trees_all_equal(new_state.inner, state.inner)


# -- what is still refused -------------------------------------------------


def _loss_of(where):
  def loss_fn(params, x, y):
    return oracles.mse(where(params, x), y)

  return loss_fn


def _stacked_params_mapped(params, x):
  stacked = jax.tree.map(
    lambda a: jnp.stack([a] * x.shape[0]), params["layer0"]
  )
  return jax.vmap(lambda p, row: dense(row, p))(stacked, x)[:, :3]


def _per_example_weights(params, x):  # The weights mapped, not the data.
  return jax.vmap(lambda w: dense(x[0], {"w": w, "b": params["layer0"]["b"]}))(
    jnp.stack([params["layer0"]["w"]] * 8)
  )[:, :3]


def _vmap_in_lax_scan(params, x):
  def body(h, _):
    return jax.vmap(lambda row: dense(row, params["layer1"]))(h), None

  h = jax.nn.relu(jax.vmap(lambda r: dense(r, params["layer0"]))(x))
  return jax.lax.scan(body, h, None, length=2)[0][:, :3]


def _lax_scan_in_vmap(params, x):
  def per_example(row):
    h = jax.nn.relu(dense(row, params["layer0"]))
    body = lambda h, _: (dense(h, params["layer1"]), None)
    return jax.lax.scan(body, h, None, length=2)[0][:3]

  return jax.vmap(per_example)(x)


def _cond_in_vmap(params, x):
  return jax.vmap(
    lambda row: jax.lax.cond(
      row[0] > 0,
      lambda r: dense(r, params["layer0"]),
      lambda r: jnp.zeros(8),
      row,
    )
  )(x)[:, :3]


def _jit_in_vmap(params, x):
  return jax.vmap(jax.jit(lambda row: dense(row, params["layer0"])))(x)[:, :3]


def _checkpoint_in_vmap(params, x):
  return jax.vmap(jax.checkpoint(lambda row: dense(row, params["layer0"])))(x)[
    :, :3
  ]


def _vmap_around_immgrad_scan(params, x):
  def per_example(row):
    h = jax.nn.relu(dense(row, params["layer0"]))
    return immgrad.scan(lambda h, p: (dense(h, p), None), h, params["blocks"])[
      0
    ][:3]

  return jax.vmap(per_example)(x)


def _vmap_around_immgrad_checkpoint(params, x):
  block = immgrad.checkpoint(lambda h, p: dense(h, p))
  return jax.vmap(lambda row: block(row, params["layer0"])[:3])(x)


def _input_not_mapped(params, x):  # The layer's input ignores the vmap axis.
  return jax.vmap(
    lambda row: dense(jnp.ones(5), params["layer0"])[:3] * row[0]
  )(x)


@pytest.mark.parametrize(
  "where, match",
  [
    (_stacked_params_mapped, "mapped by jax.vmap.*in_axes=None"),
    (_per_example_weights, "mapped by jax.vmap.*close over"),
    (_vmap_in_lax_scan, "inside a transformation.*lax.scan called at"),
    (_lax_scan_in_vmap, "inside a transformation.*lax.scan called at"),
    (_cond_in_vmap, "inside a transformation.*lax.cond called at"),
    (_jit_in_vmap, "inside a transformation.*jax.jit called at"),
    (_checkpoint_in_vmap, "inside a transformation.*jax.checkpoint called at"),
    (_vmap_around_immgrad_scan, "'immgrad.scan' was called on parameter"),
    (
      _vmap_around_immgrad_checkpoint,
      "'immgrad.checkpoint' was called on parameter",
    ),
    (
      _input_not_mapped,
      "inside a transformation.*jax.vmap called at "
      r"test_vmap.py:\d+.*maps none of the layer's inputs.*"
      r"self.position.weight",
    ),
  ],
  ids=[
    "stacked_params",
    "per_example_weights",
    "vmap_in_lax_scan",
    "lax_scan_in_vmap",
    "cond_in_vmap",
    "jit_in_vmap",
    "checkpoint_in_vmap",
    "vmap_around_immgrad_scan",
    "vmap_around_immgrad_checkpoint",
    "input_not_mapped",
  ],
)
def test_what_is_still_refused(where, match):
  _, params, data = _setup()
  params["blocks"] = jax.tree.map(lambda a: a[None], params["layer1"])
  tx = immgrad.shim(optax.sgd(0.1))
  step = immgrad.value_and_grad(_loss_of(where), tx)
  with pytest.raises(ValueError, match=match):
    step(params, tx.init(params), *data[0])
