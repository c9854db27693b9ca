"""Unmodified Flax models (NNX and Linen) made immediate by immgrad.flax.

References, never immgrad: Flax's own modules under ``jax.value_and_grad``
+ optax (``mode="current"``), and the hand-written sequential
re-linearization of a chain of Flax layers (``mode="updated"``,
oracles.sequential_steps).

Tolerances. Each module alone (test_module_is_flax_bitwise) is bitwise:
the loss and every gradient, both jitted, in float32 and bfloat16
(measured: 0 difference in all cases). Over several steps of a whole model
``atol=1e-6, rtol=1e-5`` as in the rest of the suite (tests/test_current.py):
XLA fuses the optimizer's arithmetic differently inside the backward pass,
an ulp or two per step (measured: at most 2.4e-7 over 3 steps, models and
chains alike).
"""

import cProfile
import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

pytest.importorskip(
  "flax",
  reason="immgrad.flax needs the flax extra (flax 0.12.8 needs jax >= 0.10)",
)

import chex
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import immgrad
import immgrad.flax
import oracles

ATOL, RTOL = 1e-6, 1e-5
STEPS = 3
ROOT = pathlib.Path(__file__).resolve().parent.parent
BF16, F32 = jnp.bfloat16, jnp.float32

# Flax 0.12 warns on some of its own calls (e.g. Variable.value); not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _is_immediate(g):
  return isinstance(g, immgrad.ImmediateGrad)


def _grads(tree):
  """``value_and_grad``'s grads as arrays, and which were stepped."""
  leaves = jax.tree.leaves(tree, is_leaf=_is_immediate)
  return (
    [g.grad if _is_immediate(g) else g for g in leaves],
    [_is_immediate(g) for g in leaves],
  )


# -- each module alone, bitwise ---------------------------------------------


def _nnx_cases():
  rngs = lambda: nnx.Rngs(0)
  return {
    "Linear bf16 compute": (
      lambda: nnx.Linear(3, 5, dtype=BF16, rngs=rngs()),
      (2, 7, 3),
      F32,
    ),
    "Einsum": (
      lambda: nnx.Einsum("bti,io->bto", (3, 4), (4,), rngs=rngs()),
      (2, 5, 3),
      F32,
    ),
    "Conv circular, stride 2, groups": (
      lambda: nnx.Conv(
        4,
        4,
        (3, 3),
        strides=2,
        padding="CIRCULAR",
        feature_group_count=2,
        rngs=rngs(),
      ),
      (2, 8, 8, 4),
      F32,
    ),
    "Conv causal, dilated, unbatched, bf16 input": (
      lambda: nnx.Conv(
        3, 4, 3, padding="CAUSAL", kernel_dilation=2, rngs=rngs()
      ),
      (8, 3),
      BF16,
    ),
    "LayerNorm bf16 params": (
      lambda: nnx.LayerNorm(6, param_dtype=BF16, rngs=rngs()),
      (2, 5, 6),
      F32,
    ),
    "RMSNorm": (lambda: nnx.RMSNorm(6, rngs=rngs()), (2, 5, 6), F32),
    "Embed": (lambda: nnx.Embed(11, 4, rngs=rngs()), (2, 5), None),
  }


def _linen_cases():
  return {
    "Dense bf16 compute": (lambda: nn.Dense(5, dtype=BF16), (2, 7, 3), F32),
    "Conv masked, two batch axes": (
      lambda: nn.Conv(
        4, (3,), mask=jnp.tril(jnp.ones((3, 4, 4))), feature_group_count=1
      ),
      (2, 3, 8, 4),
      F32,
    ),
    "LayerNorm bf16 params, float reductions off": (
      lambda: nn.LayerNorm(param_dtype=BF16, force_float32_reductions=False),
      (2, 6),
      F32,
    ),
    "Embed": (lambda: nn.Embed(11, 4), (2, 5), None),
    "Dense partitioned kernel": (
      lambda: nn.Dense(
        5,
        kernel_init=nn.with_partitioning(
          nn.initializers.lecun_normal(), (None, "model")
        ),
      ),
      (4, 3),
      F32,
    ),
  }


def _random_like(tree, key):
  """Random values for every leaf (so biases and scales are not trivial)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten(
    [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)]
  )


def _module_problem(api, case):
  make, shape, x_dtype = (_nnx_cases() if api == "nnx" else _linen_cases())[
    case
  ]
  key = jax.random.PRNGKey(1)
  x = (
    jax.random.randint(key, shape, 0, 11)
    if x_dtype is None
    else jax.random.normal(key, shape, x_dtype)
  )
  module = make()
  if api == "nnx":
    graphdef, params = nnx.split(module, nnx.Param)
    apply = lambda p, x: nnx.merge(graphdef, p)(x)
  else:
    params = module.init(key, x)["params"]
    apply = lambda p, x: module.apply({"params": p}, x)
  params = _random_like(params, jax.random.PRNGKey(2))
  if x_dtype is None:

    def loss_fn(params, x):
      return jnp.sum(jnp.sin(apply(params, x).astype(F32)))

    return loss_fn, params, x

  # An ordinary parameter before the module: its gradient is the module's
  # dX, so dX is checked too.
  def loss_fn(params, x):
    return jnp.sum(
      jnp.sin(apply(params["module"], x * params["pre"]).astype(F32))
    )

  return (
    loss_fn,
    {"module": params, "pre": jnp.full(shape[-1:], 1.5, x_dtype)},
    x,
  )


@pytest.mark.parametrize(
  "api,case",
  [("nnx", c) for c in _nnx_cases()] + [("linen", c) for c in _linen_cases()],
)
def test_module_is_flax_bitwise(api, case):
  """Loss, dW and dX of one module inside a step equal Flax's, bitwise."""
  loss_fn, params, x = _module_problem(api, case)
  tx = immgrad.shim(optax.sgd(0.1))
  expected_loss, expected = jax.jit(jax.value_and_grad(loss_fn))(params, x)
  loss, grads = jax.jit(
    immgrad.value_and_grad(immgrad.flax.immediate(loss_fn), tx, mode="current")
  )(params, tx.init(params), x)
  got, stepped = _grads(grads)
  assert all(stepped)  # Every parameter, the module's and "pre".
  assert jnp.array_equal(loss, expected_loss)
  for a, b in zip(got, jax.tree.leaves(expected)):
    assert a.dtype == b.dtype and jnp.array_equal(a, b)


