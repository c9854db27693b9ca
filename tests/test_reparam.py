"""Modules whose weights are reparametrised, in all three adapters.

Every way a model can change how a claimed module gets its weights
(subclasses overriding its methods, weight and spectral norm wrappers,
``nn.map_variables``, Haiku custom getters and mixed precision, properties,
method interceptors) either trains exactly as plain training does, or is
refused with a ``ValueError`` naming the module's class; each test asserts
which. Issue 24: BiT's ``StdConv`` trained on its raw kernel, silently.

Reference, never immgrad: the same loss under ``jax.value_and_grad`` +
optax. Tolerance over 3 adam steps: ``atol=1e-6, rtol=1e-5`` as in
tests/test_current.py (XLA fuses the optimizer's arithmetic differently
inside the backward pass: an ulp or two a step). The loss inside the step
is also compared with the model's own loss at the same params, outside a
step, jitted, with the same tolerance (one forward pass, jitted
differently; jitted since a bfloat16 model, hk.mixed_precision's, rounds
eagerly otherwise than under jit: 1e-3 apart after one step).
"""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import optax
import pytest

import immgrad
import immgrad.haiku

try:
  import equinox as eqx

  import immgrad.equinox
except ImportError:  # equinox 0.13.8 refuses jax 0.7.0 and 0.7.1.
  eqx = None
try:
  from flax import linen as nn
  from flax import nnx

  import immgrad.flax
except ImportError:  # flax 0.12.8 needs jax >= 0.10.
  nn = nnx = None

needs_flax = pytest.mark.skipif(nn is None, reason="needs flax")
needs_equinox = pytest.mark.skipif(eqx is None, reason="needs equinox")
# Flax 0.12 warns on some of its own calls (e.g. Variable.value); not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ATOL, RTOL = 1e-6, 1e-5
STEPS = 3


def _standardise(w, axes):
  """Weight standardisation, as BiT's StdConv does it."""
  w = w - jnp.mean(w, axis=axes, keepdims=True)
  return w / (jnp.std(w, axis=axes, keepdims=True) + 1e-5)


def _batches(shape):
  keys = jax.random.split(jax.random.PRNGKey(1), STEPS)
  return [jax.random.normal(k, shape) for k in keys]


def _stepped(grads) -> int:
  is_immediate = lambda g: isinstance(g, immgrad.ImmediateGrad)
  return sum(map(is_immediate, jax.tree.leaves(grads, is_leaf=is_immediate)))


