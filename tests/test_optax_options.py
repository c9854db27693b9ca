"""Optax options shaped like the params, PRNG state, and state conversion.

The shim cuts each parameter's step out of ``tx.update`` on the whole
params tree (``plan.py``), so a params-shaped mask or label tree, a
path-aware callable and a PRNG key split per leaf act as in plain optax.

References are plain ``jax.value_and_grad`` + optax on the whole tree
(``mode="current"``), or the sequential re-linearization with an
equivalent per-layer rule that needs no tree (``mode="updated"``).
Tolerance as in test_current.py (atol=1e-6, rtol=1e-5 over 8 steps:
float32 rounding of the per-parameter programs, which XLA fuses
differently from the whole-tree one); the states are in the same layout,
so they are compared leaf for leaf too. Each option makes a difference of
more than 1e-3 that the comparison would miss if it were ignored (checked
below), so these tests can fail.
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
STEPS = 8


def _setup():
  chain, params = oracles.mlp(
    [6, 16, 16, 3], jax.random.PRNGKey(0), act=jnp.tanh
  )
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 6), (8, 3))
  return chain, params, data


def _no_bias(params):
  """The transformer recipe: decay weights, not biases (a params tree)."""
  return {name: {"w": True, "b": False} for name in params}


def _path_mask(params):
  """The same mask from the parameters' paths, as Flax codebases write it."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: "'b'" not in jax.tree_util.keystr(path), params
  )


def _labels(params):
  return {name: {"w": "adam", "b": "sgd"} for name in params}


RULES = {
  "adamw_mask_tree": lambda p: optax.adamw(
    1e-2, weight_decay=0.5, mask=_no_bias(p)
  ),
  "adamw_path_mask": lambda p: optax.adamw(
    1e-2, weight_decay=0.5, mask=_path_mask
  ),
  "multi_transform_labels": lambda p: optax.multi_transform(
    {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)}, _labels(p)
  ),
  "masked_chain": lambda p: optax.chain(
    optax.masked(optax.add_decayed_weights(0.5), _no_bias(p)),
    optax.sgd(0.1, momentum=0.9),
  ),
}

# The same rules for one layer's {"w", "b"} without a params-shaped tree,
# for the sequential reference (which steps one layer at a time).
PER_LAYER = {
  "adamw_mask_tree": lambda: optax.adamw(
    1e-2, weight_decay=0.5, mask=lambda p: {"w": True, "b": False}
  ),
  "multi_transform_labels": lambda: optax.multi_transform(
    {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1)},
    lambda p: {"w": "adam", "b": "sgd"},
  ),
}

# What ignoring the option would train instead.
IGNORED = {
  "adamw_mask_tree": lambda p: optax.adamw(1e-2, weight_decay=0.5),
  "adamw_path_mask": lambda p: optax.adamw(1e-2, weight_decay=0.5),
  "multi_transform_labels": lambda p: optax.adam(1e-2),
  "masked_chain": lambda p: optax.chain(
    optax.add_decayed_weights(0.5), optax.sgd(0.1, momentum=0.9)
  ),
}


def _steps(loss_fn, tx, params, data, mode=None):
  """Trains; returns params after each step and the final optimizer state."""
  shim = mode is not None

  @jax.jit
  def step(params, state, x, y):
    if shim:
      _, grads = immgrad.value_and_grad(loss_fn, tx, mode=mode)(
        params, state, x, y
      )
    else:
      grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state, history = tx.init(params), []
  for x, y in data:
    params, state = step(params, state, x, y)
    history.append(params)
  return history, state


@pytest.mark.parametrize("name", list(RULES))
def test_current_equals_plain(name):
  chain, params, data = _setup()
  opt = RULES[name](params)
  expected, plain_state = _steps(chain.loss_fn(), opt, params, data)
  got, state = _steps(
    chain.loss_fn(immgrad.immediate_layer),
    immgrad.shim(opt),
    params,
    data,
    mode="current",
  )
  for step, (a, b) in enumerate(zip(got, expected)):
    chex.assert_trees_all_close(
      a, b, atol=ATOL, rtol=RTOL, custom_message=f"after step {step + 1}"
    )
  # The shim's state is optax's own: same tree, same values.
  chex.assert_trees_all_close(
    immgrad.shim_state_to_optax(state), plain_state, atol=ATOL, rtol=RTOL
  )
  ignored, _ = _steps(chain.loss_fn(), IGNORED[name](params), params, data)
  assert oracles.max_abs_diff(ignored[-1], expected[-1]) > 1e-3