# -- models in Flax's own idiom, trained: current equals plain ------------


class NnxCNN(nnx.Module):
  """Conv, BatchNorm (BatchStat state), Dropout (nnx.Rngs), Linear."""

  def __init__(self, rngs):
    # No conv bias before BatchNorm: its gradient is rounding noise, which
    # adam would turn into steps of +-lr in plain training as here.
    self.conv1 = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.conv2 = nnx.Conv(4, 8, (3, 3), strides=2, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.linear = nnx.Linear(4 * 4 * 8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    return self.linear(self.dropout(x.reshape(x.shape[0], -1)))


class NnxBlock(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      heads, d, decode=False, dropout_rate=0.1, rngs=rngs
    )
    self.ln2 = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Einsum("btf,fd->btd", (2 * d, d), (d,), rngs=rngs)

  def __call__(self, h, mask):
    h = h + self.attention(self.ln1(h), mask=mask)
    return h + self.down(nnx.gelu(self.up(self.ln2(h))))


class NnxLM(nnx.Module):
  """Embed, attention (LinearGeneral), LayerNorm, RMSNorm, Einsum, Linear."""

  def __init__(self, vocab, d, heads, rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.block = NnxBlock(d, heads, rngs)
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens):
    mask = nnx.make_causal_mask(tokens)
    h = self.block(self.embed(tokens), mask)
    return self.head(self.ln(h))


def _tx_and_grad_fn(loss_fn, opt, immediate, mode):
  """The optimizer and ``grad_fn(params, opt_state, *args)``: immgrad's or
  plain JAX's (which ignores ``opt_state``), for a loss with aux.
  """
  if immediate:
    # atomic=False: the non-finite check would only slow compilation here
    # (2-4x; these steps are finite), and it is tested in test_atomic.py.
    tx = immgrad.shim(opt, atomic=False)
    return tx, immgrad.value_and_grad(
      immgrad.flax.immediate(loss_fn), tx, mode=mode, has_aux=True
    )
  plain = jax.value_and_grad(loss_fn, has_aux=True)
  return opt, lambda p, s, *args: plain(p, *args)


def _nnx_run(model, opt, data, immediate, mode="current"):
  """Trains ``model``'s params (and its BatchStat and rng state)."""
  model.train()  # Dropout on, BatchNorm's batch statistics.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, rest, x, labels):
    model = nnx.merge(graphdef, params, rest, copy=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), labels)
    return loss.mean(), nnx.state(model, nnx.Not(nnx.Param))

  tx, grad_fn = _tx_and_grad_fn(loss_fn, opt, immediate, mode)

  @jax.jit
  def step(params, state, rest, *batch):
    (loss, rest), grads = grad_fn(params, state, rest, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, rest, loss, grads

  state = tx.init(params)
  for batch in data:
    params, state, rest, loss, grads = step(params, state, rest, *batch)
  return (params, rest, loss), grads


def _image_batches():
  keys = jax.random.split(jax.random.PRNGKey(3), 2 * STEPS)
  return [
    (
      jax.random.normal(keys[2 * i], (8, 8, 8, 1)),
      jax.random.randint(keys[2 * i + 1], (8,), 0, 10),
    )
    for i in range(STEPS)
  ]


def _key_data(tree):
  """``tree`` with rng keys as their data, for comparisons."""
  return jax.tree.map(
    lambda a: (
      jax.random.key_data(a)
      if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
      else a
    ),
    tree,
  )


def _assert_same_tree(a, b):
  """Same structure, key paths, shapes and dtypes."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  chex.assert_trees_all_equal_shapes_and_dtypes(a, b)


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_nnx_cnn_current_equals_plain(opt):
  opt = optax.adam(1e-2) if opt == "adam" else optax.sgd(0.05, momentum=0.9)
  data = _image_batches()
  params0 = nnx.state(NnxCNN(nnx.Rngs(0)), nnx.Param)
  expected, _ = _nnx_run(NnxCNN(nnx.Rngs(0)), opt, data, immediate=False)
  got, grads = _nnx_run(NnxCNN(nnx.Rngs(0)), opt, data, immediate=True)
  # params (nnx.State of Params), BatchStat and rng state, and the loss.
  chex.assert_trees_all_close(
    _key_data(got), _key_data(expected), atol=ATOL, rtol=RTOL
  )
  _assert_same_tree(got[0], params0)
  _, stepped = _grads(grads)
  # Every parameter immediate, BatchNorm's scale and bias too.
  assert all(stepped) and len(stepped) == 7
  # Dropout ran (its rng advanced once per step) and the statistics moved.
  assert int(got[1]["dropout"]["rngs"]["count"][...]) == STEPS
  assert (
    oracles.max_abs_diff(
      got[1]["bn"], nnx.state(NnxCNN(nnx.Rngs(0)), nnx.BatchStat)["bn"]
    )
    > 1e-3
  )


def test_nnx_transformer_current_equals_plain():
  vocab, seq = 13, 6
  keys = jax.random.split(jax.random.PRNGKey(4), STEPS)
  data = []
  for key in keys:
    tokens = jax.random.randint(key, (4, seq + 1), 0, vocab)
    data.append((tokens[:, :-1], tokens[:, 1:]))
  # Not adam: attention's key bias has a gradient that is exactly zero in
  # exact arithmetic (softmax ignores a shift shared by all keys), and adam
  # turns its rounding noise into steps of +-lr, in plain training as here.
  opt = optax.chain(
    optax.add_decayed_weights(1e-2), optax.sgd(0.05, momentum=0.9)
  )
  make = lambda: NnxLM(vocab, 16, 2, nnx.Rngs(0))
  expected, _ = _nnx_run(make(), opt, data, immediate=False)
  got, grads = _nnx_run(make(), opt, data, immediate=True)
  chex.assert_trees_all_close(
    _key_data(got), _key_data(expected), atol=ATOL, rtol=RTOL
  )
  _, stepped = _grads(grads)
  assert all(stepped)  # Every parameter of this model is immediate.
  assert oracles.max_abs_diff(got[0], nnx.state(make(), nnx.Param)) > 1e-3


class LinenCNN(nn.Module):
  """Conv, BatchNorm (batch_stats), Dense, in Linen's compact style."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(4, (3, 3), use_bias=False)(x)  # No bias: see NnxCNN.
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
    x = nn.relu(nn.Conv(8, (3, 3), strides=2)(x))
    x = nn.Dense(16)(x.reshape(x.shape[0], -1))
    return nn.Dense(10)(nn.relu(nn.LayerNorm()(x)))


class LinenLM(nn.Module):
  """Embed, attention (DenseGeneral), LayerNorm, RMSNorm, Dense, Dropout."""

  vocab: int = 13
  d: int = 16

  @nn.compact
  def __call__(self, tokens, train: bool):
    mask = nn.make_causal_mask(tokens)
    h = nn.Embed(self.vocab, self.d)(tokens)
    a = nn.MultiHeadDotProductAttention(num_heads=2)(
      nn.LayerNorm()(h), mask=mask
    )
    h = h + nn.Dropout(0.1, deterministic=not train)(a)
    h = h + nn.Dense(self.d)(nn.gelu(nn.Dense(2 * self.d)(nn.RMSNorm()(h))))
    return nn.Dense(self.vocab)(nn.LayerNorm()(h))


def _linen_run(model, variables, opt, data, immediate, mode="current"):
  """Trains ``variables["params"]``; other collections are mutable state."""
  params = variables["params"]
  state = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(params, state, rng, x, labels):
    logits, state = model.apply(
      {"params": params, **state},
      x,
      train=True,
      rngs={"dropout": rng},
      mutable=list(state),
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean(), state

  tx, grad_fn = _tx_and_grad_fn(loss_fn, opt, immediate, mode)

  @jax.jit
  def step(params, opt_state, state, *batch):
    (loss, state), grads = grad_fn(params, opt_state, state, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, state, loss, grads

  opt_state = tx.init(params)
  for i, batch in enumerate(data):
    params, opt_state, state, loss, grads = step(
      params, opt_state, state, jax.random.PRNGKey(10 + i), *batch
    )
  return (params, state, loss), grads


@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_linen_cnn_with_batch_stats_current_equals_plain(opt):
  opt = optax.adam(1e-2) if opt == "adam" else optax.sgd(0.05, momentum=0.9)
  data = _image_batches()
  model = LinenCNN()
  variables = model.init(jax.random.PRNGKey(0), data[0][0], train=False)
  expected, _ = _linen_run(model, variables, opt, data, immediate=False)
  got, grads = _linen_run(model, variables, opt, data, immediate=True)
  chex.assert_trees_all_close(got, expected, atol=ATOL, rtol=RTOL)
  _assert_same_tree(got[0], variables["params"])
  _, stepped = _grads(grads)
  assert all(stepped) and len(stepped) == 11  # BatchNorm's 2 too.
  assert (
    oracles.max_abs_diff(got[1], {"batch_stats": variables["batch_stats"]})
    > 1e-3
  )


def test_linen_transformer_current_equals_plain():
  keys = jax.random.split(jax.random.PRNGKey(4), STEPS)
  data = []
  for key in keys:
    tokens = jax.random.randint(key, (4, 7), 0, 13)
    data.append((tokens[:, :-1], tokens[:, 1:]))
  model = LinenLM()
  variables = model.init(jax.random.PRNGKey(0), data[0][0], train=False)
  # Not adam: see test_nnx_transformer_current_equals_plain.
  opt = optax.chain(
    optax.add_decayed_weights(1e-2), optax.sgd(0.05, momentum=0.9)
  )
  expected, _ = _linen_run(model, variables, opt, data, immediate=False)
  got, grads = _linen_run(model, variables, opt, data, immediate=True)
  chex.assert_trees_all_close(got, expected, atol=ATOL, rtol=RTOL)
  _assert_same_tree(got[0], variables["params"])
  _, stepped = _grads(grads)
  assert all(stepped)
  assert oracles.max_abs_diff(got[0], variables["params"]) > 1e-3


# -- updated: the sequential re-linearization of a chain of Flax layers -----


class NnxMLP(nnx.Module):
  def __init__(self, sizes, rngs):
    self.layers = nnx.List(
      [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
    )

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = nnx.relu(layer(x))
    return self.layers[-1](x)


class LinenMLP(nn.Module):
  sizes: tuple

  @nn.compact
  def __call__(self, x):
    for size in self.sizes[:-1]:
      x = nn.relu(nn.Dense(size)(x))
    return nn.Dense(self.sizes[-1])(x)


def _flax_dense(x, p):
  return x @ p["kernel"] + p["bias"]


def _chain(names):
  """The reference chain: plain JAX dense layers on Flax's param names."""
  acts = (jax.nn.relu,) * (len(names) - 1) + (oracles.identity,)
  return oracles.Chain(
    (_flax_dense,) * len(names), tuple(names), acts, oracles.mse
  )


SIZES = (5, 16, 16, 3)


def _nnx_mlp():
  graphdef, params = nnx.split(NnxMLP(SIZES, nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, x, y):
    return oracles.mse(nnx.merge(graphdef, params)(x), y)

  return loss_fn, params


def _linen_mlp(x):
  model = LinenMLP(SIZES[1:])
  params = model.init(jax.random.PRNGKey(0), x)["params"]

  def loss_fn(params, x, y):
    return oracles.mse(model.apply({"params": params}, x), y)

  return loss_fn, params


def _as_chain_params(api, params):
  """Flax's params as the reference's dict of layers, and back."""
  if api == "nnx":
    pure = params.to_pure_dict()["layers"]
    return {f"layer{i}": pure[i] for i in range(len(pure))}
  return {f"layer{i}": params[f"Dense_{i}"] for i in range(len(params))}


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("opt", ["adam", "sgd"])
def test_updated_equals_sequential_reference(api, opt):
  opt = optax.adam(1e-2) if opt == "adam" else optax.sgd(0.1, momentum=0.9)
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 5), (8, 3))
  loss_fn, params = _nnx_mlp() if api == "nnx" else _linen_mlp(data[0][0])
  chain = _chain([f"layer{i}" for i in range(len(SIZES) - 1)])
  expected = oracles.sequential_steps(
    chain, opt, _as_chain_params(api, params), data
  )
  got_params, got_losses = oracles.immediate_steps(
    immgrad.flax.immediate(loss_fn), opt, params, data, mode="updated"
  )
  for p in got_params:
    _assert_same_tree(p, params)
  got = ([_as_chain_params(api, p) for p in got_params], got_losses)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  # "updated" is not "current": the reference would catch a swap.
  plain, _ = oracles.plain_steps(loss_fn, opt, params, data)
  assert (
    oracles.max_abs_diff(got[0][-1], _as_chain_params(api, plain[-1])) > 1e-4
  )


# -- data parallel ----------------------------------------------------------

DEVICES = 4


@pytest.mark.parametrize("mode", ["current", "updated"])
def test_pmap_data_parallel_equals_one_device(mode):
  """NNX MLP on 4 devices, each a quarter of the batch, equals one device
  on the whole batch (plain training for current, the sequential reference
  for updated). Tolerance as in test_parallel.py: the 4-device mean sums
  in another order (an ulp per step). Replicas stay bitwise equal.
  """
  assert jax.device_count() >= DEVICES, "conftest.py sets 4 CPU devices"
  opt = optax.sgd(0.05, momentum=0.9)  # adam is blind to a gradient x4.
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (16, 5), (16, 3))
  loss_fn, params = _nnx_mlp()
  if mode == "current":
    plain, _ = oracles.plain_steps(loss_fn, opt, params, data)
    expected = [_as_chain_params("nnx", p) for p in plain]
  else:
    chain = _chain([f"layer{i}" for i in range(len(SIZES) - 1)])
    expected, _ = oracles.sequential_steps(
      chain, opt, _as_chain_params("nnx", params), data
    )
  tx = immgrad.shim(opt)
  grad_fn = immgrad.value_and_grad(
    immgrad.flax.immediate(loss_fn), tx, mode=mode, axis_name="d"
  )

  def step(params, state, x, y):
    _, grads = grad_fn(params, state, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.pmap(step, axis_name="d")
  stack = lambda t: jax.tree.map(lambda a: jnp.stack([a] * DEVICES), t)
  split = lambda a: a.reshape((DEVICES, -1) + a.shape[1:])
  params, state = stack(params), stack(tx.init(params))
  for i, (x, y) in enumerate(data):
    params, state = step(params, state, split(x), split(y))
    for leaf in jax.tree.leaves(params):
      np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))
    chex.assert_trees_all_close(
      _as_chain_params("nnx", jax.tree.map(lambda a: a[0], params)),
      expected[i],
      atol=ATOL,
      rtol=RTOL,
    )


# -- outside a step: Flax's model, unchanged --------------------------------


def test_outside_a_step_the_model_is_flax_and_unpatched():
  original = nnx.Linear.__dict__["__call__"]
  x = jnp.ones((2, 5))
  loss_fn, params = _nnx_mlp()
  immediate = immgrad.flax.immediate(loss_fn)
  y = jnp.zeros((2, 3))
  chex.assert_trees_all_equal(
    jax.grad(immediate)(params, x, y), jax.grad(loss_fn)(params, x, y)
  )
  assert nnx.Linear.__dict__["__call__"] is original  # Patch removed.
  model = LinenMLP(SIZES[1:])
  key = jax.random.PRNGKey(0)
  chex.assert_trees_all_equal(
    immgrad.flax.immediate(model.init)(key, x), model.init(key, x)
  )


def test_other_threads_see_flax_while_a_step_traces():
  """The adapter's hooks (Linen's interceptor) are per thread: a step traced on another thread meanwhile,
  of a loss not wrapped, is ordinary. (It also pinned the NNX class patch
  being process-wide; there is no class patch any more.)
  """
  loss_fn, params = _nnx_mlp()
  tx = immgrad.shim(optax.sgd(0.1))
  inside, done, seen = threading.Event(), threading.Event(), []

  def pausing_loss(params, x, y):
    inside.set()
    done.wait(timeout=60)
    return loss_fn(params, x, y)

  def other_thread():
    inside.wait(timeout=60)
    # mode="current": without a layer, "updated" is refused.
    step = immgrad.value_and_grad(loss_fn, tx, mode="current")
    _, grads = step(
      params, tx.init(params), jnp.ones((2, 5)), jnp.zeros((2, 3))
    )
    seen.append(any(_grads(grads)[1]))
    done.set()

  thread = threading.Thread(target=other_thread)
  thread.start()
  step = immgrad.value_and_grad(immgrad.flax.immediate(pausing_loss), tx)
  _, grads = step(params, tx.init(params), jnp.ones((2, 5)), jnp.zeros((2, 3)))
  thread.join(timeout=60)
  assert seen == [False]
  assert all(_grads(grads)[1])


def _step_of(loss_fn, params, *args, **options):
  """One ``mode="current"`` step of ``immediate(loss_fn, **options)``."""
  tx = immgrad.shim(optax.sgd(0.1))
  return jax.jit(
    immgrad.value_and_grad(
      immgrad.flax.immediate(loss_fn, **options), tx, mode="current"
    )
  )(params, tx.init(params), *args)


def _assert_plain(loss_fn, params, *args, **options):
  """One step's loss and gradients equal plain JAX's, bitwise (one module
  or two: no optimizer arithmetic in between). Returns which were stepped.
  """
  loss, grads = _step_of(loss_fn, params, *args, **options)
  expected_loss, expected = jax.jit(jax.value_and_grad(loss_fn))(params, *args)
  got, stepped = _grads(grads)
  assert jnp.array_equal(loss, expected_loss)
  for a, b in zip(got, jax.tree.leaves(expected)):
    assert a.dtype == b.dtype and jnp.array_equal(a, b)
  return stepped


# -- modules= ----------------------------------------------------------------


def test_modules_takes_a_tuple_of_flax_module_classes():
  """Any Flax module classes, as a tuple or list; anything else (a bare
  class included) is a TypeError naming modules= and the fix, as in the
  Haiku and Equinox adapters. By default every parameter is stepped; a
  tuple restricts to its classes' own parameters.
  """
  for bad in [(jnp.ndarray,), nnx.BatchNorm, "Dense"]:
    with pytest.raises(
      TypeError,
      match=r"modules= takes a tuple of nnx.Module or nn.Module classes.*"
      r"immgrad.flax.DEFAULT_MODULES \+ \(MyModule,\)",
    ):
      immgrad.flax.immediate(lambda x: x, modules=bad)
  with pytest.raises(TypeError, match="expects a function"):
    immgrad.flax.immediate(42)
  bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
  graphdef, params, stats = nnx.split(bn, nnx.Param, ...)
  params = _random_like(params, jax.random.PRNGKey(2))
  loss_fn = lambda p, x: jnp.sum(
    jnp.sin(nnx.merge(graphdef, p, stats, copy=True)(x))
  )
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
  assert _assert_plain(loss_fn, params, x) == [True, True]  # Default.
  default = immgrad.flax.DEFAULT_MODULES
  assert _assert_plain(loss_fn, params, x, modules=default) == [False] * 2
  assert _assert_plain(loss_fn, params, x, modules=[nnx.BatchNorm]) == [
    True,
    True,
  ]


class Scale(nnx.Module):
  """A layer of the user's own: x * s + t."""

  def __init__(self, d):
    self.s = nnx.Param(jnp.linspace(0.5, 1.5, d))
    self.t = nnx.Param(jnp.linspace(-0.2, 0.3, d))

  def __call__(self, x):
    return x * self.s + self.t


class ScaledMLP(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 4, rngs=rngs)
    self.scale = Scale(4)

  def __call__(self, x):
    return self.scale(nnx.relu(self.linear(x)))


@pytest.mark.parametrize(
  "modules,stepped",
  [
    (None, {"linear": True, "scale": True}),
    (immgrad.flax.DEFAULT_MODULES, {"linear": True, "scale": False}),
    (immgrad.flax.DEFAULT_MODULES + (Scale,), {"linear": True, "scale": True}),
    ((Scale,), {"linear": False, "scale": True}),
  ],
)
def test_custom_nnx_module_is_claimed_by_default(modules, stepped):
  """A custom module's nnx.Params: immediate by default, as under
  immgrad.immediate; DEFAULT_MODULES leaves them out; adding the class to
  the defaults claims them again; a tuple replaces the defaults. Every
  case trains as plain JAX does (bitwise, one step).
  """
  graphdef, params = nnx.split(ScaledMLP(nnx.Rngs(0)), nnx.Param)
  loss_fn = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x)))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3))
  options = {} if modules is None else {"modules": modules}
  _, grads = _step_of(loss_fn, params, x, **options)
  kinds = jax.tree.map(_is_immediate, grads, is_leaf=_is_immediate)
  kinds = kinds.to_pure_dict()
  assert kinds == {
    "linear": {"kernel": stepped["linear"], "bias": stepped["linear"]},
    "scale": {"s": stepped["scale"], "t": stepped["scale"]},
  }
  _assert_plain(loss_fn, params, x, **options)


