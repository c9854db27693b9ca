"""Models of the kinds found in the libraries' own examples (issue 24).

Written here, not copied: a miniGPT-like NNX model on a mesh of
``Explicit`` and of ``Auto`` axes (tensor-parallel kernels, a batch-sharded
input, ``Embed(..., out_sharding=...)``), a tied-embedding LM and an L2
term in the loss. Each is compared with plain training, the reference:
``jax.value_and_grad`` + optax on the same model.

Tolerances. ``mode="current"`` with the immediate layers stepping inside
the backward pass is plain training up to XLA fusing the optimizer's
arithmetic differently: ``atol=1e-6, rtol=1e-5`` over 3 steps, as in the
rest of the suite (tests/test_current.py). Moving an L2 term from the loss
into ``optax.add_decayed_weights`` is the same update up to the rounding
of ``2 * wd * w`` added before or after the loss's other gradients:
the same tolerance.
"""

import re

import pytest

pytest.importorskip(
  "flax",
  reason="immgrad.flax needs the flax extra (flax 0.12.8 needs jax >= 0.10)",
)

import chex
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

import immgrad
import immgrad.flax
import oracles

ATOL, RTOL = 1e-6, 1e-5
STEPS = 3
VOCAB, D, HEADS, BLOCKS, T = 32, 16, 2, 2, 8

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _train(loss_fn, params, batches, tx, step_fn):
  state = tx.init(params)
  for batch in batches:
    params, state = step_fn(params, state, batch)
  return params


def _plain(loss_fn, tx):
  @jax.jit
  def step(params, state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _immediate(loss_fn, tx, mode="current"):
  @jax.jit
  def step(params, state, batch):
    _, grads = immgrad.value_and_grad(loss_fn, tx, mode=mode)(
      params, state, batch
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


# -- miniGPT-like, on a mesh (Flax's miniGPT tutorial's kind of model) ------


def _sharded(init, spec):
  return nnx.with_partitioning(init, spec)


class _Block(nnx.Module):
  """Pre-LN block: tensor-parallel attention and MLP, as in the tutorial."""

  def __init__(self, rngs):
    kernel = nnx.initializers.xavier_uniform()
    zeros = nnx.initializers.zeros_init()
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      num_heads=HEADS,
      in_features=D,
      decode=False,
      rngs=rngs,
      kernel_init=_sharded(kernel, (None, "model")),
      bias_init=_sharded(zeros, ("model",)),
    )
    self.ln2 = nnx.LayerNorm(
      D,
      rngs=rngs,
      scale_init=_sharded(nnx.initializers.ones_init(), ("model",)),
      bias_init=_sharded(zeros, ("model",)),
    )
    self.up = nnx.Linear(
      D,
      4 * D,
      rngs=rngs,
      kernel_init=_sharded(kernel, (None, "model")),
      bias_init=_sharded(zeros, ("model",)),
    )
    self.down = nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.ln1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class _MiniGPT(nnx.Module):
  def __init__(self, explicit, rngs):
    self.explicit = explicit
    self.tokens = nnx.Embed(VOCAB, D, rngs=rngs)
    self.positions = nnx.Embed(T, D, rngs=rngs)
    self.blocks = nnx.List([_Block(rngs) for _ in range(BLOCKS)])
    self.head = nnx.Linear(
      D,
      VOCAB,
      rngs=rngs,
      kernel_init=_sharded(nnx.initializers.xavier_uniform(), (None, "model")),
      bias_init=_sharded(nnx.initializers.zeros_init(), ("model",)),
    )

  def __call__(self, ids):
    # Under Explicit axes the gather of a batch-sharded input needs its
    # output sharding spelled out, as the tutorial does.
    kwargs = lambda spec: {"out_sharding": spec} if self.explicit else {}
    x = self.tokens(ids, **kwargs(P("batch"))) + self.positions(
      jnp.arange(ids.shape[1])[None], **kwargs(P())
    )
    mask = nnx.make_causal_mask(ids)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(x)


def _lm_loss(logits, targets):
  # One-hot, not a gather: the logits are sharded over the vocabulary.
  log_probs = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.sum(log_probs * jax.nn.one_hot(targets, VOCAB), -1))