@pytest.mark.parametrize("name", list(PER_LAYER))
def test_updated_equals_sequential_reference(name):
  chain, params, data = _setup()
  expected = oracles.sequential_steps(chain, PER_LAYER[name](), params, data)
  got = oracles.immediate_steps(
    chain.loss_fn(immgrad.immediate_layer),
    RULES[name](params),
    params,
    data,
    mode="updated",
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
  "make",
  [
    lambda: optax.noisy_sgd(0.1, eta=0.5, key=jax.random.key(3)),
    lambda: optax.chain(optax.add_noise(0.5, 0.55, key=3), optax.sgd(0.1)),
  ],
  ids=["noisy_sgd", "add_noise"],
)
def test_prng_state_draws_plain_optax_noise(make):
  """Each parameter gets the noise plain optax draws for it from its key.

  (One key per parameter in the shim would give same-shaped parameters the
  same noise.) Noise of scale 0.5 moves the weights far more than the
  tolerance, so a wrong draw fails.
  """
  chain, params, data = _setup()
  expected, plain_state = _steps(chain.loss_fn(), make(), params, data)
  got, state = _steps(
    chain.loss_fn(immgrad.immediate_layer),
    immgrad.shim(make()),
    params,
    data,
    mode="current",
  )
  chex.assert_trees_all_close(got[-1], expected[-1], atol=ATOL, rtol=RTOL)
  keys = [
    k
    for k in jax.tree.leaves(immgrad.shim_state_to_optax(state))
    if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
  ]
  plain_keys = [
    k
    for k in jax.tree.leaves(plain_state)
    if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
  ]
  assert keys and len(keys) == len(plain_keys)
  for a, b in zip(keys, plain_keys):
    np.testing.assert_array_equal(
      jax.random.key_data(a), jax.random.key_data(b)
    )
  no_noise, _ = _steps(chain.loss_fn(), optax.sgd(0.1), params, data)
  assert oracles.max_abs_diff(no_noise[-1], expected[-1]) > 1e-3


