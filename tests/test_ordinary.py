"""Nothing silently ordinary: what the user is told when a parameter is not.

``immgrad.immediate`` warns (:class:`immgrad.OrdinaryWarning`, or raises
with ``strict=True``) for every parameter it was given and leaves with an
ordinary gradient, with the reason and its fix; ``value_and_grad`` refuses
a mode other than ``"current"`` when no immediate layer stepped anything;
a tied weight given to ``immediate_layer`` is named as tied, with a fix
that applies to decorated layers; and the source column of
``immgrad.layers`` is the user's line, not a model library's.

The numbers checked here are gradients of one step against plain
``jax.value_and_grad``, with ``mode="current"``, in which an ordinary
parameter's gradient is plain JAX's and an immediate one's the same
arithmetic: equal to float32 rounding (atol=1e-6, rtol=1e-5, as in
test_auto.py).
"""

import re
import warnings

import chex
import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp
import optax
import pytest

import immgrad

ATOL, RTOL = 1e-6, 1e-5
X = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
TOKENS = jnp.array([[1, 2, 3], [4, 5, 6]])


def _tied(params, tokens):
  """An embedding reused, transposed, for the logits."""
  h = params["embed"][tokens] * params["scale"]
  return jnp.mean((h @ params["embed"].T) ** 2)


def _tied_params():
  return {
    "embed": jnp.linspace(-1.0, 1.0, 40).reshape(10, 4),
    "scale": jnp.full(4, 1.5),
  }


def _step(fun, params, *args, mode="current", jit=False):
  tx = immgrad.shim(optax.sgd(0.1))
  step = immgrad.value_and_grad(fun, tx, mode=mode)
  return (jax.jit(step) if jit else step)(params, tx.init(params), *args)


