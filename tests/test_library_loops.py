"""Each library's own training loop, and optax.MultiSteps, with the shim.

Every test runs the loop a user of that library writes (Flax NNX's
``nnx.Optimizer`` under ``nnx.jit``, Linen's ``TrainState``, Equinox's
``eqx.filter_jit`` over a partitioned model, Haiku's ``hk.transform`` +
optax; gradient accumulation with ``optax.MultiSteps``) twice: plainly,
with the library's own gradient function (``nnx.value_and_grad``,
``eqx.filter_value_and_grad``, ``jax.value_and_grad``), and with
``immgrad.value_and_grad`` in its place. The reference never calls immgrad.

Tolerances: ``mode="current"`` must equal the plain loop to ``atol=1e-6,
rtol=1e-5``, the suite's bound for a few steps of a whole model
(tests/test_current.py): XLA fuses the optimizer's arithmetic differently
inside the backward pass, an ulp or two per step (measured here: at most
6e-8 on the weights, 2.4e-7 on the losses). ``mode="updated"`` must run and
train differently: its weights differ from plain's by more than
``DIFFERENT = 1e-3`` (measured: 0.02 to 0.05 after four steps of adam(w) at
lr 1e-2, whose steps are ~1e-2 per element), far above rounding.
"""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
import immgrad.haiku
import oracles

ATOL, RTOL = 1e-6, 1e-5
DIFFERENT = 1e-3
STEPS = 4
LR = 1e-2

# Flax 0.12 warns on some of its own calls (e.g. Variable.value); not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _data(n=STEPS):
  return oracles.batches(jax.random.PRNGKey(1), n, (8, 5), (8, 3))


def _all_immediate(grads) -> bool:
  is_grad = lambda g: isinstance(g, immgrad.ImmediateGrad)
  return all(map(is_grad, jax.tree.leaves(grads, is_leaf=is_grad)))


def _assert_runs(current, updated, plain):
  """Each run is (params after each step, losses)."""
  oracles.assert_runs_close(current, plain, atol=ATOL, rtol=RTOL)
  assert oracles.max_abs_diff(updated[0][-1], plain[0][-1]) > DIFFERENT


# -- Flax NNX: nnx.Optimizer under nnx.jit ----------------------------------


def _nnx_run(mode):
  """NNX's own loop: ``nnx.Optimizer`` and ``nnx.jit``; plain if no mode."""
  nnx = pytest.importorskip("flax.nnx")
  import immgrad.flax

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(5, 16, rngs=rngs)
      self.norm = nnx.LayerNorm(16, rngs=rngs)
      self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.norm(self.l1(x))))

  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  model = MLP(nnx.Rngs(0))
  tx = optax.adamw(LR) if mode is None else immgrad.shim(optax.adamw(LR))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  kinds = []

  @nnx.jit
  def train_step(model, optimizer, x, y):
    if mode is None:
      value, grads = nnx.value_and_grad(loss)(model, x, y)
    else:
      graphdef, params = nnx.split(model, nnx.Param)

      def loss_fn(params, x, y):
        return loss(nnx.merge(graphdef, params), x, y)

      step = immgrad.value_and_grad(
        immgrad.flax.immediate(loss_fn), optimizer.tx, mode=mode
      )
      value, grads = step(params, optimizer.opt_state, x, y)
      kinds.append(_all_immediate(grads))
    optimizer.update(model, grads)
    return value

  history, losses = [], []
  for x, y in _data():
    losses.append(train_step(model, optimizer, x, y))
    history.append(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  return (history, losses), optimizer, kinds


def test_nnx_optimizer_loop_current_equals_plain_and_updated_runs():
  nnx = pytest.importorskip("flax.nnx")
  plain, plain_optimizer, _ = _nnx_run(None)
  current, optimizer, kinds = _nnx_run("current")
  updated, _, _ = _nnx_run("updated")
  assert kinds == [True], kinds  # Traced once, every parameter stepped.
  _assert_runs(current, updated, plain)
  # The optimizer state too: nnx.Optimizer keeps the shim's state as
  # optax's own, inside nnx.OptState boxes.
  chex.assert_trees_all_close(
    nnx.as_pure(optimizer.opt_state).inner,
    nnx.as_pure(plain_optimizer.opt_state),
    atol=ATOL,
    rtol=RTOL,
  )
  assert int(optimizer.step[...]) == STEPS


def _nnx_stateful_run(mode):
  """The same loop on a model with ``BatchStat`` and dropout's ``nnx.Rngs``
  state, which the step returns as aux and ``nnx.update`` writes back.
  """
  nnx = pytest.importorskip("flax.nnx")
  import immgrad.flax

  class Net(nnx.Module):
    def __init__(self, rngs):
      # No bias before BatchNorm: its gradient would be rounding noise,
      # which adam's normalisation turns into whole steps.
      self.l1 = nnx.Linear(5, 16, use_bias=False, rngs=rngs)
      self.bn = nnx.BatchNorm(16, rngs=rngs)
      self.drop = nnx.Dropout(0.2, rngs=rngs)
      self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))

  def loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)

  model = Net(nnx.Rngs(0))
  model.train()
  tx = optax.adamw(LR) if mode is None else immgrad.shim(optax.adamw(LR))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    if mode is None:
      value, grads = nnx.value_and_grad(loss)(model, x, y)
      optimizer.update(model, grads)
      return value
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, x, y):
      model = nnx.merge(graphdef, params, rest, copy=True)
      return loss(model, x, y), nnx.state(model, nnx.Not(nnx.Param))

    step = immgrad.value_and_grad(
      immgrad.flax.immediate(loss_fn), optimizer.tx, mode=mode, has_aux=True
    )
    (value, rest), grads = step(params, optimizer.opt_state, rest, x, y)
    optimizer.update(model, grads)
    nnx.update(model, rest)
    return value

  def arrays(state):
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return [
      jax.random.key_data(x) if is_key(x) else x for x in jax.tree.leaves(state)
    ]

  history, losses = [], []
  for x, y in _data():
    losses.append(train_step(model, optimizer, x, y))
    history.append(arrays(nnx.state(model)))  # Params, statistics, rngs.
  return history, losses


