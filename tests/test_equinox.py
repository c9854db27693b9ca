"""Unmodified Equinox models made immediate by ``immgrad.equinox.immediate``.

The models are written in Equinox's idiom (as in its official examples): an
``eqx.Module`` whose ``__call__`` takes one example, ``jax.vmap(model)(x)``
in the loss, ``eqx.partition(model, eqx.is_inexact_array)`` for the params
and ``eqx.filter_jit`` around the step. References never call immgrad:
``eqx.filter_value_and_grad`` + optax on the very same model
(``mode="current"``), and the sequential re-linearization built from
Equinox's plain modules (``mode="updated"``, oracles.sequential_steps).

Tolerance: atol=1e-6, rtol=1e-5 over 5 steps, as in tests/test_current.py:
float32 rounding of differently fused programs (an immediate layer's dW is
one dot_general over the batch, plain training's the transpose of vmap's;
they differ by an ulp or two, which adam carries on). Forward passes are
compared bitwise: the layers reproduce Equinox's arithmetic exactly.
"""

import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest

pytest.importorskip(
  "equinox",
  reason="immgrad.equinox needs the equinox extra "
  "(equinox 0.13.8 refuses jax 0.7.0 and 0.7.1)",
)

import chex
import equinox as eqx
import jax
from jax import lax
import jax.numpy as jnp
import optax

import immgrad
import immgrad.equinox
import oracles

ATOL, RTOL = 1e-6, 1e-5
STEPS = 5
ROOT = pathlib.Path(__file__).resolve().parent.parent


def _is_grad(g):
  return isinstance(g, (immgrad.ImmediateGrad, immgrad.Stepped))


def _kinds(grads):
  return [type(g).__name__ for g in jax.tree.leaves(grads, is_leaf=_is_grad)]


def _grads(loss_fn, params, *batch, modules=None, mode="updated"):
  """The grads of one immediate step (sgd), to see which leaves it stepped."""
  tx = immgrad.shim(optax.sgd(0.1))
  return immgrad.value_and_grad(
    immgrad.equinox.immediate(loss_fn, modules), tx, mode=mode
  )(params, tx.init(params), *batch)[1]


def _runs(
  loss_fn,
  opt,
  params,
  batches,
  mode="current",
  atomic=True,
  modules=None,
):
  """Plain Equinox training and immgrad's, both under ``eqx.filter_jit``."""
  tx = immgrad.shim(opt, atomic=atomic)

  @eqx.filter_jit
  def plain_step(params, state, *batch):
    out, grads = eqx.filter_value_and_grad(loss_fn)(params, *batch)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, out

  @eqx.filter_jit
  def immediate_step(params, state, *batch):
    out, grads = immgrad.value_and_grad(
      immgrad.equinox.immediate(loss_fn, modules), tx, mode=mode
    )(params, state, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, out

  def run(step, state):
    p, history, outs = params, [], []
    for batch in batches:
      p, state, out = step(p, state, *batch)
      history.append(p)
      outs.append(out)
    return history, outs

  return (
    run(immediate_step, tx.init(params)),
    run(plain_step, opt.init(params)),
  )


# -- each module, alone: bitwise forward, the batch gradient, Stepped -------

_KEYS = jax.random.split(jax.random.PRNGKey(0), 8)
MODULES = {
  "linear": (eqx.nn.Linear(3, 5, key=_KEYS[0]), (3,)),
  "linear_bf16_no_bias": (
    eqx.nn.Linear(3, 5, use_bias=False, dtype=jnp.bfloat16, key=_KEYS[1]),
    (3,),
  ),
  "linear_scalar": (eqx.nn.Linear("scalar", "scalar", key=_KEYS[2]), ()),
  "conv2d_same": (
    eqx.nn.Conv2d(2, 4, 3, padding="SAME", key=_KEYS[3]),
    (2, 6, 6),
  ),
  "conv2d_replicate": (
    eqx.nn.Conv2d(2, 3, 3, padding=1, padding_mode="REPLICATE", key=_KEYS[2]),
    (2, 5, 5),
  ),
  "conv1d_groups_reflect": (
    eqx.nn.Conv1d(
      4,
      6,
      3,
      stride=2,
      dilation=2,
      groups=2,
      padding=2,
      padding_mode="REFLECT",
      key=_KEYS[4],
    ),
    (4, 9),
  ),
  "conv3d_circular": (
    eqx.nn.Conv3d(
      1, 2, 2, padding="SAME", padding_mode="CIRCULAR", key=_KEYS[5]
    ),
    (1, 4, 4, 4),
  ),
  "layer_norm": (eqx.nn.LayerNorm((3, 5)), (3, 5)),
  "rms_norm_with_bias": (eqx.nn.RMSNorm(5, use_bias=True), (5,)),
  "embedding": (eqx.nn.Embedding(11, 4, key=_KEYS[6]), "ids"),
}


def _randomised(module):
  """``module`` with every parameter random (scale and bias nontrivial)."""
  params, static = eqx.partition(module, eqx.is_inexact_array)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(_KEYS[7], len(leaves))
  leaves = [
    jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)
  ]
  return treedef.unflatten(leaves), static