def _bitwise(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_state_converts_bitwise_both_ways():
  _, params, _ = _setup()
  opt = optax.adamw(1e-2, mask=_no_bias(params))
  plain = opt.init(params)
  plain = jax.tree.map(
    lambda x: x + 1 if x.dtype == jnp.int32 else x * 3, plain
  )
  state = immgrad.shim_state_from_optax(plain)
  assert isinstance(state, immgrad.ShimState) and int(state.rejected) == 0
  _bitwise(immgrad.shim_state_to_optax(state), plain)
  with pytest.raises(TypeError, match="already a ShimState"):
    immgrad.shim_state_from_optax(state)


@pytest.mark.parametrize(
  "direction", ["plain_then_immgrad", "immgrad_then_plain"]
)
def test_resume_mid_run_matches_the_uninterrupted_run(direction):
  """Half the steps one way, convert the state, the rest the other way."""
  chain, params, data = _setup()
  opt = optax.adamw(1e-2, weight_decay=0.5, mask=_no_bias(params))
  tx = immgrad.shim(opt)
  plain_loss, immediate_loss = (
    chain.loss_fn(),
    chain.loss_fn(immgrad.immediate_layer),
  )
  half = STEPS // 2
  uninterrupted, _ = _steps(plain_loss, opt, params, data)
  if direction == "plain_then_immgrad":
    first, state = _steps(plain_loss, opt, params, data[:half])
    resumed = immgrad.shim_state_from_optax(state)
    second = _continue(
      immediate_loss, tx, first[-1], resumed, data[half:], mode="current"
    )
  else:
    first, state = _steps(
      immediate_loss, tx, params, data[:half], mode="current"
    )
    resumed = immgrad.shim_state_to_optax(state)
    second = _continue(plain_loss, opt, first[-1], resumed, data[half:])
  for step, (a, b) in enumerate(zip(first + second, uninterrupted)):
    chex.assert_trees_all_close(
      a, b, atol=ATOL, rtol=RTOL, custom_message=f"after step {step + 1}"
    )


def _continue(loss_fn, tx, params, state, data, mode=None):
  @jax.jit
  def step(params, state, x, y):
    if mode is not None:
      _, grads = immgrad.value_and_grad(loss_fn, tx, mode=mode)(
        params, state, x, y
      )
    else:
      grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  history = []
  for x, y in data:
    params, state = step(params, state, x, y)
    history.append(params)
  return history


def test_mask_tree_under_scan_equals_unrolled():
  """A stacked parameter's layers use the mask of the stack (per layer)."""
  layers, width = 3, 5
  chain, unrolled = oracles.mlp(
    [width] * (layers + 1) + [3], jax.random.PRNGKey(0), act=jnp.tanh
  )
  data = oracles.batches(jax.random.PRNGKey(1), 4, (8, width), (8, 3))
  opt = optax.adamw(
    1e-2,
    weight_decay=0.5,
    mask={"blocks": {"w": True, "b": False}, "head": {"w": True, "b": False}},
  )
  plain_opt = optax.adamw(1e-2, weight_decay=0.5, mask=_no_bias(unrolled))
  expected, _ = _steps(chain.loss_fn(), plain_opt, unrolled, data)
  got, _ = _steps(
    oracles.scanned_loss(),
    immgrad.shim(opt),
    oracles.stacked(unrolled),
    data,
    mode="current",
  )
  chex.assert_trees_all_close(
    got[-1], oracles.stacked(expected[-1]), atol=ATOL, rtol=RTOL
  )


def test_mask_that_does_not_fit_the_params_is_a_clear_error():
  _, params, _ = _setup()
  tx = immgrad.shim(optax.adamw(1e-2, mask={"layer0": True}))
  with pytest.raises(
    ValueError,
    match=r"immgrad.shim\(chain: masked\): the "
    r"optimizer fails on these params.*tree structure",
  ):
    tx.init(params)


def test_adafactor_on_a_stack_equals_plain_or_is_refused():
  """Adafactor on a stacked (layers, 128, 256) weight.

  Without its per-tensor parts (clipping by the update's RMS, scaling by
  the parameter's RMS), it factors each layer's second moments by that
  layer's rows and columns, as plain optax does on the stack (the layer
  axis is not among the two factored ones): the scanned model trains as
  plain training of the stacked one, and as the unrolled one. With them
  (the default), plain optax takes the RMS of the whole stack, which no
  layer's step can: refused, naming the parameter. (Before, each layer
  was clipped by its own RMS: the unrolled model's step, not the stacked
  one's.)
  """
  layers, width, out = 3, 128, 256
  keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
  unrolled = {
    f"layer{i}": {"w": jax.random.normal(k, (width, width)) / 12}
    for i, k in enumerate(keys[:layers])
  }
  unrolled["head"] = {"w": jax.random.normal(keys[-1], (width, out)) / 12}
  dense = immgrad.immediate_layer(lambda x, p: x @ p["w"])

  def plain_loss(params, x, y):
    h, _ = jax.lax.scan(
      lambda h, p: (jnp.tanh(h @ p["w"]), None), x, params["blocks"]
    )
    return jnp.mean((h @ params["head"]["w"] - y) ** 2)

  def scan_loss(params, x, y):
    h, _ = immgrad.scan(
      lambda h, p: (jnp.tanh(dense(h, p)), None), x, params["blocks"]
    )
    return jnp.mean((dense(h, params["head"]) - y) ** 2)

  stacked = {
    "blocks": jax.tree.map(
      lambda *a: jnp.stack(a), *[unrolled[f"layer{i}"] for i in range(layers)]
    ),
    "head": unrolled["head"],
  }
  data = oracles.batches(jax.random.PRNGKey(1), 4, (8, width), (8, out))
  opt = optax.adafactor(
    1e-2, multiply_by_parameter_scale=False, clipping_threshold=None
  )
  expected, _ = _steps(plain_loss, opt, stacked, data)
  got, state = _steps(
    scan_loss, immgrad.shim(opt), stacked, data, mode="current"
  )
  chex.assert_trees_all_close(got, expected, atol=ATOL, rtol=RTOL)
  factored = [leaf.shape for leaf in jax.tree.leaves(state.inner)]
  assert (layers, width) in factored  # Row statistics, one set per layer.

  tx = immgrad.shim(optax.adafactor(1e-2))
  x, y = data[0]
  with pytest.raises(ValueError, match=r"\['blocks'\]\['w'\] differently"):
    immgrad.value_and_grad(scan_loss, tx)(stacked, tx.init(stacked), x, y)


def test_adafactor_factoring_the_layer_axis_is_refused():
  """(200, 256, 128): optax factors the stack over its layer axis."""
  params = {"blocks": {"w": jnp.zeros((200, 256, 128))}}
  dense = immgrad.immediate_layer(lambda x, p: x @ p["w"])

  def loss_fn(params, x):
    h, _ = immgrad.scan(
      lambda h, p: (dense(h, p)[:, :128], None), x, params["blocks"]
    )
    return jnp.sum(h)

  tx = immgrad.shim(optax.adafactor(1e-2))
  with pytest.raises(
    ValueError,
    match=r"stacked parameter \['blocks'\]"
    r"\['w'\].*unroll them",
  ):
    jax.eval_shape(
      immgrad.value_and_grad(loss_fn, tx),
      params,
      tx.init(params),
      jax.ShapeDtypeStruct((2, 256), jnp.float32),
    )
