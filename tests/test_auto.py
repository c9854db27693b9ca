"""``immgrad.immediate``: raw JAX models made immediate with no adapter.

References are independent of immgrad: ``oracles.plain_steps`` (plain
``jax.value_and_grad`` + optax) for ``mode="current"`` and
``oracles.sequential_steps`` (the hand-written sequential
re-linearization) for ``mode="updated"``.

Tolerance, as in test_current.py and test_updated.py: atol=1e-6,
rtol=1e-5 over five steps. ``immediate`` replays the very primitives JAX
traced, so the forward pass is the same arithmetic; the optimizer runs
inside the backward rule, where XLA may fuse it differently (an FMA, a
division folded into a multiply): an ulp or two per step, grown by five
steps to a few dozen. The smallest difference these tests guard against,
dX from the new weights, moves these models by more than 1e-3 (checked
below for each updated-mode comparison), and a layer silently left
ordinary is caught by asserting which leaves were stepped immediately.
"""

import re

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
import oracles

ATOL, RTOL = 1e-6, 1e-5
STEPS = 5

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.05),
  "adam": lambda: optax.adam(1e-2),
}


def _normal(key, shape, scale=None):
  scale = 1 / np.sqrt(shape[0]) if scale is None else scale
  return scale * jax.random.normal(key, shape)


def _mse(out, y):
  return jnp.mean((out - y) ** 2)


# Raw JAX models: (model(params, x), params, x shape, y shape).


def _mlp():
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  return chain.apply, params, (8, 6), (8, 3)


def _attention():
  d, heads, k = 8, 2, 4
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {
    "ln": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
    "wq": _normal(keys[0], (d, heads, k)),
    "wk": _normal(keys[1], (d, heads, k)),
    "wv": _normal(keys[2], (d, heads, k)),
    "wo": _normal(keys[3], (heads, k, d), 1 / np.sqrt(heads * k)),
  }

  def model(p, x):
    mean = x.mean(-1, keepdims=True)
    normed = (x - mean) * lax.rsqrt(
      ((x - mean) ** 2).mean(-1, keepdims=True) + 1e-6
    )
    h = normed * p["ln"]["scale"] + p["ln"]["bias"]
    q = jnp.einsum("btd,dhk->bhtk", h, p["wq"])
    kk = jnp.einsum("btd,dhk->bhtk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bhtk", h, p["wv"])
    s = jnp.einsum("bhtk,bhsk->bhts", q, kk) / np.sqrt(k)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    a = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    o = jnp.einsum("bhts,bhsk->bthk", a, v)
    return x + jnp.einsum("bthk,hkd->btd", o, p["wo"])

  return model, params, (4, 5, d), (4, 5, d)


def _gated_mlp():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {
    "w1": _normal(keys[0], (6, 12)),
    "w2": _normal(keys[1], (6, 12)),
    "w3": _normal(keys[2], (12, 3)),
  }

  def model(p, x):
    return (jax.nn.silu(x @ p["w1"]) * (x @ p["w2"])) @ p["w3"]

  return model, params, (8, 6), (8, 3)


def _standardised(w):
  """Weight standardisation over all axes but the last (output) one."""
  axes = tuple(range(w.ndim - 1))
  mean = w.mean(axes, keepdims=True)
  return (w - mean) / jnp.sqrt(w.var(axes, keepdims=True) + 1e-5)


def _lowrank(x, p):
  return x @ (p["A"] @ p["B"])


def _scale(x, p):
  return x * p["g"]


def _ws_dense(x, p):
  return x @ _standardised(p["w"])