def test_nnx_optimizer_loop_with_batch_stats_and_dropout():
  _assert_runs(
    _nnx_stateful_run("current"),
    _nnx_stateful_run("updated"),
    _nnx_stateful_run(None),
  )


# -- Flax Linen: TrainState -------------------------------------------------


def _linen_run(mode):
  nn = pytest.importorskip("flax.linen")
  train_state = pytest.importorskip("flax.training.train_state")
  import immgrad.flax

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jax.nn.relu(nn.LayerNorm()(nn.Dense(16)(x)))
      return nn.Dense(3)(x)

  model = MLP()
  data = _data()
  params = model.init(jax.random.PRNGKey(0), data[0][0])["params"]

  def loss_fn(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  tx = optax.adamw(LR) if mode is None else immgrad.shim(optax.adamw(LR))
  state = train_state.TrainState.create(
    apply_fn=model.apply, params=params, tx=tx
  )

  @jax.jit
  def train_step(state, x, y):
    if mode is None:
      value, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
    else:
      step = immgrad.value_and_grad(
        immgrad.flax.immediate(loss_fn), state.tx, mode=mode
      )
      value, grads = step(state.params, state.opt_state, x, y)
      assert _all_immediate(grads)
    return state.apply_gradients(grads=grads), value

  history, losses = [], []
  for x, y in data:
    state, value = train_step(state, x, y)
    history.append(state.params)
    losses.append(value)
  assert int(state.step) == STEPS
  return history, losses


def test_linen_train_state_current_equals_plain_and_updated_runs():
  _assert_runs(_linen_run("current"), _linen_run("updated"), _linen_run(None))


# -- Equinox: eqx.filter_jit, a partitioned model ---------------------------


def _equinox_run(mode):
  eqx = pytest.importorskip("equinox")
  import immgrad.equinox

  def loss(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)

  model = eqx.nn.MLP(5, 3, 16, 2, key=jax.random.PRNGKey(0))
  tx = optax.adamw(LR) if mode is None else immgrad.shim(optax.adamw(LR))
  opt_state = tx.init(eqx.filter(model, eqx.is_array))

  @eqx.filter_jit
  def make_step(model, opt_state, x, y):
    if mode is None:
      value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
      params = eqx.filter(model, eqx.is_array)
    else:
      params, static = eqx.partition(model, eqx.is_array)

      @immgrad.equinox.immediate
      def loss_fn(params, x, y):
        return loss(eqx.combine(params, static), x, y)

      step = immgrad.value_and_grad(loss_fn, tx, mode=mode)
      value, grads = step(params, opt_state, x, y)
      assert _all_immediate(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, value

  history, losses = [], []
  for x, y in _data():
    model, opt_state, value = make_step(model, opt_state, x, y)
    history.append(eqx.filter(model, eqx.is_array))
    losses.append(value)
  return history, losses


def test_equinox_filter_loop_current_equals_plain_and_updated_runs():
  _assert_runs(
    _equinox_run("current"), _equinox_run("updated"), _equinox_run(None)
  )


# -- Haiku: hk.transform + optax --------------------------------------------


def _haiku_run(mode):
  def forward(x):
    x = jax.nn.relu(hk.LayerNorm(-1, True, True)(hk.Linear(16)(x)))
    return hk.Linear(3)(x)

  if mode is not None:
    forward = immgrad.haiku.immediate(forward)
  model = hk.without_apply_rng(hk.transform(forward))
  data = _data()
  params = model.init(jax.random.PRNGKey(0), data[0][0])

  def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)

  tx = optax.adamw(LR) if mode is None else immgrad.shim(optax.adamw(LR))
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, x, y):
    if mode is None:
      value, grads = jax.value_and_grad(loss_fn)(params, x, y)
    else:
      step = immgrad.value_and_grad(loss_fn, tx, mode=mode)
      value, grads = step(params, opt_state, x, y)
      assert _all_immediate(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  history, losses = [], []
  for x, y in data:
    params, opt_state, value = train_step(params, opt_state, x, y)
    history.append(params)
    losses.append(value)
  return history, losses


def test_haiku_transform_loop_current_equals_plain_and_updated_runs():
  _assert_runs(_haiku_run("current"), _haiku_run("updated"), _haiku_run(None))


# -- Gradient accumulation: optax.MultiSteps --------------------------------

K = 2  # Micro-batches per step.


def _multi_steps(**kwargs):
  return optax.MultiSteps(optax.adam(LR), every_k_schedule=K, **kwargs)


@pytest.mark.parametrize(
  "as_written", [True, False], ids=["MultiSteps", "gradient_transformation"]
)
def test_multi_steps_current_equals_plain_and_updated_the_sequential(
  as_written,
):
  """``updated`` on the k-th micro-batch: each layer steps with the mean of
  its k gradients, then sends dX on at its new weights; on the others its
  update is zero, so dX is taken at the weights it has. The reference is
  the sequential re-linearization with a MultiSteps per layer.
  """
  chain, params = oracles.mlp([5, 16, 16, 3], jax.random.PRNGKey(0))
  data = _data(3 * K)
  tx = (
    _multi_steps() if as_written else _multi_steps().gradient_transformation()
  )
  loss_fn = chain.loss_fn(immgrad.immediate_layer)
  plain = oracles.plain_steps(chain.loss_fn(), _multi_steps(), params, data)
  current = oracles.immediate_steps(loss_fn, tx, params, data, mode="current")
  oracles.assert_runs_close(current, plain, atol=ATOL, rtol=RTOL)
  updated = oracles.immediate_steps(loss_fn, tx, params, data, mode="updated")
  sequential = oracles.sequential_steps(
    chain, _multi_steps().gradient_transformation(), params, data
  )
  oracles.assert_runs_close(updated, sequential, atol=ATOL, rtol=RTOL)
  # A mini-step leaves the weights as they were, a k-th micro-batch moves
  # them, unlike plain's (the earlier layers saw dX at new weights).
  chex.assert_trees_all_equal(updated[0][0], params)
  assert oracles.max_abs_diff(updated[0][-1], plain[0][-1]) > DIFFERENT


def test_multi_steps_skip_not_finite_is_what_the_atomic_shim_does():
  """A NaN micro-batch: plain MultiSteps with ``skip_not_finite`` forgets
  it; so does the atomic shim around MultiSteps without the option (which
  it refuses: the skip reads every gradient).
  """
  chain, params = oracles.mlp([5, 16, 3], jax.random.PRNGKey(0))
  data = _data(3 * K)
  data[1] = (data[1][0].at[0, 0].set(jnp.nan), data[1][1])
  skip = _multi_steps(should_skip_update_fn=optax.skip_not_finite)
  with pytest.raises(ValueError, match="should_skip_update_fn.*Drop it"):
    immgrad.shim(skip)
  plain = oracles.plain_steps(chain.loss_fn(), skip, params, data)
  current = oracles.immediate_steps(
    chain.loss_fn(immgrad.immediate_layer),
    _multi_steps(),
    params,
    data,
    mode="current",
  )
  assert all(np.isfinite(p).all() for p in jax.tree.leaves(current[0]))
  oracles.assert_runs_close(current, plain, atol=ATOL, rtol=RTOL)
  # The rejected micro-batch did not count: the first step is taken on the
  # third (plain's mini-step counter stayed at 1), not the second.
  chex.assert_trees_all_equal(current[0][1], params)
  assert oracles.max_abs_diff(current[0][2], params) > DIFFERENT
