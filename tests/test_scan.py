"""immgrad.scan and immgrad.checkpoint (raw JAX) against unrolled references.

A stack of dense layers scanned with ``immgrad.scan`` must train exactly as
the same layers unrolled: ``mode="current"`` as plain ``jax.value_and_grad``
+ optax on the unrolled model, ``mode="updated"`` as the sequential
re-linearization. ``immgrad.checkpoint`` must change nothing and run each
update once. Tolerance as in test_current.py (atol=1e-6, rtol=1e-5 over 5
steps: float32 rounding of differently fused programs); a summed,
skipped or repeated update is off by far more.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
from immgrad._src import commit
from immgrad._src import compat
import oracles

ATOL, RTOL = 1e-6, 1e-5
LAYERS, WIDTH, STEPS = 4, 5, 5

dense = immgrad.immediate_layer(oracles.dense)


def _params():
  chain, unrolled = oracles.mlp(
    [WIDTH] * (LAYERS + 1) + [3], jax.random.PRNGKey(0), act=jnp.tanh
  )
  return chain, unrolled


def _data():
  return oracles.batches(jax.random.PRNGKey(1), STEPS, (8, WIDTH), (8, 3))


def _expected(kind, opt, chain, unrolled, data):
  if kind == "current":
    history, losses = oracles.plain_steps(chain.loss_fn(), opt, unrolled, data)
  else:
    history, losses = oracles.sequential_steps(chain, opt, unrolled, data)
  return [oracles.stacked(p) for p in history], losses


OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.1),
  "adam": lambda: optax.adam(1e-2),
  "lion": lambda: optax.lion(1e-3),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["current", "updated"])
def test_scan_equals_unrolled(mode, opt_name):
  chain, unrolled = _params()
  data = _data()
  opt = OPTIMIZERS[opt_name]()
  got = oracles.immediate_steps(
    oracles.scanned_loss(), opt, oracles.stacked(unrolled), data, mode=mode
  )
  oracles.assert_runs_close(
    got, _expected(mode, opt, chain, unrolled, data), atol=ATOL, rtol=RTOL
  )


def test_model_and_rule_on_another_device_equal_unrolled():
  """The per-layer check runs on the CPU backend's first device (on a TPU,
  XLA compiled the check of a 16x2048x2048 stack for over 40 s); a model
  and a rule's array (the learning rate) on the last of the four CPU
  devices still train as plain training. On a CPU alone this cannot show
  which backend ran the check (docs/devlog.md has the chip's timings).
  """
  device = jax.devices("cpu")[-1]
  chain, unrolled = _params()
  unrolled = jax.device_put(unrolled, device)
  data = jax.device_put(_data(), device)
  opt = optax.adam(jax.device_put(jnp.float32(1e-2), device))
  got = oracles.immediate_steps(
    oracles.scanned_loss(), opt, oracles.stacked(unrolled), data, mode="current"
  )
  oracles.assert_runs_close(
    got, _expected("current", opt, chain, unrolled, data), atol=ATOL, rtol=RTOL
  )


def test_reverse_scan_equals_reversed_layers():
  chain, unrolled = _params()
  data = _data()
  flipped = dict(unrolled)
  for i in range(LAYERS):
    flipped[f"layer{i}"] = unrolled[f"layer{LAYERS - 1 - i}"]
  opt = optax.adam(1e-2)
  history, losses = oracles.sequential_steps(chain, opt, flipped, data)
  expected = []
  for p in history:
    back = dict(p)
    for i in range(LAYERS):
      back[f"layer{i}"] = p[f"layer{LAYERS - 1 - i}"]
    expected.append(oracles.stacked(back))
  got = oracles.immediate_steps(
    oracles.scanned_loss(reverse=True),
    opt,
    oracles.stacked(unrolled),
    data,
    mode="updated",
  )
  oracles.assert_runs_close(got, (expected, losses), atol=ATOL, rtol=RTOL)


def test_shared_step_count_is_one_per_step():
  """adam's int32 count is shared by the layers: it advances by one."""
  _, unrolled = _params()
  params = oracles.stacked(unrolled)
  tx = immgrad.shim(optax.adam(1e-2))
  state = tx.init(params)
  step = jax.jit(immgrad.value_and_grad(oracles.scanned_loss(), tx))
  for x, y in _data():
    _, grads = step(params, state, x, y)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  counts = [
    leaf
    for leaf in jax.tree.leaves(state.inner)
    if jnp.issubdtype(leaf.dtype, jnp.integer)
  ]
  assert [int(c) for c in counts] == [STEPS] * len(counts)


def test_scan_without_parameters_is_lax_scan():
  def f(c, x):
    return c + x, c * x

  xs = jnp.arange(4.0)
  chex.assert_trees_all_equal(
    immgrad.scan(f, 1.0, xs), jax.lax.scan(f, 1.0, xs)
  )


def _per_leaf_norm():
  """A per-tensor rule whose float state has no layer axis."""

  def init(params):
    return jax.tree.map(lambda p: jnp.zeros(()), params)

  def update(grads, state, params=None):
    del state, params
    norms = jax.tree.map(lambda g: jnp.sqrt(jnp.sum(g**2)), grads)
    return jax.tree.map(lambda g, n: g / (n + 1.0), grads, norms), norms

  return optax.GradientTransformation(init, update)


def _first_stacked_step(opt):
  """The first immgrad step of the stacked model, shimming ``opt``."""
  params = oracles.stacked(_params()[1])
  tx = immgrad.shim(opt)
  x, y = _data()[0]
  return immgrad.value_and_grad(oracles.scanned_loss(), tx)(
    params, tx.init(params), x, y
  )


@pytest.mark.parametrize(
  "opt",
  [
    _per_leaf_norm,
    # Factors a stacked (layers, width) bias, but not one layer's (width,).
    lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
  ],
  ids=["scalar_float_state", "adafactor"],
)
def test_state_that_cannot_be_split_per_layer_is_an_error(opt):
  with pytest.raises(ValueError, match=r"stacked parameter \['blocks'\]"):
    _first_stacked_step(opt())


@pytest.mark.parametrize(
  "opt",
  [
    # Plain training decays the stacked (layers, width) bias, ndim 2; a
    # layer's (width,) slice is not decayed. Before, this trained the
    # unrolled model's step silently.
    lambda: optax.adamw(
      1e-2,
      weight_decay=0.1,
      mask=lambda p: jax.tree.map(lambda a: a.ndim > 1, p),
    ),
    # Statistics of the whole stacked tensor, which no layer has.
    lambda: optax.chain(immgrad.clip_by_layer_norm(0.05), optax.sgd(0.1)),
    lambda: optax.lamb(1e-2),
    lambda: optax.chain(optax.scale_by_adam(), optax.clip_by_block_rms(0.1)),
    lambda: optax.fromage(1e-2),  # Trained the stack 4e-2 off, before.
  ],
  ids=[
    "mask_by_ndim",
    "clip_by_layer_norm",
    "lamb",
    "clip_by_block_rms",
    "fromage",
  ],
)
def test_rule_stepping_the_stack_unlike_its_layers_is_an_error(opt):
  """Plain training steps a stacked parameter as one tensor; a rule that
  steps it differently from each of its layers has no per-layer step
  equal to plain training, so it is refused, naming the parameter.
  """
  with pytest.raises(ValueError, match=r"\['blocks'\]\['[wb]'\] different"):
    _first_stacked_step(opt())


def test_stacked_parameter_used_by_two_scans_is_an_error():
  def loss_fn(params, x, y):
    body = lambda h, p: (jnp.tanh(dense(h, p)), None)
    h, _ = immgrad.scan(body, x, params["blocks"])
    h, _ = immgrad.scan(body, h, params["blocks"])
    return oracles.mse(dense(h, params["head"]), y)

  _, unrolled = _params()
  params = oracles.stacked(unrolled)
  tx = immgrad.shim(optax.sgd(0.1))
  with pytest.raises(ValueError, match="reaches two immediate layer calls"):
    immgrad.value_and_grad(loss_fn, tx)(params, tx.init(params), *_data()[0])


def _counting(opt, calls):
  def update(grads, state, params=None):
    jax.debug.callback(lambda: calls.append(1))
    return opt.update(grads, state, params)

  return optax.GradientTransformation(opt.init, update)


@pytest.mark.parametrize(
  "policy", [None, jax.checkpoint_policies.nothing_saveable]
)
@pytest.mark.parametrize("mode", ["current", "updated"])
def test_checkpoint_changes_nothing_and_updates_once(mode, policy):
  chain, unrolled = _params()
  data = _data()

  def block(h, p, act):  # ``act`` is static.
    return act(dense(h, p))

  remat = immgrad.checkpoint(block, policy=policy, static_argnums=(2,))

  def loss_fn(params, x, y):
    h = x
    for i in range(LAYERS):
      h = remat(h, params[f"layer{i}"], jnp.tanh)
    return oracles.mse(dense(h, params[f"layer{LAYERS}"]), y)

  calls = []
  got = oracles.immediate_steps(
    loss_fn, _counting(optax.adam(1e-2), calls), unrolled, data, mode=mode
  )
  jax.effects_barrier()
  # The callback is in every parameter's program (plan.py keeps effects),
  # which runs twice per step: in its layer's backward rule (the finiteness
  # check, and dX in updated mode) and in the commit; and in the program of
  # the shared state (the step count), once per step. A rematerialised
  # backward rule would make the first term three.
  assert len(calls) == (2 * len(jax.tree.leaves(unrolled)) + 1) * STEPS
  opt = optax.adam(1e-2)
  if mode == "current":
    expected = oracles.plain_steps(chain.loss_fn(), opt, unrolled, data)
  else:
    expected = oracles.sequential_steps(chain, opt, unrolled, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(
  compat.JAX_VERSION < (0, 10, 2),
  reason="jax.checkpoint has static_argnames from 0.10.2",
)
def test_checkpoint_static_argnames_changes_nothing():
  chain, unrolled = _params()
  data = _data()
  remat = immgrad.checkpoint(
    lambda h, p, act: act(dense(h, p)), static_argnames=("act",)
  )

  def loss_fn(params, x, y):
    h = x
    for i in range(LAYERS):
      h = remat(h, params[f"layer{i}"], act=jnp.tanh)
    return oracles.mse(dense(h, params[f"layer{LAYERS}"]), y)

  opt = optax.adam(1e-2)
  got = oracles.immediate_steps(loss_fn, opt, unrolled, data, mode="updated")
  expected = oracles.sequential_steps(chain, opt, unrolled, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.skipif(
  compat.JAX_VERSION >= (0, 10, 2),
  reason="only jax < 0.10.2 lacks checkpoint static_argnames",
)
def test_checkpoint_static_argnames_on_old_jax_is_a_clear_error():
  with pytest.raises(TypeError, match="needs jax >= 0.10.2"):
    immgrad.checkpoint(lambda h, act: act(h), static_argnames=("act",))


def test_scan_inside_checkpoint():
  """Remat around a scanned stack: both wrappers nest."""
  chain, unrolled = _params()
  data = _data()

  def loss_fn(params, x, y):
    def stack(h, blocks):
      return immgrad.scan(
        lambda h, p: (jnp.tanh(dense(h, p)), None), h, blocks
      )[0]

    h = immgrad.checkpoint(stack)(x, params["blocks"])
    return oracles.mse(dense(h, params["head"]), y)

  opt = optax.adam(1e-2)
  got = oracles.immediate_steps(
    loss_fn, opt, oracles.stacked(unrolled), data, mode="updated"
  )
  oracles.assert_runs_close(
    got, _expected("updated", opt, chain, unrolled, data), atol=ATOL, rtol=RTOL
  )
  assert np.all(np.isfinite(got[1]))


def _busy_loss(params, x, y):
  """A scan body with every kind of input and output besides the layers.

  Besides the immediate layer on ``blocks``: a stacked parameter used
  ordinarily (``gain``), a closed-over parameter used ordinarily by every
  layer (``shift``), scanned data (``noise``), an integer in the carry, and
  per-layer outputs (``ys``) that the loss uses.
  """
  noise = 0.1 * jnp.stack([jnp.sin(x[0] * i) for i in range(LAYERS)])

  def block(carry, inputs):
    h, count = carry
    p, gain, n = inputs
    h = jnp.tanh(dense(h, p) * gain + params["shift"] + n)
    return (h, count + 1), jnp.sum(h**2)

  (h, count), ys = immgrad.scan(
    block,
    (x, jnp.int32(0)),
    (params["blocks"], params["gain"], noise),
    unroll=2,
  )
  del count
  return oracles.mse(dense(h, params["head"]), y) + 1e-2 * jnp.mean(ys)


def _busy_params():
  _, unrolled = _params()
  params = oracles.stacked(unrolled)
  params["gain"] = 1.0 + 0.1 * jax.random.normal(
    jax.random.PRNGKey(2), (LAYERS, WIDTH)
  )
  params["shift"] = jnp.full((WIDTH,), 0.05)
  return params


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_scan_body_with_ordinary_inputs_equals_plain(opt_name):
  """mode="current": the scan's own backward loop gives every input JAX's
  gradient (stacked, summed over layers, or carried) and steps the layers.
  The reference is the same loss under plain jax.value_and_grad, where
  immgrad.scan is lax.scan and the layer its undecorated function.
  """
  opt = OPTIMIZERS[opt_name]()
  params, data = _busy_params(), _data()
  expected = oracles.plain_steps(_busy_loss, opt, params, data)
  got = oracles.immediate_steps(_busy_loss, opt, params, data, mode="current")
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


MASK = jnp.arange(WIDTH) % 2 == 0


def _masked_loss(params, x, y):
  """A scan body whose residuals include values fixed for the whole loop:
  ``jnp.where`` broadcasts the closed-over mask to the batch, and the
  closed-over ``shift`` (a parameter) is scaled in every layer alike.
  """

  def block(h, p):
    shift = jnp.broadcast_to(params["shift"] * 2.0, h.shape)
    return jnp.where(MASK, jnp.tanh(dense(h, p) + shift), 0.5 * h), None

  h, _ = immgrad.scan(block, x, params["blocks"])
  return oracles.mse(dense(h, params["head"]), y)


def _scan_outputs(jaxpr, side="outvars") -> list:
  """The avals of every scan's outputs (or ``side="invars"``, inputs) in
  ``jaxpr``, nested ones included.
  """
  return [
    v.aval
    for eqn in oracles.equations(jaxpr)
    if eqn.primitive.name == "scan"
    for v in getattr(eqn, side)
  ]


@pytest.mark.parametrize("mode", ["current", "updated"])
def test_residuals_fixed_across_layers_are_made_once(mode):
  """The forward loop stacks no residual that is the same in every layer
  (as JAX's own scan differentiation, which hoists them): the mask that
  ``jnp.where`` broadcasts is made once, outside the loop, where stacked
  it would be written and read back once per layer. Training is
  unchanged: mode="current" equals plain jax.value_and_grad (tolerance as
  above).
  """
  opt = optax.adam(1e-2)
  params = _busy_params()
  del params["gain"]
  data = _data()
  tx = immgrad.shim(opt)
  step = immgrad.value_and_grad(_masked_loss, tx, mode=mode)
  x, y = data[0]
  jaxpr = jax.make_jaxpr(step)(params, tx.init(params), x, y).jaxpr
  stacked = [a for a in _scan_outputs(jaxpr) if a.dtype == jnp.bool_]
  assert not stacked, f"the mask was stacked per layer: {stacked}"
  if mode == "current":
    expected = oracles.plain_steps(_masked_loss, opt, params, data)
    got = oracles.immediate_steps(_masked_loss, opt, params, data, mode=mode)
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
  "mode,atomic,carried",
  [
    ("current", False, False),
    ("current", True, True),
    ("updated", False, True),
  ],
)
def test_optimizer_state_enters_the_loops_only_when_a_layer_steps(
  mode, atomic, carried
):
  """A layer's backward rule reads its optimizer state only when it steps
  (``updated``, or to check the step: ``atomic``). Otherwise no state goes
  through the forward and backward loops, where it would be sliced per
  layer and, saved for the backward rule, stacked again: XLA may or may
  not remove it. adam's ``mu`` in bfloat16 is the only bfloat16 array of
  the step. Training is unchanged: mode="current" with atomic=False
  equals plain jax.value_and_grad (tolerance as above).
  """
  opt = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
  _, unrolled = _params()
  params, data = oracles.stacked(unrolled), _data()
  loss_fn = oracles.scanned_loss()
  tx = immgrad.shim(opt, atomic=atomic)
  step = immgrad.value_and_grad(loss_fn, tx, mode=mode)
  x, y = data[0]
  jaxpr = jax.make_jaxpr(step)(params, tx.init(params), x, y).jaxpr
  mu = [a for a in _scan_outputs(jaxpr, "invars") if a.dtype == jnp.bfloat16]
  assert bool(mu) == carried, mu
  if not carried:
    expected = oracles.plain_steps(loss_fn, opt, params, data)
    got = oracles.immediate_steps(
      loss_fn, opt, params, data, atomic=False, mode=mode
    )
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_stacked_parameter_used_by_a_layer_and_by_a_term_folds():
  """Once refused: ``sum(b)`` added to each block's output is a term of
  that block's layer alone; the step plans the whole loss as one program
  and folds it into each layer's step of its slice: plain training.
  """

  def loss_fn(params, x, y):
    def block(h, p):
      return jnp.tanh(dense(h, p)) + jnp.sum(p["b"]), None

    h, _ = immgrad.scan(block, x, params["blocks"])
    return oracles.mse(dense(h, params["head"]), y)

  _, unrolled = _params()
  params = oracles.stacked(unrolled)
  data = _data()
  expected = oracles.plain_steps(loss_fn, optax.adam(1e-2), params, data)
  got = oracles.immediate_steps(
    loss_fn, optax.adam(1e-2), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  tx = immgrad.shim(optax.sgd(0.1))
  _, grads = immgrad.value_and_grad(loss_fn, tx)(
    params, tx.init(params), *data[0]
  )
  assert isinstance(grads["blocks"]["b"], immgrad.ImmediateGrad)


@pytest.mark.parametrize("mode", ["current", "updated"])
def test_nested_scans_equal_unrolled(mode):
  """Blocks of blocks: an outer scan over 2 groups, an inner over 2 layers,
  parameters stacked (2, 2, ...); equal to the 4 layers unrolled.
  """
  chain, unrolled = _params()
  data, opt = _data(), optax.adam(1e-2)

  def nest(params):
    return dict(
      params,
      blocks=jax.tree.map(
        lambda a: a.reshape((2, 2) + a.shape[1:]), params["blocks"]
      ),
    )

  def loss_fn(params, x, y):
    def layer(h, p):
      return jnp.tanh(dense(h, p)), None

    def group(h, ps):
      return immgrad.scan(layer, h, ps)[0], None

    h, _ = immgrad.scan(group, x, params["blocks"])
    return oracles.mse(dense(h, params["head"]), y)

  history, losses = oracles.immediate_steps(
    loss_fn, opt, nest(oracles.stacked(unrolled)), data, mode=mode
  )
  expected, expected_losses = _expected(mode, opt, chain, unrolled, data)
  oracles.assert_runs_close(
    (history, losses),
    ([nest(p) for p in expected], expected_losses),
    atol=ATOL,
    rtol=RTOL,
  )


def test_checkpoint_inside_scan_updates_once():
  """Remat inside a scanned block (hk.remat in hk.layer_stack): equal to
  plain training, and each layer's update runs once per step, not again
  when the block is recomputed.
  """
  chain, unrolled = _params()
  data, calls = _data(), []
  block = immgrad.checkpoint(lambda h, p: jnp.tanh(dense(h, p)))

  def loss_fn(params, x, y):
    h, _ = immgrad.scan(lambda h, p: (block(h, p), None), x, params["blocks"])
    return oracles.mse(dense(h, params["head"]), y)

  got = oracles.immediate_steps(
    loss_fn,
    _counting(optax.adam(1e-2), calls),
    oracles.stacked(unrolled),
    data,
    mode="current",
  )
  jax.effects_barrier()
  # Per step: one call per layer's slice of each leaf (w and b of each
  # layer, and the head's) in the backward rules, which a rematerialised
  # backward rule would make two; the commit's calls, one per slice where it
  # loops over the layers under conds (the CPU), one per stacked leaf where
  # it steps the whole stack at once (vmapped) and selects (accelerators,
  # commit.by_select); and one for the shared step count.
  slices = len(jax.tree.leaves(unrolled))
  commits = len(jax.tree.leaves(oracles.stacked(unrolled)))
  if not commit.by_select():
    commits = slices
  assert len(calls) == (slices + commits + 1) * STEPS
  oracles.assert_runs_close(
    got,
    _expected("current", optax.adam(1e-2), chain, unrolled, data),
    atol=ATOL,
    rtol=RTOL,
  )