def _custom_chain():
  """A low-rank layer, a learnt scale, a weight-standardised dense layer."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {
    "lowrank": {"A": _normal(keys[0], (6, 3)), "B": _normal(keys[1], (3, 16))},
    "scale": {"g": jnp.linspace(0.5, 1.5, 16)},
    "ws": {"w": _normal(keys[2], (16, 3))},
  }
  chain = oracles.Chain(
    (_lowrank, _scale, _ws_dense),
    ("lowrank", "scale", "ws"),
    (jnp.tanh, oracles.identity, oracles.identity),
    _mse,
  )
  return chain, params


def _lowrank_model():
  chain, params = _custom_chain()
  return chain.apply, params, (8, 6), (8, 3)


def _ws_conv():
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  params = {
    "conv": {"w": _normal(keys[0], (3, 3, 2, 4), 0.3), "b": jnp.zeros(4)},
    "out": {"w": _normal(keys[1], (4, 3))},
  }

  def model(p, x):
    h = lax.conv_general_dilated(
      x,
      _standardised(p["conv"]["w"]),
      (1, 1),
      "SAME",
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    h = jax.nn.relu(h + p["conv"]["b"])
    return h.mean((1, 2)) @ p["out"]["w"]

  return model, params, (4, 6, 6, 2), (4, 3)


def _tied_lm():
  vocab, d = 11, 8
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  params = {
    "embed": _normal(keys[0], (vocab, d), 1.0),
    "mlp": {"w": _normal(keys[1], (d, d)), "b": jnp.zeros(d)},
  }

  def model(p, tokens):
    h = p["embed"][tokens]
    h = h + jax.nn.relu(h @ p["mlp"]["w"] + p["mlp"]["b"])
    return h @ p["embed"].T  # Tied: the embedding is the output layer too.

  return model, params, (4, 5), None


MODELS = {
  "mlp": (_mlp, None),
  "attention": (_attention, None),
  "gated_mlp": (_gated_mlp, None),
  "lowrank_scale_ws": (_lowrank_model, None),
  "ws_conv": (_ws_conv, None),
  # The tied embedding reaches two layers: it keeps an ordinary gradient.
  "tied_lm": (_tied_lm, {"['embed']"}),
}


def _loss_fn(model, lm):
  if lm:

    def loss_fn(params, tokens):
      logits = model(params, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]
      ).mean()
  else:

    def loss_fn(params, x, y):
      return _mse(model(params, x), y)

  return loss_fn


def _data(x_shape, y_shape, vocab=11):
  if y_shape is None:  # Token ids, one sequence longer than the logits.
    keys = jax.random.split(jax.random.PRNGKey(1), STEPS)
    return [
      (jax.random.randint(k, (x_shape[0], x_shape[1] + 1), 0, vocab),)
      for k in keys
    ]
  return oracles.batches(jax.random.PRNGKey(1), STEPS, x_shape, y_shape)


def _paths(tree):
  return [
    jax.tree_util.keystr(k)
    for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def _stepped_immediately(loss_fn, params, batch, mode="current"):
  """The paths of the leaves one step stepped in its backward pass."""
  tx = immgrad.shim(optax.sgd(0.1))
  _, grads = jax.jit(immgrad.value_and_grad(loss_fn, tx, mode=mode))(
    params, tx.init(params), *batch
  )
  is_leaf = lambda g: isinstance(g, (immgrad.ImmediateGrad, immgrad.Stepped))
  keyed = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_leaf)[0]
  return {
    jax.tree_util.keystr(k)
    for k, g in keyed
    if isinstance(g, immgrad.ImmediateGrad)
  }


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("name", list(MODELS))
def test_current_equals_plain_training(name, opt):
  make, ordinary = MODELS[name]
  model, params, x_shape, y_shape = make()
  loss_fn = _loss_fn(model, y_shape is None)
  data = _data(x_shape, y_shape)
  auto_loss = immgrad.immediate(loss_fn)
  expected_immediate = set(_paths(params)) - (ordinary or set())
  assert _stepped_immediately(auto_loss, params, data[0]) == (
    expected_immediate
  )
  expected = oracles.plain_steps(loss_fn, OPTIMIZERS[opt](), params, data)
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


WD = 1e-2


def _l2(p):
  """The L2 term of one dense layer: weights and bias, as the Haiku and
  Flax ImageNet examples write it over the whole params tree.
  """
  return WD * (jnp.sum(p["w"] ** 2) + jnp.sum(p["b"] ** 2))


def _l2_loss(chain):
  """``chain``'s loss plus the L2 term, summed before the model runs."""

  def loss_fn(params, x, y):
    l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(params))
    return chain.loss_fn()(params, x, y) + WD * l2

  return loss_fn


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_l2_term_folds_into_each_layers_step(opt):
  """Each leaf, read by its layer and by the L2 term, is stepped by its
  layer on both gradients: current is plain training, updated the
  sequential reference with the penalty's gradient in each layer's dW
  (at the old weights), dX at the new ones.
  """
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 6), (8, 3))
  loss_fn = _l2_loss(chain)
  auto_loss = immgrad.immediate(loss_fn)
  table = immgrad.layers(loss_fn, params, *data[0])
  assert all(row.layer is not None for row in table), table
  assert table["['layer0']['w']"].layer == "dot_general -> float32[8,16]"
  assert table["['layer0']['b']"].layer == "add -> float32[8,16]"
  assert _stepped_immediately(auto_loss, params, data[0]) == set(_paths(params))
  expected = oracles.plain_steps(loss_fn, OPTIMIZERS[opt](), params, data)
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  expected = oracles.sequential_steps(
    chain, OPTIMIZERS[opt](), params, data, penalty=_l2
  )
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="updated"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  # The penalty is felt: without it the same run ends elsewhere.
  unpenalised = oracles.sequential_steps(chain, OPTIMIZERS[opt](), params, data)
  assert oracles.max_abs_diff(got[0][-1], unpenalised[0][-1]) > 1e-4