def test_modules_option_chooses_and_others_stay_ordinary():
  """Choosing no module of the model leaves no immediate layer: refused in
  mode="updated", plain training in "current".
  """
  loss_fn, params = _linen_mlp(jnp.ones((2, 5)))
  tx = immgrad.shim(optax.sgd(0.1))
  batch = jnp.ones((2, 5)), jnp.zeros((2, 3))
  _, grads = immgrad.value_and_grad(
    immgrad.flax.immediate(loss_fn, modules=(nn.Dense,)), tx
  )(params, tx.init(params), *batch)
  assert sum(_grads(grads)[1]) == 6
  none_chosen = immgrad.flax.immediate(loss_fn, modules=(nnx.Linear,))
  with pytest.raises(ValueError, match="no immediate layer used"):
    immgrad.value_and_grad(none_chosen, tx)(params, tx.init(params), *batch)
  _, grads = immgrad.value_and_grad(none_chosen, tx, mode="current")(
    params, tx.init(params), *batch
  )
  assert sum(_grads(grads)[1]) == 0
  _, grads = immgrad.value_and_grad(immgrad.flax.immediate(loss_fn), tx)(
    params, tx.init(params), *batch
  )
  assert sum(_grads(grads)[1]) == 6  # The default: every parameter.


def test_modules_not_listed_keep_ordinary_gradients():
  """nn.ConvLocal shares nn.Conv's ``__call__`` but is not an nn.Conv:
  with modules=DEFAULT_MODULES it is ordinary; by default, immediate.
  """

  class Local(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(2)(nn.ConvLocal(2, (3,))(x).reshape(x.shape[0], -1))

  model, x = Local(), jnp.ones((2, 5, 1))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  loss_fn = lambda p, x: jnp.sum(model.apply({"params": p}, x) ** 2)
  _, grads = _step_of(loss_fn, params, x, modules=immgrad.flax.DEFAULT_MODULES)
  kinds = jax.tree.map(_is_immediate, grads, is_leaf=_is_immediate)
  assert kinds == {
    "ConvLocal_0": {"kernel": False, "bias": False},
    "Dense_0": {"kernel": True, "bias": True},
  }
  _, grads = _step_of(loss_fn, params, x)
  assert all(_grads(grads)[1])


def test_nnx_modules_option_needs_the_model():
  """modules= finds an NNX leaf's module in the model's graph: the
  graphdef the loss closes over (also through a helper function), or the
  model among its arguments. Where neither is reachable (here the graphdef
  sits in a dict), it says so and how to fix it, rather than training the
  leaves ordinarily.
  """
  graphdef, params = nnx.split(ScaledMLP(nnx.Rngs(0)), nnx.Param)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3))
  apply = lambda p, x: nnx.merge(graphdef, p)(x)
  through_helper = lambda p, x: jnp.sum(jnp.sin(apply(p, x)))
  stepped = _assert_plain(through_helper, params, x, modules=(Scale,))
  assert stepped == [False, False, True, True]  # linear, scale.
  held = {"graphdef": graphdef}
  hidden = lambda p, x: jnp.sum(nnx.merge(held["graphdef"], p)(x))
  with pytest.raises(
    ValueError,
    match=r"modules= needs the NNX model .* args\[0\]\['linear'\]"
    r"\['bias'\].*Close over the graphdef",
  ):
    _step_of(hidden, params, x, modules=(Scale,))
  assert all(_assert_plain(hidden, params, x))  # Default: no lookup.