def _warned(fun, params, *args, **options) -> list:
  """The OrdinaryWarnings of one step of ``fun``, each trace's."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _step(fun, params, *args, **options)
  return [w for w in caught if issubclass(w.category, immgrad.OrdinaryWarning)]


def _one_message(fun, params, *args) -> str:
  (warning,) = _warned(fun, params, *args)
  return str(warning.message)


def _grads(grads):
  """The gradient in each leaf, immediate or ordinary."""
  return jax.tree.map(
    lambda g: g.grad if isinstance(g, immgrad.ImmediateGrad) else g,
    grads,
    is_leaf=lambda g: isinstance(g, immgrad.ImmediateGrad),
  )


# -- the warning, per reason ---------------------------------------------------


def test_tied_embedding_warns_and_trains_as_plain():
  params = _tied_params()
  message = _one_message(immgrad.immediate(_tied), params, TOKENS)
  assert message.startswith(
    "immgrad.immediate: 1 of the 2 parameter leaves it was given train "
    "with an ordinary gradient"
  )
  assert re.search(
    r"\n  \['embed'\]: read by 2 layers: `gather` \(.*test_ordinary.py:\d+",
    message,
  )
  assert "['scale']" not in message  # Immediate: its layer is the mul.
  assert "untie it" in message and "by design" in message
  assert "strict=True" in message
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", immgrad.OrdinaryWarning)
    (loss, grads) = _step(immgrad.immediate(_tied), params, TOKENS)
  assert isinstance(grads["scale"], immgrad.ImmediateGrad)
  assert not isinstance(grads["embed"], immgrad.ImmediateGrad)
  expected_loss, expected = jax.value_and_grad(_tied)(params, TOKENS)
  chex.assert_trees_all_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(_grads(grads), expected, atol=ATOL, rtol=RTOL)


def test_parameter_returned_by_the_function_warns():
  def model(params, x):
    return jnp.mean((x @ params["w"]) ** 2), params["b"]

  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  net = immgrad.immediate(model)
  message = _one_message(lambda p, x: net(p, x)[0], params, X)
  assert "  ['b']: returned by the function" in message
  assert "['w']" not in message
  assert "read outside its layer" in message


def test_a_term_that_cannot_fold_warns_as_read_outside_its_layer():
  """An L2 term ``sum(w ** 2)`` folds into its layer's step (test_auto.py);
  ``sum(w1 * w2)`` joins two layers' weights before reducing them, so no
  part of it belongs to one layer: both stay ordinary, and say so.
  """

  def loss_fn(params, x):
    h = jnp.tanh(x @ params["w1"])
    penalty = jnp.sum(params["w1"][:2, :2] * params["w2"])
    return jnp.mean((h[:, :2] @ params["w2"]) ** 2) + 1e-2 * penalty

  params = {
    "w1": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
    "w2": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)[:2],
  }
  message = _one_message(immgrad.immediate(loss_fn), params, X)
  assert "2 of the 2 parameter leaves" in message
  assert "joins it with other parameters" in message
  assert "read outside its layer" in message
  assert "optax.adamw or optax.add_decayed_weights" in message
  assert "tied" not in message


def test_weights_reused_by_a_loop_warn():
  def loss_fn(p, xs):
    h = lax.scan(lambda h, x: (jnp.tanh(h @ p["rnn"] + x), None), X[0], xs)[0]
    return jnp.sum(h @ p["out"])

  params = {"rnn": jnp.eye(3) / 2, "out": jnp.ones((3, 2))}
  message = _one_message(immgrad.immediate(loss_fn), params, X)
  assert "  ['rnn']: reused by every iteration of `scan`" in message
  assert "reused by every iteration of a loop" in message
  assert "immgrad.scan" in message


def test_weights_computed_outside_a_checkpoint_warn():
  def loss_fn(p, x):
    w = p["w"] * 2.0
    return jnp.sum(jax.checkpoint(lambda x, w: x @ w + p["b"])(x, w))

  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  message = _one_message(immgrad.immediate(loss_fn), params, X)
  assert "  ['w']: its layer `dot_general`" in message
  assert "computed weights handed into a jax.checkpoint" in message
  assert "compute them from the parameters inside the checkpoint" in message
  assert "['b']" not in message


def test_a_layer_reading_an_ordinary_leaf_warns():
  def loss_fn(p, x):
    h = x @ (p["a"] + p["b"])  # One layer reads a and b ...
    return jnp.sum(h @ p["a"].T)  # ... and a is tied to this one.

  params = {"a": jnp.ones((3, 3)), "b": jnp.eye(3)}
  message = _one_message(immgrad.immediate(loss_fn), params, X)
  assert "2 of the 2 parameter leaves" in message
  assert "  ['a']: read by 2 layers" in message
  assert "  ['b']: its layer `dot_general`" in message
  assert "also reads ['a'], which is ordinary" in message
  assert "it becomes immediate when that leaf does" in message
  assert "untie it" in message  # Each kind present has its fix.


def test_the_first_five_leaves_are_named_and_the_rest_counted():
  def loss_fn(p, xs):
    def body(h, x):
      return jnp.tanh(sum(h * w for w in p.values()) + x), None

    return jnp.sum(lax.scan(body, X[0], xs)[0])

  params = {f"w{i}": jnp.full(3, 0.1 * i) for i in range(7)}
  message = _one_message(immgrad.immediate(loss_fn), params, X)
  assert "7 of the 7 parameter leaves" in message
  named = re.findall(r"^  \['(w\d)'\]", message, re.MULTILINE)
  assert named == ["w0", "w1", "w2", "w3", "w4"]
  assert "  ... and 2 more (immgrad.layers lists all)" in message


def test_strict_raises_the_same_message():
  params = _tied_params()
  message = _one_message(immgrad.immediate(_tied), params, TOKENS)
  with pytest.raises(ValueError) as raised:
    _step(immgrad.immediate(_tied, strict=True), params, TOKENS)
  assert str(raised.value) == message


def test_a_fully_immediate_model_and_an_unused_leaf_do_not_warn():
  def loss_fn(p, x):
    return jnp.sum(jax.nn.relu(x @ p["w"] + p["b"]) ** 2)

  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2), "unused": jnp.ones(5)}
  with warnings.catch_warnings():
    warnings.simplefilter("error", immgrad.OrdinaryWarning)
    _, grads = _step(immgrad.immediate(loss_fn, strict=True), params, X)
  assert isinstance(grads["w"], immgrad.ImmediateGrad)
  assert isinstance(grads["unused"], immgrad.Stepped)


def test_warns_once_per_trace_at_the_users_line():
  """A jitted step traces once: one warning for three calls. Python's
  default filter shows an identical message from one line once; another
  model's message is shown too.
  """
  params = _tied_params()
  tx = immgrad.shim(optax.sgd(0.1))
  step = jax.jit(immgrad.value_and_grad(immgrad.immediate(_tied), tx))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(3):
      step(params, tx.init(params), TOKENS)
  assert len(caught) == 1
  assert caught[0].filename == __file__

  def other(params, tokens):
    return jnp.mean(params["embed"][tokens] @ params["embed"].T)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("default")
    for _ in range(2):  # Not jitted: traced on each call.
      _step(immgrad.immediate(_tied), params, TOKENS)
    _step(immgrad.immediate(other), params, TOKENS)
  assert len(caught) == 2
  assert "1 of the 2" in str(caught[0].message)
  assert "1 of the 2" in str(caught[1].message)
  assert str(caught[0].message) != str(caught[1].message)


def test_an_adapter_warns_at_the_users_line():
  """hk.scan closes over the Linear's weights (an RNN-like loop)."""

  def forward(x):
    linear = hk.Linear(3)
    return hk.scan(lambda h, _: (linear(h), None), x, None, length=2)[0]

  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  params = model.init(jax.random.PRNGKey(0), X)
  loss_fn = lambda p, x: jnp.sum(model.apply(p, x) ** 2)
  (warning,) = _warned(loss_fn, params, X)
  assert warning.filename == __file__
  message = str(warning.message)
  assert "2 of the 2 parameter leaves" in message
  assert "['linear']['w']: reused by every iteration of `scan`" in message