def test_l2_term_under_a_checkpoint_and_scaled_by_an_argument_folds():
  """The model under jax.checkpoint, the L2 term outside it, summed after
  the model ran, with the weight decay passed in as an argument.
  """
  chain, params = oracles.mlp([6, 16, 3], jax.random.PRNGKey(0))
  data = [
    batch + (jnp.asarray(WD),)
    for batch in oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 6), (8, 3))
  ]

  def loss_fn(params, x, y, wd):
    out = jax.checkpoint(lambda x: chain.apply(params, x))(x)
    l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(params))
    return _mse(out, y) + wd * l2

  auto_loss = immgrad.immediate(loss_fn)
  assert _stepped_immediately(auto_loss, params, data[0]) == set(_paths(params))
  for opt in OPTIMIZERS.values():
    expected = oracles.plain_steps(loss_fn, opt(), params, data)
    got = oracles.immediate_steps(
      auto_loss, opt(), params, data, mode="current"
    )
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_l2_term_also_returned_as_aux_folds():
  """A loss that returns its L2 term for logging (``has_aux``)."""
  chain, params = oracles.mlp([6, 16, 3], jax.random.PRNGKey(0))
  (x, y), *_ = oracles.batches(jax.random.PRNGKey(1), 1, (8, 6), (8, 3))

  def loss_fn(params, x, y):
    l2 = sum(jnp.sum(w**2) for w in jax.tree.leaves(params))
    return chain.loss_fn()(params, x, y) + WD * l2, {"l2": l2}

  table = immgrad.layers(loss_fn, params, x, y)
  assert all(row.layer is not None for row in table), table
  opt = optax.adam(1e-2)
  tx = immgrad.shim(opt)
  (loss, aux), grads = immgrad.value_and_grad(
    immgrad.immediate(loss_fn), tx, mode="current", has_aux=True
  )(params, tx.init(params), x, y)
  updates, _ = tx.update(grads, tx.init(params), params)
  (want_loss, want_aux), plain = jax.value_and_grad(loss_fn, has_aux=True)(
    params, x, y
  )
  want, _ = opt.update(plain, opt.init(params), params)
  chex.assert_trees_all_close(
    (loss, aux, updates), (want_loss, want_aux, want), atol=ATOL, rtol=RTOL
  )
  is_immediate = lambda g: isinstance(g, immgrad.ImmediateGrad)
  assert all(
    jax.tree.leaves(jax.tree.map(is_immediate, grads, is_leaf=is_immediate))
  )