def test_nnx_model_passed_as_a_pytree_is_immediate():
  """An NNX module is a pytree: passed to the loss as it is (no split),
  its leaves are found in it, not only in nnx.merge's graphs.
  """
  model = nnx.Sequential(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
    nnx.relu,
    nnx.LayerNorm(4, rngs=nnx.Rngs(1)),
  )
  loss_fn = lambda m, x: jnp.sum(jnp.sin(m(x)))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3))
  stepped = _assert_plain(loss_fn, model, x)
  assert stepped == [True] * 4


def test_a_wrapped_function_given_no_parameter_is_refused():
  """Closed-over parameters are constants of the traced program: they
  would train ordinarily, silently. (The class patch found them by
  identity wherever they came from.)
  """
  loss_fn, params = _nnx_mlp()
  tx = immgrad.shim(optax.sgd(0.1))

  def step_loss(params, x, y):
    return immgrad.flax.immediate(lambda x, y: loss_fn(params, x, y))(x, y)

  with pytest.raises(
    ValueError, match="<lambda> was called in a step with none"
  ):
    immgrad.value_and_grad(step_loss, tx)(
      params, tx.init(params), jnp.ones((2, 5)), jnp.zeros((2, 3))
    )


@pytest.mark.parametrize("modules", ["default", "chosen"])
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_layers_agrees_with_the_step_and_its_modules(api, modules):
  """immgrad.layers on an immgrad.flax.immediate loss reports what the
  step does, modules= included (it listed every leaf as immediate): with
  the dense layer's class only, the LayerNorm's leaves are ordinary,
  saying why, the dense layer's immediate.
  """
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
  if api == "nnx":
    model = nnx.Sequential(
      nnx.LayerNorm(3, rngs=nnx.Rngs(0)), nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    )
    graphdef, params = nnx.split(model, nnx.Param)
    apply = lambda p, x: nnx.merge(graphdef, p)(x)
    dense, norm = "['layers'][1]", "['layers'][0]"
    names = ("kernel", "bias"), ("scale", "bias")
  else:
    model = nn.Sequential([nn.LayerNorm(), nn.Dense(2)])
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    apply = lambda p, x: model.apply({"params": p}, x)
    dense, norm = "['layers_1']", "['layers_0']"
    names = ("kernel", "bias"), ("scale", "bias")
  leaf = "['{}'].value" if api == "nnx" else "['{}']"
  options = {} if modules == "default" else {"modules": (nnx.Linear, nn.Dense)}
  loss_fn = lambda p, x: jnp.sum(jnp.sin(apply(p, x)))
  wrapped = immgrad.flax.immediate(loss_fn, **options)
  _, grads = _step_of(loss_fn, params, x, **options)
  table = immgrad.layers(wrapped, params, x)
  immediate = oracles.layers_agree(table, grads)
  linear = {dense + leaf.format(n) for n in names[0]}
  layer_norm = {norm + leaf.format(n) for n in names[1]}
  if modules == "default":
    assert immediate == linear | layer_norm
  else:
    assert immediate == linear
    assert all("modules=" in table[path].why for path in layer_norm)