def assert_trains_as_plain(loss_fn, params, batches, stepped):
  """``mode="current"`` is plain training; ``stepped`` leaves immediate.

  ``loss_fn(params, x)`` is already wrapped by its adapter's ``immediate``
  (outside a step, the model itself).
  """
  opt = optax.adam(1e-2)
  tx = immgrad.shim(opt, atomic=False)

  @jax.jit
  def plain(params, state, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  @jax.jit
  def ours(params, state, x):
    loss, grads = immgrad.value_and_grad(loss_fn, tx, mode="current")(
      params, state, x
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss, grads

  p, s, q, t = params, opt.init(params), params, tx.init(params)
  for x in batches:
    own_loss = jax.jit(loss_fn)(q, x)  # The model's own, outside a step.
    p, s, plain_loss = plain(p, s, x)
    q, t, loss, grads = ours(q, t, x)
    chex.assert_trees_all_close(loss, own_loss, atol=ATOL, rtol=RTOL)
    chex.assert_trees_all_close(loss, plain_loss, atol=ATOL, rtol=RTOL)
  chex.assert_trees_all_close(q, p, atol=ATOL, rtol=RTOL)
  assert _stepped(grads) == stepped


def assert_refused(loss_fn, params, x, match):
  tx = immgrad.shim(optax.sgd(0.1))
  with pytest.raises(ValueError, match=match):
    immgrad.value_and_grad(loss_fn, tx)(params, tx.init(params), x)


# -- Flax Linen ----------------------------------------------------------------


def _linen_loss(model, x, modules=None):
  variables = model.init(jax.random.PRNGKey(0), x)
  others = {k: v for k, v in variables.items() if k != "params"}

  def loss_fn(params, x):
    return jnp.mean(model.apply({"params": params, **others}, x) ** 2)

  chosen = {} if modules is None else {"modules": modules}
  return immgrad.flax.immediate(loss_fn, **chosen), variables["params"]


def _linen_net(layer):
  """A conv net whose first layer is ``layer()``, then ``nn.Dense``."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = layer()(x)
      return nn.Dense(3)(jax.nn.relu(h).reshape(x.shape[0], -1))

  return Net()


@needs_flax
@pytest.mark.parametrize("dense_only,stepped", [(False, 4), (True, 2)])
def test_linen_std_conv_overriding_param_trains_as_plain(dense_only, stepped):
  """BiT's StdConv: an nn.Conv standardising its kernel in ``param()``.

  Refused while immgrad re-implemented nn.Conv (it would have read the raw
  kernel): now nn.Conv's own code runs and the standardisation is
  preprocessing of the immediate convolution. Left out of ``modules=``,
  nn.Conv trains ordinarily, as before.
  """

  class StdConv(nn.Conv):
    def param(self, name, *args, **kwargs):
      param = super().param(name, *args, **kwargs)
      if name == "kernel":
        param = _standardise(param, (0, 1, 2))
      return param

  x = _batches((2, 6, 6, 3))
  net = _linen_net(lambda: StdConv(4, (3, 3)))
  modules = (nn.Dense,) if dense_only else None
  loss_fn, params = _linen_loss(net, x[0], modules=modules)
  assert_trains_as_plain(loss_fn, params, x, stepped)


@needs_flax
def test_linen_embed_overriding_setup_trains_as_plain():
  """nn.Embed reads its table in ``setup()``; this one halves it there.

  Refused while immgrad re-implemented nn.Embed; now its own code runs.
  """

  class HalfEmbed(nn.Embed):
    def setup(self):
      self.embedding = 0.5 * self.param(
        "embedding",
        self.embedding_init,
        (self.num_embeddings, self.features),
        self.param_dtype,
      )

  model = HalfEmbed(5, 3)
  ids = [jnp.array([0, 3, 4]), jnp.array([1, 1, 2]), jnp.array([4, 0, 2])]
  loss_fn, params = _linen_loss(model, ids[0])
  assert_trains_as_plain(loss_fn, params, ids, 1)


@needs_flax
def test_linen_subclass_with_own_call_and_fields_trains_as_plain():
  """A new field, a new default and a ``__call__`` around the base's."""

  class PreScaledDense(nn.Dense):
    factor: float = 0.5
    kernel_init: nn.initializers.Initializer = nn.initializers.normal(1.0)

    @nn.compact
    def __call__(self, x):
      return 2.0 * super().__call__(self.factor * x)

  x = _batches((4, 5))
  loss_fn, params = _linen_loss(_linen_net(lambda: PreScaledDense(4)), x[0])
  assert_trains_as_plain(loss_fn, params, x, 4)


@needs_flax
@pytest.mark.parametrize(
  "wrapper,stepped",
  [("WeightNorm", 5), ("SpectralNorm", 4), ("map_variables", 4)],
)
def test_linen_weight_wrappers_train_as_plain(wrapper, stepped):
  """Refused while immgrad re-implemented nn.Dense (it would have read the
  raw kernel); now the wrapper's own code runs. nn.WeightNorm's scale (its
  own parameter, not nn.Dense's) is preprocessing of the layer, stepped by
  default like every parameter: 5 of 5.
  """
  wrap = {
    "WeightNorm": lambda: nn.WeightNorm(nn.Dense(4)),
    "SpectralNorm": lambda: functools.partial(
      nn.SpectralNorm(nn.Dense(4)), update_stats=False
    ),
    "map_variables": lambda: nn.map_variables(
      nn.Dense, "params", lambda v: jax.tree.map(lambda a: 2 * a, v), init=True
    )(4),
  }[wrapper]
  x = _batches((2, 5))
  loss_fn, params = _linen_loss(_linen_net(wrap), x[0])
  assert_trains_as_plain(loss_fn, params, x, stepped)


def _scale_dense_inputs(next_fun, args, kwargs, context):
  """A Linen interceptor: doubles the inputs of nn.Dense's calls."""
  if isinstance(context.module, nn.Dense) and context.method_name == (
    "__call__"
  ):
    args = (2.0 * args[0],) + args[1:]
  return next_fun(*args, **kwargs)


@needs_flax
def test_linen_interceptor_inside_or_outside_trains_as_plain():
  """Inside was refused while immgrad answered nn.Dense's call itself (the
  user's interceptor would have been skipped); nothing is answered now.
  """
  x = _batches((4, 5))
  model = nn.Sequential([nn.Dense(4), jax.nn.relu, nn.Dense(3)])
  variables = model.init(jax.random.PRNGKey(0), x[0])

  def inside(params, x):
    with nn.intercept_methods(_scale_dense_inputs):
      return jnp.mean(model.apply({"params": params}, x) ** 2)

  assert_trains_as_plain(
    immgrad.flax.immediate(inside), variables["params"], x, 4
  )

  immediate = immgrad.flax.immediate(
    lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)
  )

  def outside(params, x):
    with nn.intercept_methods(_scale_dense_inputs):
      return immediate(params, x)

  assert_trains_as_plain(outside, variables["params"], x, 4)


# -- Flax NNX ------------------------------------------------------------------


def _nnx_loss(model):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, x):
    return jnp.mean(nnx.merge(graphdef, params, rest, copy=True)(x) ** 2)

  return immgrad.flax.immediate(loss_fn), params