def test_terms_that_cannot_fold_stay_ordinary_and_say_why():
  """``sum(w1 * w2)`` joins two layers' weights before reducing them; an
  L2 term on a stacked parameter of a scan is not split among the loop's
  steps. Both keep ordinary gradients (plain training), with the reason;
  the other leaves stay immediate.
  """
  chain, params = oracles.mlp([4, 4, 4], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 4), (8, 4))

  def joined(params, x, y):
    mix = jnp.sum(params["layer0"]["w"] * params["layer1"]["w"])
    return chain.loss_fn()(params, x, y) + WD * mix

  table = immgrad.layers(joined, params, *data[0])
  for path in ("['layer0']['w']", "['layer1']['w']"):
    assert table[path].layer is None
    assert "before reducing it to a number" in table[path].why, table
  auto_loss = immgrad.immediate(joined)
  assert _stepped_immediately(auto_loss, params, data[0]) == {
    "['layer0']['b']",
    "['layer1']['b']",
  }
  expected = oracles.plain_steps(joined, optax.adam(1e-2), params, data)
  got = oracles.immediate_steps(
    auto_loss, optax.adam(1e-2), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)

  def feeds_its_layer(params, x, y):  # The term is part of w's input.
    h = x + WD * jnp.sum(params["w"] ** 2)
    return _mse(h @ params["w"], y)

  w = {"w": params["layer0"]["w"]}
  why = immgrad.layers(feeds_its_layer, w, *data[0])["['w']"].why
  assert "which its layer's own input depends on" in why, why
  got = oracles.immediate_steps(
    immgrad.immediate(feeds_its_layer),
    optax.adam(1e-2),
    w,
    data,
    mode="current",  # Its one leaf ordinary: "updated" is refused.
  )
  expected = oracles.plain_steps(feeds_its_layer, optax.adam(1e-2), w, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)

  stacked_loss, stacked, _ = _stacked_problem()

  def scanned(p, x, y):
    return stacked_loss(p, x, y) + WD * jnp.sum(p["stack"]["w"] ** 2)

  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (4, 8), (4, 2))
  table = immgrad.layers(scanned, stacked, *data[0])
  assert "not folded into a loop's steps" in table["['stack']['w']"].why
  # The scan steps its stacked leaves together or not at all.
  assert "also reads ['stack']['w']" in table["['stack']['b']"].why, table
  auto_loss = immgrad.immediate(scanned)
  assert _stepped_immediately(auto_loss, stacked, data[0]) == {"['out']['w']"}
  expected = oracles.plain_steps(scanned, optax.adam(1e-2), stacked, data)
  got = oracles.immediate_steps(
    auto_loss, optax.adam(1e-2), stacked, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(
  "make",
  [lambda: oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0)), _custom_chain],
  ids=["mlp", "lowrank_scale_ws"],
)
def test_updated_equals_sequential_relinearization(make, opt):
  chain, params = make()
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 6), (8, 3))
  loss_fn = immgrad.immediate(chain.loss_fn())
  expected = oracles.sequential_steps(chain, OPTIMIZERS[opt](), params, data)
  got = oracles.immediate_steps(
    loss_fn, OPTIMIZERS[opt](), params, data, mode="updated"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  current = oracles.immediate_steps(
    loss_fn, OPTIMIZERS[opt](), params, data, mode="current"
  )
  assert oracles.max_abs_diff(got[0][-1], current[0][-1]) > 1e-3


# Library models: immgrad.immediate on the program equals the adapters on
# the modules, where both make the same layers immediate. Measured equal
# bit for bit here (the same primitives in the same order); the tolerance
# is test_current.py's, for backends that fuse the two programs apart.
# Attention without biases: a key projection's bias has a rounding-noise
# gradient (softmax ignores it), which adam turns into steps of +-lr.
# No LayerNorm in "updated": Haiku and Flax fold the scale into the inverse
# standard deviation, so the program's layer is that product and dX through
# the centred input sees the old scale, where the adapters' layer, the
# whole module, sees the new one (docs/auto.md).

VOCAB, D = 11, 8


def _token_data():
  keys = jax.random.split(jax.random.PRNGKey(1), STEPS)
  return [(jax.random.randint(k, (4, 6), 0, VOCAB),) for k in keys]


def _lm_loss(apply):
  def loss_fn(params, tokens):
    logits = apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  return loss_fn


def _haiku_forward(norm):
  import haiku as hk

  def forward(tokens):
    h = hk.Embed(VOCAB, D)(tokens)
    h = h + hk.MultiHeadAttention(
      2, 4, w_init=hk.initializers.VarianceScaling(1.0), with_bias=False
    )(h, h, h)
    if norm:
      h = hk.LayerNorm(-1, True, True)(h)
    h = h + hk.nets.MLP([16, D])(h)
    return hk.Linear(VOCAB)(h)

  return forward


@pytest.mark.parametrize(
  "norm,mode", [(False, "current"), (False, "updated"), (True, "current")]
)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_haiku_model_equals_the_adapter(opt, norm, mode):
  import haiku as hk

  import immgrad.haiku

  forward = _haiku_forward(norm)
  model = hk.without_apply_rng(hk.transform(forward))
  adapted = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  data = _token_data()
  params = model.init(jax.random.PRNGKey(0), data[0][0][:, :-1])
  auto_loss = _lm_loss(immgrad.immediate(model.apply))
  assert _stepped_immediately(auto_loss, params, data[0]) == set(_paths(params))
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode=mode
  )
  expected = oracles.immediate_steps(
    _lm_loss(adapted.apply), OPTIMIZERS[opt](), params, data, mode=mode
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


# What immgrad.immediate refuses, reports, or leaves alone.

W = {"w": jnp.linspace(-1, 1, 9).reshape(3, 3), "b": jnp.zeros(3)}
X = jnp.linspace(-1, 1, 12).reshape(4, 3)


def _in_cond(p, x):
  h = lax.cond(x.sum() > 0, lambda h: h @ p["w"], lambda h: h, x)
  return jnp.sum(h + p["b"])


def _in_while(p, x):
  h = lax.while_loop(lambda h: h.sum() < 100, lambda h: h @ p["w"] + 1, x)
  return jnp.sum(h + p["b"])


def _line_of(fun, text):
  import inspect

  lines, first = inspect.getsourcelines(fun)
  return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("fun,prim", [(_in_cond, "cond"), (_in_while, "while")])
def test_parameters_in_branches_and_loops_are_refused(fun, prim):
  where = rf"test_auto.py:{_line_of(fun, 'lax.')}:\d+ \({fun.__name__}\)"
  message = rf"parameter \[.w.\] meets activations inside `{prim}` \(.*{where}"
  with pytest.raises(ValueError, match=message):
    immgrad.layers(fun, W, X)
  tx = immgrad.shim(optax.sgd(0.1))
  with pytest.raises(ValueError, match=message):
    immgrad.value_and_grad(immgrad.immediate(fun), tx)(W, tx.init(W), X)


def test_a_parameter_closed_over_is_refused():
  """A parameter ``fun`` reads from its closure is invisible in its params
  tree: it would keep an ordinary gradient unnoticed, so it is refused,
  named. Passed in the tree, the same model trains (both leaves immediate).
  """
  params = W

  def loss_fn(p, x):
    net = immgrad.immediate(lambda q, x: jnp.sum(x @ q["w"] + p["b"]))
    return net({"w": p["w"]}, x)

  tx = immgrad.shim(optax.sgd(0.1))
  message = r"loss_fn.<locals>.<lambda> closes over the parameter params\['b'\]"
  with pytest.raises(ValueError, match=message):
    immgrad.value_and_grad(loss_fn, tx)(params, tx.init(params), X)
  net = immgrad.immediate(lambda p, x: jnp.sum(x @ p["w"] + p["b"]))
  assert _stepped_immediately(net, params, (X,)) == {"['w']", "['b']"}


def _stacked_problem():
  """Three dense layers stacked under lax.scan, then an output layer."""
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {
    "stack": {
      "w": _normal(keys[0], (3, 8, 8), 1 / np.sqrt(8)),
      "b": 0.1 * jax.random.normal(keys[1], (3, 8)),
    },
    "out": {"w": _normal(keys[2], (8, 2))},
  }

  def loss_fn(p, x, y):
    h, _ = lax.scan(
      lambda h, layer: (jnp.tanh(oracles.dense(h, layer)), None), x, p["stack"]
    )
    return _mse(h @ p["out"]["w"], y)

  # The same model unrolled, for the hand-written re-linearization.
  chain = oracles.Chain(
    (oracles.dense,) * 3 + (lambda x, p: x @ p["w"],),
    ("l0", "l1", "l2", "out"),
    (jnp.tanh,) * 3 + (oracles.identity,),
    _mse,
  )
  return loss_fn, params, chain


def _unstacked(params):
  layers = {
    f"l{i}": jax.tree.map(lambda a, i=i: a[i], params["stack"])
    for i in range(3)
  }
  return {**layers, "out": params["out"]}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_scan_over_stacked_parameters(opt):
  """Each iteration's layer steps its own slice, as immgrad.scan does."""
  loss_fn, params, chain = _stacked_problem()
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (4, 8), (4, 2))
  auto_loss = immgrad.immediate(loss_fn)
  table = immgrad.layers(loss_fn, params, *data[0])
  assert (
    table["['stack']['w']"].layer == "dot_general -> float32[4,8] in `scan`"
  )
  assert _stepped_immediately(auto_loss, params, data[0]) == set(_paths(params))
  expected = oracles.plain_steps(loss_fn, OPTIMIZERS[opt](), params, data)
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  expected = oracles.sequential_steps(
    chain, OPTIMIZERS[opt](), _unstacked(params), data
  )
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="updated"
  )
  oracles.assert_runs_close(
    ([_unstacked(p) for p in got[0]], got[1]), expected, atol=ATOL, rtol=RTOL
  )