# -- what used to be refused, now trained as plain ---------------------------


def test_nnx_layer_norm_with_custom_promote_dtype_trains_as_plain():
  """Refused while immgrad re-implemented LayerNorm; now Flax's own code
  (with the custom promote_dtype) runs, and its scale and bias are
  immediate.
  """
  promote = lambda args, dtype=None, inexact=True: args
  model = nnx.LayerNorm(4, promote_dtype=promote, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = _random_like(params, jax.random.PRNGKey(2))
  loss_fn = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x)))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 4))
  assert all(_assert_plain(loss_fn, params, x))


class _Tied(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(7, 4)
    return embed.attend(embed(ids))


def _twice_nnx():
  graphdef, params = nnx.split(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Param)

  def loss_fn(p, x):
    layer = nnx.merge(graphdef, p)
    return jnp.sum(jnp.sin(layer(layer(x))))

  return loss_fn, params, jnp.ones((2, 3))


def _tied_linen():
  model, ids = _Tied(), jnp.array([1, 3], jnp.int32)
  params = model.init(jax.random.PRNGKey(0), ids)["params"]
  return (
    lambda p, i: jnp.sum(jnp.sin(model.apply({"params": p}, i))),
    params,
    ids,
  )


@pytest.mark.parametrize("case", ["tied embedding", "module called twice"])
def test_a_weight_read_twice_trains_ordinarily_and_is_reported(case):
  """Refused before (JAX would add the two immediate layers' new weights).
  immgrad.immediate gives a leaf read by two layers an ordinary gradient,
  and immgrad.layers says so.
  """
  loss_fn, params, x = (
    _tied_linen if case == "tied embedding" else _twice_nnx
  )()
  assert not any(_assert_plain(loss_fn, params, x))
  report = immgrad.layers(immgrad.flax.immediate(loss_fn), params, x)
  assert str(report).count("read by 2 layers") == len(jax.tree.leaves(params))


class _RematDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.remat(nn.Dense)(3)(x)


def _transformed_losses():
  graphdef, params = nnx.split(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Param)
  merge = lambda p: nnx.merge(graphdef, p)
  linen = _RematDense()
  linen_params = linen.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
  return {
    "jax.checkpoint": (
      lambda p, x: jnp.sum(jax.checkpoint(lambda x: merge(p)(x))(x) ** 2),
      params,
    ),
    "nnx.remat": (
      lambda p, x: jnp.sum(nnx.remat(lambda m, x: m(x))(merge(p), x) ** 2),
      params,
    ),
    "nnx.jit": (
      lambda p, x: jnp.sum(nnx.jit(lambda m, x: m(x))(merge(p), x) ** 2),
      params,
    ),
    "nn.remat": (
      lambda p, x: jnp.sum(linen.apply({"params": p}, x) ** 2),
      linen_params["params"],
    ),
  }


@pytest.mark.parametrize(
  "transform", ["jax.checkpoint", "nnx.remat", "nnx.jit", "nn.remat"]
)
def test_module_inside_a_transformation_trains_as_plain(transform):
  """Refused before (the transformation hands the module copies of its
  weights, which the class patch could not step). The leaves are found in
  the graph nnx.merge builds before the transformation (NNX) or by scope
  path below the module holding them (Linen), and immgrad.immediate runs
  the traced checkpoint or jit: every leaf immediate.
  """
  loss_fn, params = _transformed_losses()[transform]
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3))
  assert all(_assert_plain(loss_fn, params, x))