def _adapter_loss(library, strict):
  """A model whose one weight is read twice (``x @ w @ w.T``: tied), built
  with ``library``'s own modules and wrapped by its adapter.
  """
  if library == "haiku":

    def forward(x):
      w = hk.get_parameter("w", (3, 3), init=hk.initializers.Identity())
      return x @ w @ w.T

    model = hk.without_apply_rng(
      hk.transform(immgrad.haiku.immediate(forward, strict=strict))
    )
    params = model.init(jax.random.PRNGKey(0), X)
    return lambda p, x: jnp.sum(model.apply(p, x) ** 2), params
  if library == "flax":
    nnx = pytest.importorskip("flax.nnx")

    class Tied(nnx.Module):
      def __init__(self):
        self.w = nnx.Param(jnp.eye(3))

      def __call__(self, x):
        return x @ self.w[...] @ self.w[...].T

    graphdef, params = nnx.split(Tied(), nnx.Param)
    fn = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)
    return immgrad.flax.immediate(fn, strict=strict), params
  eqx = pytest.importorskip("equinox")

  class Tied(eqx.Module):
    w: jax.Array

    def __call__(self, x):
      return x @ self.w @ self.w.T

  fn = lambda m, x: jnp.sum(m(x) ** 2)
  return immgrad.equinox.immediate(fn, strict=strict), Tied(jnp.eye(3))


@pytest.mark.parametrize("library", ["haiku", "flax", "equinox"])
def test_adapters_warn_and_strict_raises(library):
  """Each adapter hands ``strict`` to immgrad.immediate: the tied weight
  warns by default (its gradient plain JAX's) and is an error with
  ``strict=True``.
  """
  loss_fn, params = _adapter_loss(library, strict=False)
  (warning,) = _warned(loss_fn, params, X)
  assert "read by 2 layers" in str(warning.message)
  _, grads = _step(loss_fn, params, X)
  want = jax.grad(loss_fn)(params, X)
  chex.assert_trees_all_close(grads, want, atol=ATOL, rtol=RTOL)
  loss_fn, params = _adapter_loss(library, strict=True)
  with pytest.raises(ValueError, match="1 of the 1 parameter leaves"):
    _step(loss_fn, params, X)


# -- no immediate layer at all -------------------------------------------------


def _plain_loss(params, x):
  return jnp.mean((jnp.tanh(x @ params["w"]) - 1.0) ** 2)


@pytest.mark.parametrize("mode", ["updated", 0.5, -1.0])
def test_no_immediate_layer_is_an_error_but_in_current(mode):
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)}
  with pytest.raises(ValueError) as raised:
    _step(_plain_loss, params, X, mode=mode)
  message = str(raised.value)
  assert message.startswith(
    f"immgrad.value_and_grad: mode={mode!r} takes each immediate layer's dX"
  )
  assert "'_plain_loss'" in message
  for fix in ("immgrad.immediate(...)", "immediate_layer", 'mode="current"'):
    assert fix in message


@pytest.mark.parametrize("mode", ["current", 0.0])
def test_no_immediate_layer_in_current_is_plain_training(mode):
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)}
  loss, grads = _step(_plain_loss, params, X, mode=mode)
  expected_loss, expected = jax.value_and_grad(_plain_loss)(params, X)
  chex.assert_trees_all_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(grads, expected, atol=ATOL, rtol=RTOL)