@pytest.mark.parametrize(
  "axis_type, atomic",
  [
    (AxisType.Explicit, True),
    (AxisType.Explicit, False),
    (AxisType.Auto, True),
  ],
  ids=["explicit", "explicit-not_atomic", "auto"],
)
def test_minigpt_on_a_mesh_trains_as_plain(axis_type, atomic):
  """Issue 24: the atomic check combined differently sharded leaves."""
  mesh = jax.make_mesh(
    (2, 2), ("batch", "model"), axis_types=(axis_type, axis_type)
  )
  with jax.set_mesh(mesh):
    model = _MiniGPT(axis_type == AxisType.Explicit, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    kernel_spec = params["head"]["kernel"].sharding.spec

    def loss_fn(params, ids):
      logits = nnx.merge(graphdef, params)(ids[:, :-1])
      return _lm_loss(logits, ids[:, 1:])

    batches = [
      jax.device_put(
        jax.random.randint(jax.random.PRNGKey(i), (4, T + 1), 0, VOCAB),
        NamedSharding(mesh, P("batch")),
      )
      for i in range(STEPS)
    ]
    # eps=1e-3: attention's key bias has a gradient that is zero but for
    # rounding (~1e-9, softmax ignores it), which adam's default eps would
    # scale up to +-lr, differently in two fusions of the same arithmetic.
    adam = optax.adam(1e-2, eps=1e-3)
    want = _train(loss_fn, params, batches, adam, _plain(loss_fn, adam))
    tx = immgrad.shim(adam, atomic=atomic)
    got = _train(
      loss_fn,
      params,
      batches,
      tx,
      _immediate(immgrad.flax.immediate(loss_fn), tx),
    )
    chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
    assert got["head"]["kernel"].sharding.spec == kernel_spec
    # "updated" runs there too, and moves the model.
    updated = _train(
      loss_fn,
      params,
      batches,
      tx,
      _immediate(immgrad.flax.immediate(loss_fn), tx, mode="updated"),
    )
    assert float(loss_fn(updated, batches[0])) < float(
      loss_fn(params, batches[0])
    )


# -- tied embeddings (Gemma, wmt) --------------------------------------------


class _TiedLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.hidden = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, ids):
    return self.embed.attend(jnp.tanh(self.hidden(self.embed(ids))))


def _tied():
  graphdef, params = nnx.split(_TiedLM(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, ids):
    return _lm_loss(nnx.merge(graphdef, params)(ids[:, :-1]), ids[:, 1:])

  batches = [
    jax.random.randint(jax.random.PRNGKey(i), (4, T + 1), 0, VOCAB)
    for i in range(STEPS)
  ]
  return loss_fn, params, batches


def _stepped(loss_fn, params, batch, **options):
  """Which leaves one step of ``immediate(loss_fn)`` made immediate."""
  tx = immgrad.shim(optax.sgd(0.1))
  _, grads = immgrad.value_and_grad(
    immgrad.flax.immediate(loss_fn, **options), tx
  )(params, tx.init(params), batch)
  is_immediate = lambda g: isinstance(g, immgrad.ImmediateGrad)
  return jax.tree.map(is_immediate, grads, is_leaf=is_immediate)


def test_tied_embedding_trains_ordinarily_and_is_reported():
  """Refused while immgrad.flax patched nnx.Embed (JAX would add the two
  immediate layers' new tables). immgrad.immediate gives the table, read by
  the lookup and by ``attend``, an ordinary gradient, the rest stays
  immediate, and immgrad.layers says why.
  """
  loss_fn, params, batches = _tied()
  adam = optax.adam(1e-2)
  want = _train(loss_fn, params, batches, adam, _plain(loss_fn, adam))
  tx = immgrad.shim(adam)
  got = _train(
    loss_fn,
    params,
    batches,
    tx,
    _immediate(immgrad.flax.immediate(loss_fn), tx),
  )
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
  stepped = _stepped(loss_fn, params, batches[0])
  assert jax.tree.leaves(stepped["embed"]) == [False]
  assert jax.tree.leaves(stepped["hidden"]) == [True, True]
  report = str(immgrad.layers(loss_fn, params, batches[0]))
  assert re.search(r"\['embed'\]\['embedding'\].*read by 2 layers", report)


def test_tied_embedding_left_out_of_modules_trains_as_plain():
  """The fix the refusal gives: the embedding trains ordinarily."""
  loss_fn, params, batches = _tied()
  adam = optax.adam(1e-2)
  want = _train(loss_fn, params, batches, adam, _plain(loss_fn, adam))
  tx = immgrad.shim(adam)
  modules = tuple(m for m in immgrad.flax.DEFAULT_MODULES if m is not nnx.Embed)
  got = _train(
    loss_fn,
    params,
    batches,
    tx,
    _immediate(immgrad.flax.immediate(loss_fn, modules=modules), tx),
  )
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)