@pytest.mark.parametrize("modules", [None, (nnx.Linear,)])
@pytest.mark.parametrize("transform", ["jax.vmap", "jax.jit", "jax.checkpoint"])
def test_module_merged_inside_a_transformation_trains_as_plain(
  transform, modules
):
  """The parameters passed into a JAX transformation and the module merged
  inside it (an ensemble mapped by jax.vmap; a jit or checkpoint taking
  the params): the module holds the transformation's copies, but a leaf's
  module is found by its path, and immgrad.immediate traces through the
  transformation, so every leaf is immediate and trains as plain.
  """
  graphdef, params = nnx.split(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Param)
  params = _random_like(params, jax.random.PRNGKey(2))
  if transform == "jax.vmap":
    params = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), params)
    apply = jax.vmap(lambda p, x: nnx.merge(graphdef, p)(x), in_axes=(0, None))
  else:
    wrap = jax.jit if transform == "jax.jit" else jax.checkpoint
    apply = wrap(lambda p, x: nnx.merge(graphdef, p)(x))
  loss_fn = lambda p, x: jnp.sum(jnp.sin(apply(p, x)))
  assert all(_assert_plain(loss_fn, params, jnp.ones((2, 3)), modules=modules))


@pytest.mark.parametrize("modules", [None, (nn.Dense,)])
def test_linen_module_applied_inside_jax_jit_trains_as_plain(modules):
  """Linen's model.apply inside a jax.jit that takes the params: the
  module's variables are jit's copies, found by their scope path.
  """
  model = nn.Dense(2)
  x = jnp.ones((2, 3))
  params = model.init(jax.random.PRNGKey(0), x)["params"]
  apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
  loss_fn = lambda p, x: jnp.sum(jnp.sin(apply(p, x)))
  assert all(_assert_plain(loss_fn, params, x, modules=modules))