# -- tied weights through immediate_layer --------------------------------------


@immgrad.immediate_layer
def _embed(tokens, table):
  return table[tokens]


@immgrad.immediate_layer
def _dense(x, w):
  return x @ w


def _no_adapter_advice(message):
  assert "modules=" not in message  # An adapter option: no help here.
  assert "undecorated" in message and "own parameter" in message


def test_tied_weight_in_two_immediate_layers_is_named_tied():
  def loss_fn(params, tokens):
    h = _embed(tokens, params["embed"])
    return jnp.mean(_embed(tokens, params["embed"]) * h)

  with pytest.raises(ValueError) as raised:
    _step(loss_fn, _tied_params(), TOKENS, mode="updated")
  message = str(raised.value)
  assert message.startswith(
    "parameter ['embed'] reaches two immediate layer calls ('_embed' and "
    "'_embed') in one step: it is tied"
  )
  _no_adapter_advice(message)


def test_tied_weight_also_used_undecorated_is_named_tied():
  def loss_fn(params, tokens):
    h = _embed(tokens, params["embed"])
    return jnp.mean(h @ params["embed"].T)

  with pytest.raises(ValueError) as raised:
    _step(loss_fn, _tied_params(), TOKENS, mode="updated")
  message = str(raised.value)
  assert message.startswith(
    "immgrad.value_and_grad: parameter ['embed'] is stepped by immediate "
    "layer '_embed' and also used outside it"
  )
  assert "tied" in message and "sum(w ** 2) folds" in message
  assert "optax.adamw" in message
  _no_adapter_advice(message)


def test_tied_weight_transposed_into_a_layer_is_named_tied():
  def loss_fn(params, tokens):
    h = _embed(tokens, params["embed"])
    return jnp.mean(_dense(h, params["embed"].T))

  with pytest.raises(ValueError) as raised:
    _step(loss_fn, _tied_params(), TOKENS, mode="updated")
  message = str(raised.value)
  assert message.startswith(
    "immediate layer '_dense' got params (float32[4,10]), not a parameter "
    "leaf of the step but a value computed from one (the shape of "
    "['embed'] transposed):"
  )
  assert "A tied weight (an embedding transposed for the logits)" in message
  _no_adapter_advice(message)


def test_cast_weight_into_a_layer_names_compute_dtype():
  def loss_fn(params, tokens):
    return jnp.mean(_embed(tokens, params["embed"].astype(jnp.bfloat16)))

  with pytest.raises(ValueError) as raised:
    _step(loss_fn, _tied_params(), TOKENS, mode="updated")
  message = str(raised.value)
  assert "(bfloat16[10,4])" in message and "the shape of" not in message
  assert "immediate_layer(compute_dtype=...)" in message


# -- immgrad.layers names the user's line ----------------------------------------


def _sources(table) -> set:
  return {row.source.split(":")[0] for row in table if row.layer}


def test_layers_names_the_users_line_under_haiku():
  model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([4, 2])(x)))
  params = model.init(jax.random.PRNGKey(0), X)
  table = immgrad.layers(model.apply, params, X)
  assert len([row for row in table if row.layer]) == 4
  assert _sources(table) == {__file__}


def test_layers_names_the_users_line_under_flax_nnx():
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Sequential(
    nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0))
  )
  graphdef, params = nnx.split(model, nnx.Param)
  table = immgrad.layers(
    lambda p, x: nnx.merge(graphdef, p)(x),
    params,
    X,  # This line.
  )
  assert len([row for row in table if row.layer]) == 4
  assert _sources(table) == {__file__}


def test_a_tied_flax_embedding_warns_with_a_place_for_each_use():
  """``nnx.Embed.attend`` (flax's wmt model ties its embedding so): tied,
  and each use has a place, a line or "source unknown", never blank.
  """
  nnx = pytest.importorskip("flax.nnx")

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(10, 4, rngs=rngs)
      self.dense = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, tokens):
      return self.embed.attend(self.dense(self.embed(tokens)))

  graphdef, params = nnx.split(LM(nnx.Rngs(0)), nnx.Param)
  loss_fn = lambda p, t: jnp.mean(nnx.merge(graphdef, p)(t) ** 2)
  (warning,) = _warned(immgrad.flax.immediate(loss_fn), params, TOKENS)
  message = str(warning.message)
  assert "1 of the 3 parameter leaves" in message
  assert "['embed']['embedding']" in message and "read by 2 layers" in message
  assert "()" not in message