@needs_flax
def test_nnx_kernel_read_through_a_property_trains_as_plain():
  """``nnx.Linear`` reads ``self.kernel``: here a standardising property.

  Refused while immgrad re-implemented nnx.Linear; now its own code runs,
  the standardisation is preprocessing of the immediate layer.
  """

  class StdLinear(nnx.Linear):
    @property
    def kernel(self):
      return _standardise(self.raw_kernel[...], (0,))

    @kernel.setter
    def kernel(self, value):
      self.raw_kernel = value

  model = StdLinear(5, 3, rngs=nnx.Rngs(0))
  loss_fn, params = _nnx_loss(model)
  assert_trains_as_plain(loss_fn, params, _batches((2, 5)), 2)


@needs_flax
@pytest.mark.parametrize("wrapper", ["WeightNorm", "SpectralNorm"])
def test_nnx_weight_wrappers_train_as_plain(wrapper):
  """Refused while immgrad re-implemented nnx.Linear; now the wrapper's
  own code runs. Both leaves are the wrapped nnx.Linear's: immediate.
  """
  rngs = nnx.Rngs(0)
  layer = nnx.Linear(5, 3, rngs=rngs)
  model = (
    nnx.WeightNorm(layer, rngs=rngs)
    if wrapper == "WeightNorm"
    else nnx.SpectralNorm(layer, update_stats=False, rngs=rngs)
  )
  loss_fn, params = _nnx_loss(model)
  assert_trains_as_plain(loss_fn, params, _batches((2, 5)), 2)


@needs_flax
def test_nnx_subclasses_with_own_call_train_as_plain():
  """Around the base's ``__call__``, or instead of it: both immediate (the
  second was ordinary while immgrad re-implemented nnx.Linear's call: now
  what the program does with an nnx.Linear's kernel decides, 2 -> 3).
  """

  class PreScaled(nnx.Linear):
    def __call__(self, x):
      return 2.0 * super().__call__(0.5 * x)

  class OwnCall(nnx.Linear):  # Never reaches nnx.Linear's __call__.
    def __call__(self, x):
      return x @ _standardise(self.kernel[...], (0,))

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.first = PreScaled(5, 4, rngs=rngs)
      self.second = OwnCall(4, 3, use_bias=False, rngs=rngs)

    def __call__(self, x):
      return self.second(jax.nn.relu(self.first(x)))

  loss_fn, params = _nnx_loss(Net(nnx.Rngs(0)))
  assert_trains_as_plain(loss_fn, params, _batches((4, 5)), 3)


