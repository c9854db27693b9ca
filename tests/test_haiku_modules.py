"""immgrad.haiku's modules: Haiku's parameters, and trained like the refs.

Each case is a small chain of three modules with the module under test in
the middle. The references are built from plain ``hk`` modules only:

* ``mode="current"`` against ``jax.value_and_grad`` + optax on the same
  model made of ``hk`` modules (oracles.plain_steps);
* ``mode="updated"`` against the sequential re-linearization
  (oracles.sequential_steps) whose layers are the ``hk`` modules, each
  transformed on its own.

Both paths of the issue are run: the ``immgrad.haiku`` classes, and the
``hk`` classes inside ``immgrad.haiku.immediate``. Tolerance as in
test_current.py: atol=1e-6, rtol=1e-5 over 5 adam steps, a few dozen
float32 ulps from XLA fusing the two programs differently; a missed or
doubled update, or dX from the wrong weights, is off by more than 1e-3.
"""

import functools

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


def _flat(module):
  return lambda x: module(x.reshape(x.shape[0], -1))


def _normal(shape):
  return lambda key: jax.random.normal(key, shape)


def _ids(shape, vocab):
  return lambda key: jax.random.randint(key, shape, 0, vocab)


# name -> (make x, [(module name, make module from a namespace, act)]).
# The namespace is ``hk`` or ``immgrad.haiku``: same constructor arguments.
CASES = {
  "linear": (
    _normal((8, 5)),
    [
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("m", lambda m: m.Linear(4, name="m"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
  "linear_no_bias": (
    _normal((8, 5)),
    [
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("m", lambda m: m.Linear(4, with_bias=False, name="m"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
  "conv1d": (
    _normal((4, 9, 2)),
    [
      ("a", lambda m: m.Conv1D(3, 3, name="a"), jnp.tanh),
      (
        "m",
        lambda m: m.Conv1D(4, 2, stride=2, padding="VALID", name="m"),
        jnp.tanh,
      ),
      ("z", lambda m: _flat(m.Linear(3, name="z")), oracles.identity),
    ],
  ),
  "conv2d": (
    _normal((4, 6, 6, 2)),
    [
      ("a", lambda m: m.Conv2D(3, (2, 3), name="a"), jnp.tanh),
      (
        "m",
        lambda m: m.Conv2D(4, 3, rate=2, feature_group_count=1, name="m"),
        jnp.tanh,
      ),
      ("z", lambda m: _flat(m.Linear(3, name="z")), oracles.identity),
    ],
  ),
  "conv2d_channels_first_grouped": (
    _normal((4, 4, 5, 5)),
    [
      ("a", lambda m: m.Conv2D(4, 3, data_format="NCHW", name="a"), jnp.tanh),
      (
        "m",
        lambda m: m.Conv2D(
          4, 3, data_format="NCHW", feature_group_count=2, name="m"
        ),
        jnp.tanh,
      ),
      ("z", lambda m: _flat(m.Linear(3, name="z")), oracles.identity),
    ],
  ),
  "conv3d": (
    _normal((2, 4, 4, 4, 2)),
    [
      ("a", lambda m: m.Conv3D(3, 2, name="a"), jnp.tanh),
      ("m", lambda m: m.Conv3D(2, 2, name="m"), jnp.tanh),
      ("z", lambda m: _flat(m.Linear(3, name="z")), oracles.identity),
    ],
  ),
  "layer_norm": (
    _normal((8, 5)),
    [
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("m", lambda m: m.LayerNorm(-1, True, True, name="m"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
  "layer_norm_scale_only": (
    _normal((8, 5)),
    [
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("m", lambda m: m.LayerNorm(-1, True, False, name="m"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
  "rms_norm": (
    _normal((8, 5)),
    [
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("m", lambda m: m.RMSNorm(-1, name="m"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
  "embed": (
    _ids((8, 6), 11),
    [
      ("m", lambda m: m.Embed(11, 5, name="m"), jnp.tanh),
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
  "embed_one_hot": (
    _ids((8, 6), 11),
    [
      (
        "m",
        lambda m: m.Embed(11, 5, lookup_style="ONE_HOT", name="m"),
        jnp.tanh,
      ),
      ("a", lambda m: m.Linear(6, name="a"), jnp.tanh),
      ("z", lambda m: m.Linear(3, name="z"), oracles.identity),
    ],
  ),
}


def _transformed(make):
  return hk.without_apply_rng(hk.transform(lambda x: make(hk)(x)))


def _setup(case):
  """The reference chain (plain hk modules), its params, and data."""
  make_x, layers = CASES[case]
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  x = make_x(keys[0])
  params, funs = {}, []
  for (name, make, act), key in zip(layers, keys[1:]):
    t = _transformed(make)
    params[name] = t.init(key, x)
    funs.append(lambda h, p, t=t: t.apply(p, h))
    x = act(t.apply(params[name], x))
  chain = oracles.Chain(
    tuple(funs),
    tuple(n for n, _, _ in layers),
    tuple(a for _, _, a in layers),
    oracles.mse,
  )
  data = []
  for key in jax.random.split(keys[-1], 5):
    kx, ky = jax.random.split(key)
    data.append((make_x(kx), jax.random.normal(ky, x.shape)))
  return chain, params, data


def _model(case, namespace, wrap=lambda f: f):
  _, layers = CASES[case]

  def forward(x):
    for _, make, act in layers:
      x = act(make(namespace)(x))
    return x

  return hk.without_apply_rng(hk.transform(wrap(forward)))


def _merged(params):
  return {k: v for sub in params.values() for k, v in sub.items()}


def _split(merged, like):
  return {name: {k: merged[k] for k in sub} for name, sub in like.items()}


PATHS = {
  "modules": lambda case: _model(case, immgrad.haiku),
  "immediate": lambda case: _model(case, hk, immgrad.haiku.immediate),
}


def _loss(model):
  def loss_fn(params, x, y):
    return oracles.mse(model.apply(params, x), y)

  return loss_fn


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_current_equals_plain_haiku(case, path):
  _, params, data = _setup(case)
  opt = optax.adam(1e-2)
  expected = oracles.plain_steps(
    _loss(_model(case, hk)), opt, _merged(params), data
  )
  got = oracles.immediate_steps(
    _loss(PATHS[path](case)), opt, _merged(params), data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_updated_equals_sequential_reference(case, path):
  chain, params, data = _setup(case)
  opt = optax.adam(1e-2)
  expected_params, expected_losses = oracles.sequential_steps(
    chain, opt, params, data
  )
  expected = ([_merged(p) for p in expected_params], expected_losses)
  got = oracles.immediate_steps(
    _loss(PATHS[path](case)), opt, _merged(params), data, mode="updated"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_updated_differs_from_current():
  """The middle module's dX really comes from its new weights."""
  _, params, data = _setup("layer_norm")
  model = PATHS["modules"]("layer_norm")
  runs = [
    oracles.immediate_steps(
      _loss(model), optax.adam(1e-2), _merged(params), data, mode=mode
    )[0][-1]
    for mode in ("current", "updated")
  ]
  assert oracles.max_abs_diff(runs[0]["a"], runs[1]["a"]) > 1e-3


# Each immgrad.haiku class against its hk class, same arguments and input.
SAME_AS_HAIKU = {
  "Linear": (lambda m: m.Linear(4), (2, 3)),
  "Linear_w_init": (
    lambda m: m.Linear(
      4,
      w_init=hk.initializers.Orthogonal(),
      b_init=hk.initializers.RandomNormal(),
    ),
    (2, 3),
  ),
  "Conv1D": (lambda m: m.Conv1D(4, 3), (2, 7, 3)),
  "Conv2D": (lambda m: m.Conv2D(4, (3, 2), stride=2), (2, 6, 6, 3)),
  "Conv2D_unbatched": (lambda m: m.Conv2D(4, 3), (6, 6, 3)),
  "Conv3D": (lambda m: m.Conv3D(4, 2, with_bias=False), (2, 4, 4, 4, 3)),
  "ConvND": (lambda m: m.ConvND(2, 4, 3, data_format="NCHW"), (2, 3, 5, 5)),
  "LayerNorm": (lambda m: m.LayerNorm(-1, True, True), (2, 6)),
  "LayerNorm_param_axis": (
    lambda m: m.LayerNorm((1, 2), True, True, param_axis=(1, 2)),
    (2, 3, 4),
  ),
  "RMSNorm": (lambda m: m.RMSNorm(-1), (2, 6)),
  "Embed": (lambda m: m.Embed(10, 4), None),
  "Embed_matrix": (
    lambda m: m.Embed(embedding_matrix=np.arange(12.0).reshape(4, 3)),
    None,
  ),
}


@pytest.mark.parametrize("name", list(SAME_AS_HAIKU))
def test_parameters_and_outputs_equal_haiku(name):
  make, shape = SAME_AS_HAIKU[name]
  key = jax.random.PRNGKey(3)
  x = (
    jnp.array([[0, 3, 2], [1, 1, 3]])
    if shape is None
    else jax.random.normal(key, shape)
  )
  ours = _transformed(lambda m: make(immgrad.haiku))
  theirs = _transformed(lambda m: make(hk))
  params = ours.init(key, x)
  expected = theirs.init(key, x)
  chex.assert_trees_all_equal(params, expected)  # Names, values.
  chex.assert_trees_all_equal_shapes_and_dtypes(params, expected)
  chex.assert_trees_all_equal(ours.apply(params, x), theirs.apply(params, x))


def test_call_time_layer_norm_scale_keeps_its_gradient():
  """A scale passed at call time is an input: its gradient must survive."""

  def forward(x, s):
    return hk.LayerNorm(-1, False, False)(x, scale=s)

  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))

  def loss_fn(params, x):
    s = params["s"]
    return jnp.sum(model.apply({}, x, s) ** 2 * jnp.arange(4.0))

  x = jax.random.normal(jax.random.PRNGKey(0), (3, 4))
  params = {"s": jnp.full((4,), 1.5)}
  tx = immgrad.shim(optax.sgd(1.0))
  # The model has no parameter, so no immediate layer: "updated" is refused.
  _, grads = immgrad.value_and_grad(loss_fn, tx, mode="current")(
    params, tx.init(params), x
  )
  chex.assert_trees_all_close(
    grads["s"], jax.grad(loss_fn)(params, x)["s"], atol=ATOL, rtol=RTOL
  )


def test_modules_not_chosen_keep_ordinary_gradients():
  case = "layer_norm"
  _, params, data = _setup(case)
  model = _model(
    case, hk, functools.partial(immgrad.haiku.immediate, modules=(hk.Linear,))
  )
  tx = immgrad.shim(optax.adam(1e-2))
  merged = _merged(params)
  _, grads = immgrad.value_and_grad(_loss(model), tx)(
    merged, tx.init(merged), *data[0]
  )
  assert isinstance(grads["a"]["w"], immgrad.ImmediateGrad)
  assert not isinstance(grads["m"]["scale"], immgrad.ImmediateGrad)
  expected = oracles.plain_steps(
    _loss(_model(case, hk)), optax.adam(1e-2), merged, data
  )
  got = oracles.immediate_steps(
    _loss(model), optax.adam(1e-2), merged, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("modules", [(object,), ("Linear",), hk.Linear])
def test_unsupported_module_choice_is_an_error(modules):
  """A TypeError naming modules= and the fix, as in the Flax and Equinox
  adapters; a bare class too (one meaning: a tuple of classes).
  """
  with pytest.raises(
    TypeError,
    match=r"modules= takes a tuple of hk.Module classes.*"
    r"immgrad.haiku.DEFAULT_MODULES \+ \(MyModule,\)",
  ):
    immgrad.haiku.immediate(lambda x: x, modules=modules)


def test_batch_norm_chosen_trains_as_plain_with_its_statistics():
  """Any hk.Module may be chosen now: hk.BatchNorm's call is one unit."""

  def forward(x):
    x = jnp.tanh(hk.Linear(6, name="a")(x))
    x = hk.BatchNorm(True, True, 0.9, name="m")(x, is_training=True)
    return hk.Linear(3, name="z")(jnp.tanh(x))

  plain = hk.without_apply_rng(hk.transform_with_state(forward))
  ours = hk.without_apply_rng(
    hk.transform_with_state(
      immgrad.haiku.immediate(forward, modules=(hk.Linear, hk.BatchNorm))
    )
  )
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 5))
  y = jax.random.normal(jax.random.PRNGKey(2), (8, 3))
  params, state = plain.init(jax.random.PRNGKey(0), x)

  def loss(model):
    def loss_fn(params, state, x, y):
      out, state = model.apply(params, state, x)
      return oracles.mse(out, y), state

    return loss_fn

  tx = immgrad.shim(optax.sgd(1e-2))
  (got, got_state), grads = immgrad.value_and_grad(
    loss(ours), tx, has_aux=True, mode="current"
  )(params, tx.init(params), state, x, y)
  assert isinstance(grads["m"]["scale"], immgrad.ImmediateGrad)
  (expected, expected_state), plain_grads = jax.value_and_grad(
    loss(plain), has_aux=True
  )(params, state, x, y)
  chex.assert_trees_all_close(got, expected, atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(got_state, expected_state, atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(
    grads["m"]["scale"].grad, plain_grads["m"]["scale"], atol=ATOL, rtol=RTOL
  )