# -- an L2 term in the loss (the Haiku and Flax ImageNet scripts) -----------

WD = 1e-2


def _l2():
  graphdef, params = nnx.split(
    nnx.Sequential(
      nnx.Linear(5, 8, rngs=nnx.Rngs(0)),
      jnp.tanh,
      nnx.Linear(8, 3, rngs=nnx.Rngs(1)),
    ),
    nnx.Param,
  )

  def data_loss(params, batch):
    x, y = batch
    return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

  def l2_loss(params, batch):
    l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(params))
    return data_loss(params, batch) + WD * l2

  keys = jax.random.split(jax.random.PRNGKey(2), 2 * STEPS)
  batches = [
    (
      jax.random.normal(keys[2 * i], (6, 5)),
      jax.random.normal(keys[2 * i + 1], (6, 3)),
    )
    for i in range(STEPS)
  ]
  return data_loss, l2_loss, params, batches


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def _check_l2_folds(wrapped, l2_loss, params, batches):
  """``wrapped`` (an adapter on ``l2_loss``): current is plain training with
  sgd and adam, and every leaf is stepped by its layer (the term folded).
  """
  for opt in OPTIMIZERS.values():
    want = _train(l2_loss, params, batches, opt(), _plain(l2_loss, opt()))
    tx = immgrad.shim(opt())
    got = _train(l2_loss, params, batches, tx, _immediate(wrapped, tx))
    chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
    # The term moved the weights: without it they end elsewhere.
    assert optax.tree.norm(optax.tree.sub(got, params)) > 0
  tx = immgrad.shim(optax.sgd(0.1))
  _, grads = immgrad.value_and_grad(wrapped, tx)(
    params, tx.init(params), batches[0]
  )
  is_immediate = lambda g: isinstance(g, immgrad.ImmediateGrad)
  stepped = jax.tree.leaves(
    jax.tree.map(is_immediate, grads, is_leaf=is_immediate)
  )
  assert stepped and all(stepped), grads
  # And updated runs, moving the model down.
  updated = _train(
    l2_loss, params, batches, tx, _immediate(wrapped, tx, mode="updated")
  )
  assert float(l2_loss(updated, batches[0])) < float(
    l2_loss(params, batches[0])
  )


def test_l2_in_the_loss_folds_into_each_layer_nnx():
  """Flax's ImageNet example writes weight decay as an L2 term of the loss.
  Each weight, read by its layer and by the term, is stepped by its layer
  on both gradients (the term's part for that leaf computed in the layer),
  and immgrad.layers says each is immediate.
  """
  data_loss, l2_loss, params, batches = _l2()
  _check_l2_folds(immgrad.flax.immediate(l2_loss), l2_loss, params, batches)
  report = immgrad.layers(l2_loss, params, batches[0])
  assert all(row.layer is not None for row in report), report
  # Without the term, a different run: the term is not lost.
  sgd = optax.sgd(0.1)
  without = _train(data_loss, params, batches, sgd, _plain(data_loss, sgd))
  tx = immgrad.shim(sgd)
  got = _train(
    l2_loss,
    params,
    batches,
    tx,
    _immediate(immgrad.flax.immediate(l2_loss), tx),
  )
  assert optax.tree.norm(optax.tree.sub(got, without)) > 1e-4


def test_l2_in_the_loss_folds_into_each_layer_linen():
  """Linen, as flax/examples/imagenet/train.py writes it: the kernels'
  squares (``x.ndim > 1``) times ``weight_decay * 0.5``.
  """
  from flax import linen as nn

  model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(3)])
  _, _, _, batches = _l2()
  params = model.init(jax.random.PRNGKey(0), batches[0][0])["params"]

  def l2_loss(params, batch):
    x, y = batch
    loss = jnp.mean((model.apply({"params": params}, x) - y) ** 2)
    weight_l2 = sum(
      jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1
    )
    return loss + WD * 0.5 * weight_l2

  _check_l2_folds(immgrad.flax.immediate(l2_loss), l2_loss, params, batches)