@pytest.mark.parametrize("name", list(MODULES))
def test_each_module_reproduces_equinox_and_steps_on_the_batch(name):
  module, shape = MODULES[name]
  params, static = _randomised(module)
  if shape == "ids":
    x = jax.random.randint(_KEYS[0], (6,), 0, 11)
  else:
    x = jax.random.normal(_KEYS[1], (6,) + shape)

  def loss_fn(params, x):
    out = jax.vmap(eqx.combine(params, static))(x)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  tx = immgrad.shim(optax.sgd(0.1))
  loss, grads = jax.jit(
    immgrad.value_and_grad(
      immgrad.equinox.immediate(loss_fn), tx, mode="current"
    )
  )(params, tx.init(params), x)
  plain_loss, plain_grads = jax.jit(jax.value_and_grad(loss_fn))(params, x)
  assert jnp.array_equal(loss, plain_loss)  # The forward pass, bitwise.
  assert set(_kinds(grads)) == {"ImmediateGrad"}, _kinds(grads)
  got = jax.tree.map(lambda g: g.grad, grads, is_leaf=_is_grad)
  # One dot_general over the batch against vmap's transpose: an ulp or two
  # (bfloat16 weights: their ulp).
  tol = 1e-2 if "bf16" in name else ATOL
  chex.assert_trees_all_close(got, plain_grads, atol=tol, rtol=tol)


def test_other_threads_see_equinox_while_a_model_runs():
  lin = eqx.nn.Linear(3, 2, key=_KEYS[0])
  params, static = eqx.partition(lin, eqx.is_inexact_array)
  seen = []

  def other_thread():  # In a step of its own, but not wrapped: ordinary.
    tx = immgrad.shim(optax.sgd(0.1))
    loss = lambda p, x: jnp.sum(eqx.combine(p, static)(x))
    # mode="current": without a layer, "updated" is refused.
    _, grads = immgrad.value_and_grad(loss, tx, mode="current")(
      params, tx.init(params), jnp.ones(3)
    )
    seen.extend(_kinds(grads))

  def fn():
    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()

  immgrad.equinox.immediate(fn)()
  assert len(seen) == 2 and "ImmediateGrad" not in seen, seen


# -- a CNN, as in Equinox's MNIST example ----------------------------------