@pytest.mark.parametrize("modules", ["default", "chosen"])
@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_params_cast_before_merge_train_as_plain(api, modules):
  """A cast of the whole params tree before nnx.merge or model.apply
  (bfloat16 compute the hand-made way; the module's ``dtype=`` is the
  usual one): the cast is parameter-only preprocessing of each layer, so
  the float32 leaves are immediate (with modules=, the dense layer's) and
  the step equals plain JAX's, bitwise.
  """
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3))
  if api == "nnx":
    graphdef, params = nnx.split(ScaledMLP(nnx.Rngs(0)), nnx.Param)
    apply = lambda p, x: nnx.merge(graphdef, p)(x)
  else:
    model = nn.Sequential([nn.Dense(4), nn.LayerNorm()])
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    apply = lambda p, x: model.apply({"params": p}, x)

  def loss_fn(p, x):
    p = jax.tree.map(lambda a: a.astype(BF16), p)
    return jnp.sum(jnp.sin(apply(p, x.astype(BF16)))).astype(F32)

  chosen = {"modules": (nnx.Linear, nn.Dense)} if modules == "chosen" else {}
  stepped = _assert_plain(loss_fn, params, x, **chosen)
  # Dense/Linear first, then the LayerNorm's or Scale's two leaves.
  assert stepped == [True] * 2 + [modules == "default"] * 2