def test_l2_in_the_loss_folds_into_each_layer_equinox():
  eqx = pytest.importorskip("equinox")
  import immgrad.equinox

  model = eqx.nn.MLP(5, 3, 8, 1, activation=jnp.tanh, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  _, _, _, batches = _l2()

  def l2_loss(params, batch):
    x, y = batch
    out = jax.vmap(eqx.combine(params, static))(x)
    l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(params))
    return jnp.mean((out - y) ** 2) + WD * l2

  _check_l2_folds(immgrad.equinox.immediate(l2_loss), l2_loss, params, batches)


def _haiku_l2():
  """dm-haiku's ImageNet example's loss: an L2 term over the params tree."""
  hk = pytest.importorskip("haiku")
  _, _, _, batches = _l2()

  def forward(x):
    return hk.nets.MLP([8, 3], activation=jnp.tanh)(x)

  def l2_loss_of(model):
    def l2_loss(params, batch):
      x, y = batch
      loss = jnp.mean((model.apply(params, x) - y) ** 2)
      l2 = sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
      return loss + WD * 0.5 * l2

    return l2_loss

  plain = hk.without_apply_rng(hk.transform(forward))
  params = plain.init(jax.random.PRNGKey(0), batches[0][0])
  return forward, l2_loss_of, plain, params, batches


def test_l2_in_the_loss_folds_under_immediate_with_haiku():
  """``immgrad.immediate`` on the whole loss sees the term and folds it."""
  _, l2_loss_of, plain, params, batches = _haiku_l2()
  l2_loss = l2_loss_of(plain)
  _check_l2_folds(immgrad.immediate(l2_loss), l2_loss, params, batches)


def test_l2_outside_the_haiku_adapter_folds():
  """``immgrad.haiku.immediate`` wraps the forward function, inside
  ``hk.transform``: the loss adds the term outside it. The step sees the
  weights used by their layers and by the term, plans the whole loss as
  one program, and the term folds into the layers' steps.
  """
  hk = pytest.importorskip("haiku")
  import immgrad.haiku

  forward, l2_loss_of, plain, params, batches = _haiku_l2()
  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  _check_l2_folds(l2_loss_of(model), l2_loss_of(plain), params, batches)
  # updated: the sequential re-linearization of the same MLP, each layer's
  # dW with the term's gradient at its old weights, dX at its new ones.
  names = ("mlp/~/linear_0", "mlp/~/linear_1")
  chain = oracles.Chain(
    (oracles.dense,) * 2, names, (jnp.tanh, oracles.identity), oracles.mse
  )
  penalty = lambda p: WD * 0.5 * sum(jnp.sum(a**2) for a in jax.tree.leaves(p))
  loss_fn = l2_loss_of(model)
  for opt in OPTIMIZERS.values():
    want = oracles.sequential_steps(
      chain, opt(), params, batches, penalty=penalty
    )
    got = oracles.immediate_steps(
      lambda p, x, y: loss_fn(p, (x, y)), opt(), params, batches
    )
    oracles.assert_runs_close(got, want, atol=ATOL, rtol=RTOL)


def test_l2_moved_into_the_optimizer_trains_as_plain():
  """The fix the refusal gives: ``d(wd |w|^2)/dw = 2 wd w``, decayed in tx."""
  data_loss, l2_loss, params, batches = _l2()
  sgd = optax.sgd(0.1)
  want = _train(l2_loss, params, batches, sgd, _plain(l2_loss, sgd))
  tx = immgrad.shim(optax.chain(optax.add_decayed_weights(2 * WD), sgd))
  got = _train(
    data_loss,
    params,
    batches,
    tx,
    _immediate(immgrad.flax.immediate(data_loss), tx),
  )
  chex.assert_trees_all_close(got, want, atol=ATOL, rtol=RTOL)
  assert all(jax.tree.leaves(_stepped(data_loss, params, batches[0])))