# -- Haiku ---------------------------------------------------------------------


def _haiku_loss(forward, x):
  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  params = model.init(jax.random.PRNGKey(0), x)
  return lambda p, x: jnp.mean(model.apply(p, x) ** 2), params


def _double(next_getter, value, context):
  del context
  return next_getter(2.0 * value)


def _unchanged(next_getter, value, context):
  del context
  return next_getter(value)


@pytest.mark.parametrize("getter", [_double, _unchanged])
def test_haiku_custom_getter_trains_as_plain(getter):
  """A getter runs inside the module's call, which is one layer: a weight
  it changes is parameter-only preprocessing (it was refused before
  immgrad.haiku stood on immgrad.immediate).
  """

  def forward(x):
    with hk.custom_getter(getter):
      return hk.nets.MLP([4, 3])(x)

  x = _batches((4, 5))
  loss_fn, params = _haiku_loss(forward, x[0])
  assert_trains_as_plain(loss_fn, params, x, 4)


def test_haiku_mixed_precision_policy_trains_as_plain():
  """``hk.mixed_precision`` casts the parameters through a custom getter
  and the inputs through an interceptor: both inside the layer.
  """
  policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
  hk.mixed_precision.set_policy(hk.Linear, policy)
  try:
    x = _batches((2, 5))
    loss_fn, params = _haiku_loss(lambda x: hk.Linear(3)(x), x[0])
    assert_trains_as_plain(loss_fn, params, x, 2)
  finally:
    hk.mixed_precision.clear_policy(hk.Linear)


def test_haiku_embeddings_read_through_a_property_trains_as_plain():
  """``hk.Embed`` reads ``self.embeddings``: here a standardising one."""

  class StdEmbed(hk.Embed):
    @property
    def embeddings(self):
      return _standardise(super().embeddings, (0,))

  ids = [jnp.array([0, 3, 4]), jnp.array([1, 1, 2]), jnp.array([4, 0, 2])]
  model = hk.without_apply_rng(
    hk.transform(immgrad.haiku.immediate(lambda i: StdEmbed(5, 3)(i)))
  )
  params = model.init(jax.random.PRNGKey(0), ids[0])
  weights = jnp.arange(3.0)
  assert_trains_as_plain(
    lambda p, i: jnp.sum(jnp.tanh(model.apply(p, i)) * weights), params, ids, 1
  )


def test_haiku_subclasses_with_own_call_train_as_plain():
  """Around the base's ``__call__``, or instead of it: a chosen class's
  call is one layer either way, so OwnCall's standardised weight is
  stepped too (it trained ordinarily when the adapter computed
  hk.Linear's call itself).
  """

  class PreScaled(hk.Linear):
    def __call__(self, x):
      return 2.0 * super().__call__(0.5 * x)

  class OwnCall(hk.Linear):
    def __call__(self, x):
      w = hk.get_parameter(
        "w",
        [x.shape[-1], self.output_size],
        x.dtype,
        init=hk.initializers.RandomNormal(),
      )
      return x @ _standardise(w, (0,))

  def forward(x):
    return OwnCall(3)(jax.nn.relu(PreScaled(4)(x)))

  x = _batches((4, 5))
  loss_fn, params = _haiku_loss(forward, x[0])
  assert_trains_as_plain(loss_fn, params, x, 3)


def _scale_linear_inputs(next_f, args, kwargs, context):
  """A Haiku interceptor: doubles the inputs of hk.Linear's calls."""
  if isinstance(context.module, hk.Linear) and context.method_name == (
    "__call__"
  ):
    args = (2.0 * args[0],) + args[1:]
  return next_f(*args, **kwargs)