def test_haiku_layer_stack_equals_the_adapter():
  import haiku as hk

  import immgrad.haiku

  def forward(x):
    block = lambda h: jax.nn.relu(hk.Linear(8)(h))
    return hk.Linear(2)(hk.layer_stack(3)(block)(hk.Linear(8)(x)))

  model = hk.without_apply_rng(hk.transform(forward))
  adapted = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (4, 5), (4, 2))
  params = model.init(jax.random.PRNGKey(0), data[0][0])
  loss = lambda apply: lambda p, x, y: _mse(apply(p, x), y)
  for mode in ("current", "updated"):
    got = oracles.immediate_steps(
      loss(immgrad.immediate(model.apply)),
      OPTIMIZERS["adam"](),
      params,
      data,
      mode=mode,
    )
    expected = oracles.immediate_steps(
      loss(adapted.apply), OPTIMIZERS["adam"](), params, data, mode=mode
    )
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_haiku_mlp_updated_equals_the_adapter_and_the_reference(opt):
  """An unmodified ``hk.nets.MLP`` (no norm layer, so both draw the same
  layer boundaries): ``immediate`` on its ``apply``, the Haiku adapter and
  the sequential re-linearization give the same five "updated" steps.
  """
  import haiku as hk

  import immgrad.haiku

  forward = lambda x: hk.nets.MLP([16, 16, 3])(x)
  model = hk.without_apply_rng(hk.transform(forward))
  adapted = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 6), (8, 3))
  params = model.init(jax.random.PRNGKey(0), data[0][0])
  loss = lambda apply: lambda p, x, y: _mse(apply(p, x), y)
  auto_loss = loss(immgrad.immediate(model.apply))
  assert _stepped_immediately(auto_loss, params, data[0], "updated") == set(
    _paths(params)
  )
  chain = oracles.Chain(
    (oracles.dense,) * 3,
    tuple(f"mlp/~/linear_{i}" for i in range(3)),
    (jax.nn.relu, jax.nn.relu, oracles.identity),
    oracles.mse,
  )
  expected = oracles.sequential_steps(chain, OPTIMIZERS[opt](), params, data)
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="updated"
  )
  adapter = oracles.immediate_steps(
    loss(adapted.apply), OPTIMIZERS[opt](), params, data, mode="updated"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  oracles.assert_runs_close(adapter, expected, atol=ATOL, rtol=RTOL)
  oracles.assert_runs_close(got, adapter, atol=ATOL, rtol=RTOL)
  current = oracles.immediate_steps(
    auto_loss, OPTIMIZERS[opt](), params, data, mode="current"
  )
  assert oracles.max_abs_diff(got[0][-1], current[0][-1]) > 1e-3


def test_parameters_in_a_scan_carry_are_not_supported_yet():
  def loss_fn(p, xs):
    w, _ = lax.scan(lambda w, x: (w * x.sum(), None), p["w"], xs)
    return jnp.sum(w)

  with pytest.raises(
    ValueError,
    match=r"parameter \['w'\] meets "
    r"activations inside `scan`.*does not support yet",
  ):
    immgrad.layers(loss_fn, W, X)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_checkpointed_layers(opt):
  """jax.checkpoint per layer, and around the whole model (by closure)."""
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (8, 6), (8, 3))
  per_layer = chain._replace(
    layers=tuple(jax.checkpoint(f) for f in chain.layers)
  ).loss_fn()

  def whole(params, x, y):
    return _mse(jax.checkpoint(lambda x: chain.apply(params, x))(x), y)

  for loss_fn in (per_layer, whole):
    auto_loss = immgrad.immediate(loss_fn)
    assert _stepped_immediately(auto_loss, params, data[0]) == set(
      _paths(params)
    )
    expected = oracles.plain_steps(loss_fn, OPTIMIZERS[opt](), params, data)
    got = oracles.immediate_steps(
      auto_loss, OPTIMIZERS[opt](), params, data, mode="current"
    )
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
    expected = oracles.sequential_steps(chain, OPTIMIZERS[opt](), params, data)
    got = oracles.immediate_steps(
      auto_loss, OPTIMIZERS[opt](), params, data, mode="updated"
    )
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_weights_computed_outside_a_checkpoint_are_ordinary():
  """Any computation of the weights outside the checkpoint will do. Not a
  bfloat16 round trip: optax's adam compiled into two programs can round
  its update differently (on this model, on the CPU, eager and jit plain
  optax differ by an ulp of the update, and so do plain and immgrad), and
  float32 weights one ulp apart can round to bfloat16 values 2**-8 apart:
  on a TPU v5e the next step then differed by 6.5e-6, past this test's
  tolerances (scaling by 0.5 or tanh: 0 on the chip). ``0.5 * w`` is exact
  in any program.
  """

  def loss_fn(p, x, y):
    w = 0.5 * p["w"]
    return _mse(jax.checkpoint(lambda x, w: x @ w + p["b"])(x, w), y)

  table = immgrad.layers(loss_fn, W, X, X)
  assert table["['b']"].layer == "add -> float32[4,3]"
  assert re.fullmatch(
    r"its layer `dot_general` \(.*\) is inside "
    r"`(remat2|checkpoint)` \(.*test_auto.py:\d+:\d+ "
    r"\(.*loss_fn\)\), which gets its weights computed, "
    r"not the parameters themselves",
    table["['w']"].why,
  )
  data = [(X + i, X) for i in range(STEPS)]
  auto_loss = immgrad.immediate(loss_fn)
  assert _stepped_immediately(auto_loss, W, data[0]) == {"['b']"}
  expected = oracles.plain_steps(loss_fn, optax.adam(1e-2), W, data)
  got = oracles.immediate_steps(
    auto_loss, optax.adam(1e-2), W, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_weights_a_scan_reuses_every_step_are_ordinary():
  """An RNN cell's weights, closed over by lax.scan: an ordinary gradient."""

  def loss_fn(p, xs, y):
    h = lax.scan(
      lambda h, x: (jnp.tanh(h @ p["rnn"] + x), None), jnp.zeros(3), xs
    )[0]
    return _mse(h @ p["out"], y)

  params = {"rnn": W["w"] / 2, "out": W["w"]}
  table = immgrad.layers(loss_fn, params, X, jnp.ones(3))
  assert table["['rnn']"].why.startswith("reused by every iteration of `scan`")
  assert table["['out']"].layer == "dot_general -> float32[3]"
  data = [(X + i, jnp.ones(3)) for i in range(STEPS)]
  auto_loss = immgrad.immediate(loss_fn)
  assert _stepped_immediately(auto_loss, params, data[0]) == {"['out']"}
  expected = oracles.plain_steps(loss_fn, optax.adam(1e-2), params, data)
  got = oracles.immediate_steps(
    auto_loss, optax.adam(1e-2), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_layers_table():
  def model(p, tokens):
    h = p["embed"][tokens]
    h = h * (p["norm"]["scale"] + 1)  # Parameter-only preprocessing.
    h = jax.jit(lambda h, w: h @ (w["A"] @ w["B"]))(h, p["lowrank"])
    return h @ p["embed"].T + p["bias"], jnp.sum(p["bias"] ** 2)

  params = {
    "embed": jnp.ones((10, 4)),
    "norm": {"scale": jnp.zeros(4)},
    "lowrank": {"A": jnp.ones((4, 2)), "B": jnp.ones((2, 4))},
    "bias": jnp.zeros(10),
    "step": jnp.zeros((), jnp.int32),
  }
  table = immgrad.layers(model, params, jnp.zeros((2, 3), jnp.int32))
  line = _line_of(model, "scale")
  at = lambda line: rf"{re.escape(__file__)}:{line}:\d+ \({name}\)"
  name = re.escape("test_layers_table.<locals>.model")
  row = table["['norm']['scale']"]
  assert (row.path, row.shape, row.layer, row.why) == (
    "['norm']['scale']",
    "float32[4]",
    "mul -> float32[2,3,4]",
    None,
  )
  assert re.fullmatch(at(line), row.source)
  for path in ("['lowrank']['A']", "['lowrank']['B']"):
    assert table[path].layer == "dot_general -> float32[2,3,4]"
    assert f"test_auto.py:{line + 1}:" in table[path].source
  assert re.fullmatch(
    rf"read by 2 layers: `gather` \({at(line - 1)}\), "
    rf"`dot_general` \({at(line + 2)}\)",
    table["['embed']"].why,
  )
  assert table["['bias']"].why.startswith("returned by the function")
  assert table["['step']"].why == "not floating point: no gradient"
  assert [r.path for r in table] == _paths(params)
  printed = str(table).splitlines()
  assert printed[0].split() == [
    "parameter",
    "shape",
    "layer",
    "source",
    "/",
    "why",
    "ordinary",
  ]
  assert printed[5].split()[:3] == ["['norm']['scale']", "float32[4]", "mul"]
  assert (
    immgrad.layers(
      immgrad.immediate(lambda x, p: model(p, x), argnums=1),
      params,
      jnp.zeros((2, 3), jnp.int32),
    )
    == table
  )


def test_outside_a_step_it_is_fun():
  fun = lambda p, x: jnp.sum(jnp.sin(x @ p["w"] + p["b"]))
  wrapped = immgrad.immediate(fun)
  assert wrapped(W, X) == fun(W, X)
  np.testing.assert_array_equal(
    jax.jit(jax.grad(wrapped))(W, X)["w"], jax.jit(jax.grad(fun))(W, X)["w"]
  )


def test_a_computed_tree_is_not_parameters():
  fun = immgrad.immediate(lambda p, x: jnp.sum(x @ p["w"] + p["b"]))
  tx = immgrad.shim(optax.sgd(0.1))
  loss_fn = lambda p, x: fun({"w": 2 * p["w"], "b": p["b"]}, x)
  with pytest.raises(
    ValueError,
    match=r"params\['w'\] \(argument 0\) is not "
    r"a parameter leaf",
  ):
    immgrad.value_and_grad(loss_fn, tx)(W, tx.init(W), X)


def test_linen_scan_over_layers_current_equals_plain():
  nn = pytest.importorskip("flax.linen")

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(8)(h)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      h, _ = nn.scan(
        Block,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=3,
      )()(nn.Dense(8)(x), None)
      return nn.Dense(2)(h)

  model = Model()
  data = oracles.batches(jax.random.PRNGKey(1), STEPS, (4, 5), (4, 2))
  params = model.init(jax.random.PRNGKey(0), data[0][0])["params"]
  loss_fn = lambda p, x, y: _mse(model.apply({"params": p}, x), y)
  auto_loss = immgrad.immediate(loss_fn)
  assert _stepped_immediately(auto_loss, params, data[0]) == set(_paths(params))
  expected = oracles.plain_steps(loss_fn, OPTIMIZERS["adam"](), params, data)
  got = oracles.immediate_steps(
    auto_loss, OPTIMIZERS["adam"](), params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