class CNN(eqx.Module):
  """Equinox's CNN example: per-example ``__call__`` on a (1, 8, 8) image."""

  layers: list

  def __init__(self, key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    self.layers = [
      eqx.nn.Conv2d(1, 4, kernel_size=3, key=k1),
      eqx.nn.MaxPool2d(kernel_size=2),
      jax.nn.relu,
      jnp.ravel,
      eqx.nn.Linear(4 * 5 * 5, 32, key=k2),
      jax.nn.sigmoid,
      eqx.nn.Linear(32, 16, key=k3),
      jax.nn.relu,
      eqx.nn.Linear(16, 10, key=k4),
      jax.nn.log_softmax,
    ]

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


def _cnn_setup():
  model = CNN(jax.random.PRNGKey(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  keys = jax.random.split(jax.random.PRNGKey(1), 2 * STEPS)
  data = [
    (
      jax.random.normal(keys[2 * i], (16, 1, 8, 8)),
      jax.random.randint(keys[2 * i + 1], (16,), 0, 10),
    )
    for i in range(STEPS)
  ]

  def loss_fn(params, x, y):
    model = eqx.combine(params, static)
    log_p = jax.vmap(model)(x)
    return -jnp.mean(jnp.take_along_axis(log_p, y[:, None], axis=1))

  return params, data, loss_fn


@pytest.mark.parametrize(
  "opt", [optax.sgd(0.1), optax.adam(1e-2)], ids=["sgd", "adam"]
)
def test_cnn_current_equals_plain_equinox(opt):
  params, data, loss_fn = _cnn_setup()
  got, expected = _runs(loss_fn, opt, params, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  # The params tree is Equinox's own, unchanged.
  assert jax.tree.structure(got[0][-1]) == jax.tree.structure(params)


# -- a small transformer: Embedding, MultiheadAttention, LayerNorm, MLP -----

VOCAB, SEQ, D, HEADS = 13, 6, 16, 2


class Block(eqx.Module):
  """A pre-norm transformer block on one sequence, with dropout."""

  norm1: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  norm2: eqx.nn.RMSNorm
  mlp: eqx.nn.MLP
  dropout: eqx.nn.Dropout

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.norm1 = eqx.nn.LayerNorm(D)
    self.attention = eqx.nn.MultiheadAttention(HEADS, D, dropout_p=0.1, key=k1)
    self.norm2 = eqx.nn.RMSNorm(D)
    self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, activation=jax.nn.gelu, key=k2)
    self.dropout = eqx.nn.Dropout(0.1)

  def __call__(self, h, mask, key):
    k1, k2 = jax.random.split(key)
    a = jax.vmap(self.norm1)(h)
    h = h + self.attention(a, a, a, mask=mask, key=k1)
    m = jax.vmap(self.mlp)(jax.vmap(self.norm2)(h))
    return h + self.dropout(m, key=k2)


class Transformer(eqx.Module):
  embedding: eqx.nn.Embedding
  position: jax.Array  # A plain parameter array: ordinary gradients.
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 4)
    self.embedding = eqx.nn.Embedding(VOCAB, D, key=keys[0])
    self.position = 0.1 * jax.random.normal(keys[1], (SEQ, D))
    self.blocks = [Block(keys[2])]
    self.norm = eqx.nn.LayerNorm(D)
    self.head = eqx.nn.Linear(D, VOCAB, key=keys[3])

  def __call__(self, ids, key):
    h = jax.vmap(self.embedding)(ids) + self.position
    mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
      h = block(h, mask, k)
    return jax.vmap(self.head)(jax.vmap(self.norm)(h))


def test_transformer_with_dropout_current_equals_plain_equinox():
  model = Transformer(jax.random.PRNGKey(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  keys = jax.random.split(jax.random.PRNGKey(1), 2 * STEPS)
  data = [
    (jax.random.randint(keys[2 * i], (4, SEQ + 1), 0, VOCAB), keys[2 * i + 1])
    for i in range(STEPS)
  ]

  def loss_fn(params, tokens, key):
    model = eqx.combine(params, static)
    keys = jax.random.split(key, tokens.shape[0])  # Dropout per example.
    logits = jax.vmap(model)(tokens[:, :-1], keys)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  # atomic=False: the atomic check is tested on the other models, and
  # doubles this one's compile time.
  got, expected = _runs(loss_fn, optax.adam(1e-3), params, data, atomic=False)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


class Positions(eqx.Module):
  """Token and position embeddings, each an ``eqx.nn.Embedding``."""

  tokens: eqx.nn.Embedding
  positions: eqx.nn.Embedding
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.tokens = eqx.nn.Embedding(VOCAB, D, key=k1)
    self.positions = eqx.nn.Embedding(SEQ, D, key=k2)
    self.head = eqx.nn.Linear(D, VOCAB, key=k3)

  def __call__(self, ids):
    # The inner vmap maps an index that does not depend on the outer one.
    h = jax.vmap(self.tokens)(ids) + jax.vmap(self.positions)(jnp.arange(SEQ))
    return jax.vmap(self.head)(jnp.tanh(h))


def test_position_embedding_under_vmap_trains_like_plain():
  """The positions' lookup is parameter-only: the ``add`` is their layer."""
  params, static = eqx.partition(
    Positions(jax.random.PRNGKey(0)), eqx.is_inexact_array
  )
  keys = jax.random.split(jax.random.PRNGKey(1), STEPS)
  data = [(jax.random.randint(k, (4, SEQ + 1), 0, VOCAB),) for k in keys]

  def loss_fn(params, tokens):
    logits = jax.vmap(eqx.combine(params, static))(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  got, expected = _runs(loss_fn, optax.adam(1e-2), params, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  assert set(_kinds(_grads(loss_fn, params, *data[0]))) == {"ImmediateGrad"}


# -- BatchNorm state, a collective over the vmap axis ----------------------


class Normalised(eqx.Module):
  linear1: eqx.nn.Linear
  norm: eqx.nn.BatchNorm
  linear2: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    # No bias before BatchNorm: its gradient would be rounding noise, which
    # adam turns into full steps.
    self.linear1 = eqx.nn.Linear(5, 8, use_bias=False, key=k1)
    self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
    self.linear2 = eqx.nn.Linear(8, 3, key=k2)

  def __call__(self, x, state):
    h, state = self.norm(self.linear1(x), state)
    return self.linear2(jax.nn.relu(h)), state


def test_batch_norm_state_under_vmap_axis_name():
  model, state = eqx.nn.make_with_state(Normalised)(jax.random.PRNGKey(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 5), (8, 3))

  def loss_fn(params, x, y, state):
    model = eqx.combine(params, static)
    out, state = jax.vmap(
      model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)
    return oracles.mse(out, y), state

  tx = immgrad.shim(optax.adam(1e-2))
  opt = optax.adam(1e-2)

  @eqx.filter_jit
  def immediate_step(p, s, st, x, y):
    (loss, st), grads = immgrad.value_and_grad(
      immgrad.equinox.immediate(loss_fn), tx, mode="current", has_aux=True
    )(p, s, x, y, st)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, st, loss, grads

  @eqx.filter_jit
  def plain_step(p, s, st, x, y):
    (loss, st), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
      p, x, y, st
    )
    updates, s = opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s, st, loss

  a = (params, tx.init(params), state)
  b = (params, opt.init(params), state)
  for x, y in data:
    *a, loss_a, grads = immediate_step(*a, x, y)
    *b, loss_b = plain_step(*b, x, y)
    chex.assert_trees_all_close(loss_a, loss_b, atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(a[0], b[0], atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(a[2], b[2], atol=ATOL, rtol=RTOL)  # The state.
  kinds = dict(
    zip(
      [
        "linear1.weight",
        "norm.bias",
        "norm.weight",
        "linear2.bias",
        "linear2.weight",
      ],
      _kinds(grads),
    )
  )
  # Every parameter immediate by default, BatchNorm's weight too.
  assert set(kinds.values()) == {"ImmediateGrad"}, kinds


# -- mode="updated": the sequential re-linearization -----------------------


class Chain(eqx.Module):
  layers: list

  def __init__(self, sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    self.layers = [
      eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)
    ]

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jnp.tanh(layer(x))
    return self.layers[-1](x)


@pytest.mark.parametrize(
  "vmap", [jax.vmap, eqx.filter_vmap], ids=["jax.vmap", "eqx.filter_vmap"]
)
def test_chain_updated_equals_sequential_from_plain_equinox(vmap):
  model = Chain((5, 8, 8, 3), jax.random.PRNGKey(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 5), (8, 3))
  names = tuple(f"layer{i}" for i in range(3))
  statics = eqx.partition(static, lambda _: False)[1].layers

  def plain_layer(i):  # Equinox's own Linear, vmapped over the batch.
    return lambda x, p: jax.vmap(eqx.combine(p, statics[i]))(x)

  chain = oracles.Chain(
    tuple(plain_layer(i) for i in range(3)),
    names,
    (jnp.tanh, jnp.tanh, oracles.identity),
    oracles.mse,
  )
  by_name = lambda p: dict(zip(names, p.layers))
  opt = optax.adam(1e-2)
  expected = oracles.sequential_steps(chain, opt, by_name(params), data)

  def loss_fn(params, x, y):
    return oracles.mse(vmap(eqx.combine(params, static))(x), y)

  got = _runs(loss_fn, opt, params, data, mode="updated")[0]
  got = ([by_name(p) for p in got[0]], got[1])
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


# -- choosing modules, and what is refused ---------------------------------


def test_modules_picks_some():
  model = eqx.nn.Sequential(
    [eqx.nn.Linear(3, 4, key=_KEYS[0]), eqx.nn.LayerNorm(4)]
  )
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, x):
    return jnp.sum(jax.vmap(eqx.combine(params, static))(x) ** 2)

  tx = immgrad.shim(optax.sgd(0.1))
  _, grads = immgrad.value_and_grad(
    immgrad.equinox.immediate(loss_fn, modules=(eqx.nn.Linear,)), tx
  )(params, tx.init(params), jnp.ones((2, 3)))
  kinds = _kinds(grads)
  assert kinds[:2] == ["ImmediateGrad"] * 2, kinds  # Linear: weight, bias.
  assert "ImmediateGrad" not in kinds[2:], kinds  # LayerNorm: ordinary.
  # Anything but a tuple (or list) of eqx.Module classes: a TypeError with
  # the fix, as in the Haiku and Flax adapters.
  for bad in [(jax.nn.relu,), eqx.nn.Linear, model]:
    with pytest.raises(
      TypeError,
      match=r"modules= takes a tuple of eqx.Module classes.*"
      r"immgrad.equinox.DEFAULT_MODULES \+ \(MyModule,\)",
    ):
      immgrad.equinox.immediate(loss_fn, modules=bad)


def test_parameters_closed_over_are_refused():
  """``fn`` must get the parameters: closed over, they would be data."""
  params, static = eqx.partition(
    eqx.nn.Linear(3, 2, key=_KEYS[0]), eqx.is_inexact_array
  )

  def loss_fn(params, x):
    forward = lambda x: jax.vmap(eqx.combine(params, static))(x)
    return jnp.sum(immgrad.equinox.immediate(forward)(x))

  tx = immgrad.shim(optax.sgd(0.1))
  with pytest.raises(ValueError, match="none of the step's parameters"):
    immgrad.value_and_grad(loss_fn, tx)(params, tx.init(params), jnp.ones(3))


def test_a_layer_in_a_cond_is_refused_by_its_equinox_path():
  params, static = eqx.partition(
    eqx.nn.Linear(3, 2, key=_KEYS[0]), eqx.is_inexact_array
  )

  def loss_fn(params, x):
    model = jax.vmap(eqx.combine(params, static))
    return lax.cond(x.sum() > 0, lambda x: jnp.sum(model(x)), jnp.sum, x)

  tx = immgrad.shim(optax.sgd(0.1))
  step = immgrad.value_and_grad(immgrad.equinox.immediate(loss_fn), tx)
  with pytest.raises(ValueError, match=r"args\[0\]\.bias.*inside `cond`"):
    step(params, tx.init(params), jnp.ones((4, 3)))


@pytest.mark.parametrize(
  "modules,kind",
  [
    (None, "ImmediateGrad"),
    (immgrad.equinox.DEFAULT_MODULES, "ArrayImpl"),
    ((eqx.nn.ConvTranspose2d,), "ImmediateGrad"),
  ],
  ids=["default", "library modules", "chosen"],
)
def test_conv_transpose_trains_like_plain(modules, kind):
  """Immediate by default and when chosen (the program's conv); ordinary
  with the library's DEFAULT_MODULES, which leave it out. With no layer
  chosen, mode="updated" is refused: the grads are current's.
  """
  model = eqx.nn.ConvTranspose2d(2, 3, 3, key=_KEYS[0])
  params, static = eqx.partition(model, eqx.is_inexact_array)
  keys = jax.random.split(_KEYS[1], 2)
  data = [
    (
      jax.random.normal(keys[0], (4, 2, 5, 5)),
      jax.random.normal(keys[1], (4, 3, 7, 7)),
    )
  ]

  def loss_fn(params, x, y):
    return oracles.mse(jax.vmap(eqx.combine(params, static))(x), y)

  got, expected = _runs(
    loss_fn, optax.adam(1e-2), params, data, modules=modules
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  mode = "updated" if kind == "ImmediateGrad" else "current"
  grads = _grads(loss_fn, params, *data[0], modules=modules, mode=mode)
  assert set(_kinds(grads)) == {kind}


def test_weights_mapped_by_vmap_train_like_plain():
  """An ensemble made with ``eqx.filter_vmap``: one layer per stacked leaf.

  Each member's slice of the stacked weight gets its own member's gradient,
  so one step of the whole leaf is each member's step.
  """
  ensemble = eqx.filter_vmap(lambda k: eqx.nn.Linear(5, 3, key=k))(
    jax.random.split(_KEYS[0], 4)
  )
  params, static = eqx.partition(ensemble, eqx.is_inexact_array)
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 5), (8, 3))

  def loss_fn(params, x, y):
    members = eqx.combine(params, static)
    out = eqx.filter_vmap(lambda m: jax.vmap(m)(x))(members)
    return oracles.mse(out, y)

  got, expected = _runs(loss_fn, optax.adam(1e-2), params, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  assert set(_kinds(_grads(loss_fn, params, *data[0]))) == {"ImmediateGrad"}


def test_scanned_mlp_trains_like_plain_and_sequential():
  """``eqx.nn.MLP(scan=True)``: its ``lax.scan`` runs as ``immgrad.scan``.

  Each hidden layer steps its own slice of the stacked weights: ``current``
  is plain training, ``updated`` the sequential re-linearization of the
  four layers, built from Equinox's plain ``Linear``.
  """
  model = eqx.nn.MLP(5, 3, 8, 3, scan=True, key=_KEYS[0])
  params, static = eqx.partition(model, eqx.is_inexact_array)
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 5), (8, 3))
  opt = optax.adam(1e-2)

  def loss_fn(params, x, y):
    return oracles.mse(jax.vmap(eqx.combine(params, static))(x), y)

  got, expected = _runs(loss_fn, opt, params, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  assert set(_kinds(_grads(loss_fn, params, *data[0]))) == {"ImmediateGrad"}

  names = ("input", "hidden0", "hidden1", "output")
  first, hidden, last = static.layers
  statics = (first, hidden, hidden, last)

  def by_name(p):
    first, hidden, last = p.layers
    at = lambda i: jax.tree.map(lambda a: a[i], hidden)
    return dict(zip(names, (first, at(0), at(1), last)))

  def plain_layer(i):  # Equinox's own Linear, vmapped over the batch.
    return lambda x, p: jax.vmap(eqx.combine(p, statics[i]))(x)

  chain = oracles.Chain(
    tuple(plain_layer(i) for i in range(4)),
    names,
    (jax.nn.relu,) * 3 + (oracles.identity,),
    oracles.mse,
  )
  expected = oracles.sequential_steps(chain, opt, by_name(params), data)
  got = _runs(loss_fn, opt, params, data, mode="updated")[0]
  got = ([by_name(p) for p in got[0]], got[1])
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_outside_a_step_the_model_is_equinox():
  """Same values and gradients, bitwise, as the unwrapped loss."""
  params, data, loss_fn = _cnn_setup()
  x, y = data[0]
  chex.assert_trees_all_equal(
    jax.value_and_grad(immgrad.equinox.immediate(loss_fn))(params, x, y),
    jax.value_and_grad(loss_fn)(params, x, y),
  )


def test_import_without_equinox_says_what_to_install():
  code = (
    "import sys; sys.modules['equinox'] = None\n"
    "try:\n  import immgrad.equinox\n"
    "except ImportError as e:\n  print(e)\n"
  )
  done = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "PYTHONPATH": str(ROOT)},
  )
  assert 'pip install "immgrad[equinox]"' in done.stdout, done.stderr


def test_equinox_digits_example_learns():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [sys.executable, "examples/equinox_digits.py", "--epochs", "2"],
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


@pytest.mark.parametrize("modules", [None, (eqx.nn.Linear,)])
def test_layers_agrees_with_the_step_and_its_modules(modules):
  """immgrad.layers on an immgrad.equinox.immediate loss reports what the
  step does, modules= included: with (eqx.nn.Linear,) the LayerNorm's
  leaves are ordinary, saying why, the Linear's immediate.
  """
  model = eqx.nn.Sequential(
    [eqx.nn.LayerNorm(3), eqx.nn.Linear(3, 2, key=_KEYS[0])]
  )
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, x):
    return jnp.sum(jnp.sin(jax.vmap(eqx.combine(params, static))(x)))

  wrapped = immgrad.equinox.immediate(loss_fn, modules)
  x = jax.random.normal(_KEYS[1], (4, 3))
  grads = _grads(loss_fn, params, x, modules=modules)
  table = immgrad.layers(wrapped, params, x)
  immediate = oracles.layers_agree(table, grads)
  linear = {".layers[1].weight", ".layers[1].bias"}
  if modules is None:
    assert immediate == linear | {".layers[0].weight", ".layers[0].bias"}
  else:
    assert immediate == linear
    assert "modules=" in table[".layers[0].weight"].why