def test_profilers_keep_working_through_a_step():
  """The module lookup sets no hook: cProfile runs a step of a loss with
  modules= (which looks the modules up), and a profile function set before
  the step is still set after it.
  """
  graphdef, params = nnx.split(ScaledMLP(nnx.Rngs(0)), nnx.Param)
  loss_fn = lambda p, x: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(x)))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3))
  step = lambda: _step_of(loss_fn, params, x, modules=(nnx.Linear,))
  _, grads = cProfile.Profile().runcall(step)
  assert _grads(grads)[1] == [True, True, False, False]
  calls = []
  hook = lambda frame, event, arg: calls.append(event)
  sys.setprofile(hook)
  try:
    step()
    assert sys.getprofile() is hook
  finally:
    sys.setprofile(None)
  assert calls


def test_without_flax_import_says_what_to_install():
  code = (
    "import sys; sys.modules['flax'] = None; import immgrad; "
    "assert 'flax' not in [m.split('.')[0] for m in sys.modules "
    "if sys.modules[m] is not None]\n"
    "try:\n  import immgrad.flax\nexcept ImportError as e:\n"
    "  print(e)"
  )
  done = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'pip install "immgrad[flax]"' in done.stdout


# -- the example ------------------------------------------------------------


def test_flax_digits_example_learns():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [sys.executable, "examples/flax_digits.py", "--epochs", "2"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  accuracy = [
    float(a) for a in re.findall(r"test accuracy ([\d.]+)", done.stdout)
  ]
  assert len(accuracy) == 2 and accuracy[-1] > 0.8, done.stdout