def test_haiku_interceptor_inside_or_outside_trains_as_plain():
  """immgrad.haiku no longer answers a module's call itself (it was refused
  inside, where ours would have skipped it): nothing is skipped now.
  """

  def inside(x):
    with hk.intercept_methods(_scale_linear_inputs):
      return hk.nets.MLP([4, 3])(x)

  x = _batches((4, 5))
  loss_fn, params = _haiku_loss(inside, x[0])
  assert_trains_as_plain(loss_fn, params, x, 4)

  immediate = immgrad.haiku.immediate(lambda x: hk.nets.MLP([4, 3])(x))

  def outside(x):
    with hk.intercept_methods(_scale_linear_inputs):
      return immediate(x)

  model = hk.without_apply_rng(hk.transform(outside))
  params = model.init(jax.random.PRNGKey(0), x[0])
  assert_trains_as_plain(
    lambda p, x: jnp.mean(model.apply(p, x) ** 2), params, x, 4
  )


# -- Equinox -------------------------------------------------------------------


def _equinox_loss(model, state=None, modules=None):
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, x):
    model = eqx.combine(params, static)
    if state is None:
      return jnp.mean(jax.vmap(model)(x) ** 2)
    y, _ = jax.vmap(
      model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(x, state)
    return jnp.mean(y**2)

  chosen = {} if modules is None else {"modules": modules}
  return immgrad.equinox.immediate(loss_fn, **chosen), params


@needs_equinox
@pytest.mark.parametrize(
  "wrapper,chosen,stepped",
  [
    # By default every leaf: v and g, preprocessing of one layer; bias.
    ("WeightNorm", "default", 3),
    # DEFAULT_MODULES: Linear's bias; its weight v is read twice (the norm,
    # and v * g with g an argument like the data, WeightNorm not chosen).
    ("WeightNorm", "library", 1),
    ("WeightNorm", "library and mine", 3),  # + (WeightNorm,).
    ("SpectralNorm", "default", 2),  # The power iteration's u, v: constants.
  ],
)
def test_equinox_weight_wrappers_train_as_plain(wrapper, chosen, stepped):
  """The step runs the wrapper's own code: the raw leaves are stepped."""
  key = jax.random.key(0)
  layer, state = eqx.nn.Linear(5, 3, key=key), None
  if wrapper == "WeightNorm":
    model = eqx.nn.WeightNorm(layer)
  else:
    model, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
      layer, "weight", key=key
    )
  modules = {
    "default": None,
    "library": immgrad.equinox.DEFAULT_MODULES,
    "library and mine": immgrad.equinox.DEFAULT_MODULES + (type(model),),
  }[chosen]
  loss_fn, params = _equinox_loss(model, state, modules)
  assert_trains_as_plain(loss_fn, params, _batches((2, 5)), stepped)


@needs_equinox
def test_equinox_subclasses_with_own_call_train_as_plain():
  """Around the base's ``__call__`` (immediate), or instead of it."""

  class PreScaled(eqx.nn.Linear):
    def __call__(self, x, *, key=None):
      return 2.0 * super().__call__(0.5 * x, key=key)

  class OwnCall(eqx.nn.Linear):  # Standardised weight: one dot_general.
    def __call__(self, x, *, key=None):
      return _standardise(self.weight, (1,)) @ x

  class Net(eqx.Module):
    first: PreScaled
    second: OwnCall

    def __call__(self, x):
      return self.second(jax.nn.relu(self.first(x)))

  k1, k2 = jax.random.split(jax.random.key(0))
  model = Net(PreScaled(5, 4, key=k1), OwnCall(4, 3, use_bias=False, key=k2))
  loss_fn, params = _equinox_loss(model)
  assert_trains_as_plain(loss_fn, params, _batches((4, 5)), 3)


@needs_equinox
def test_equinox_conv_overriding_its_padding_trains_as_plain():
  """``eqx.nn.Conv`` pads through ``self._nonzero_pad``; this one differs."""

  class EdgePadConv(eqx.nn.Conv2d):
    def _nonzero_pad(self, x):
      return jnp.pad(x, [(0, 0), (1, 1), (1, 1)], mode="edge")

  model = EdgePadConv(
    3, 2, 3, padding=1, padding_mode="REFLECT", key=jax.random.key(0)
  )
  loss_fn, params = _equinox_loss(model)
  assert_trains_as_plain(loss_fn, params, _batches((2, 3, 5, 5)), 2)
