"""``immgrad.haiku``: unmodified Haiku models, immediate.

:func:`immgrad.immediate` over the transform's params that ``fn`` reads, run
in a Haiku frame holding the traced params, state and rng. That frame
(``haiku._src.stateful``) is private Haiku API, confined to ``haiku_private.py``;
``tests/test_haiku_models.py`` checks it exists and trains through it.
"""

import contextlib
import functools
import threading
from typing import Any, Callable, Sequence

import haiku as hk
import jax
import jax.core
from jax.extend import core as jex_core
import jax.numpy as jnp

from immgrad._src import auto
from immgrad._src import context
from immgrad._src.adapters import common
from immgrad._src.adapters import haiku_private

_NAME = "immgrad.haiku.immediate"

_COPY = (
  "immgrad.haiku.immediate: parameter {path!r} reaches {fn} as a value "
  "computed from the step's parameter, not the parameter itself, so it "
  "would train ordinarily unnoticed: params cast before `apply` (compute "
  "in bfloat16 with immediate(compute_dtype=...) or hk.mixed_precision "
  "instead), or a transformation between the step and {fn} "
  "(hk.layer_stack, hk.scan, hk.vmap, jax.jit, ... around an immgrad.haiku "
  "module: wrap the function that holds it in immgrad.haiku.immediate, or "
  "use immgrad.haiku.layer_stack)."
)

DEFAULT_MODULES = (hk.Linear, hk.ConvND, hk.LayerNorm, hk.RMSNorm, hk.Embed)

# Those that compute in ``immediate(compute_dtype=...)``: the matrix
# products. Normalisations keep their inputs' dtype (float32 in usual mixed
# precision practice).
_CASTING = (hk.Linear, hk.ConvND, hk.Embed)

_local = threading.local()


def _active() -> bool:
  """Whether this thread runs a model inside an ``immediate`` now."""
  return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _running():
  _local.depth = getattr(_local, "depth", 0) + 1
  try:
    yield
  finally:
    _local.depth -= 1


def immediate(
  fn: Callable[..., Any],
  modules: Sequence[type] | None = None,
  *,
  compute_dtype: Any | None = None,
  strict: bool = False,
) -> Callable[..., Any]:
  """Makes the parameters of the Haiku model in ``fn`` immediate.

  Args:
    fn: a Haiku forward function, to be passed to ``hk.transform`` or
      ``hk.transform_with_state`` as usual.
    modules: None (the default): every parameter ``fn`` reads, as
      :func:`immgrad.immediate` takes them; what still trains ordinarily (a tied
      weight, a recurrent cell's weights) is reported. A tuple of ``hk.Module``
      classes (subclasses included): only the parameters those modules read; it
      replaces the default, so ``DEFAULT_MODULES + (MyModule,)`` is Haiku's
      weight-carrying modules (``hk.Linear``, ``hk.ConvND``, ``hk.LayerNorm``,
      ``hk.RMSNorm``, ``hk.Embed``) and yours. The modules of ``immgrad.haiku``
      are always chosen. With dX at other
      weights than the old ones, each call of a chosen module (by
      default, of ``DEFAULT_MODULES``) is one layer.
    compute_dtype: mixed precision (e.g. ``jnp.bfloat16``): the chosen
      (by default ``DEFAULT_MODULES``') ``hk.Linear``, ``hk.ConvND`` and
      ``hk.Embed`` cast their floating
      inputs and weights to it and return it; the weights and their
      updates stay float32. Normalisations compute in their inputs' dtype.
      It applies outside ``immgrad.value_and_grad`` too, so plain training
      of ``fn`` runs the same arithmetic.
    strict: raise ``ValueError`` where an :class:`immgrad.OrdinaryWarning`
      would be issued (a parameter this function was asked to step that
      trains ordinarily: tied, read outside its layer, reused by a loop).

  Returns:
    ``fn``, with those modules' weights updated during the backward pass
    inside ``immgrad.value_and_grad``. Outside it ``fn`` is unchanged
    (but for ``compute_dtype``): init makes exactly Haiku's parameters.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp, optax
    >>> import immgrad, immgrad.haiku
    >>> def forward(x):
    ...   return hk.nets.MLP([8, 1])(x)
    >>> model = hk.without_apply_rng(hk.transform(
    ...     immgrad.haiku.immediate(forward)))
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> params = model.init(jax.random.PRNGKey(0), x)
    >>> tx = immgrad.shim(optax.adam(1e-3))
    >>> opt_state = tx.init(params)
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((model.apply(params, x) - y) ** 2)
    >>> step = jax.jit(immgrad.value_and_grad(loss_fn, tx))
    >>> loss, grads = step(params, opt_state, x, y)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)

    Haiku's weight-carrying modules and a module of your own only (the
    default is every parameter; a tuple replaces it):

    >>> class Scale(hk.Module):
    ...   def __call__(self, x):
    ...     return x * hk.get_parameter("s", x.shape[-1:], init=jnp.ones)
    >>> chosen = immgrad.haiku.immediate(
    ...     lambda x: Scale()(hk.Linear(2)(x)),
    ...     modules=immgrad.haiku.DEFAULT_MODULES + (Scale,))
  """
  common.check_callable(fn, _NAME, "a Haiku forward function")
  chosen = common.check_modules(
    modules, (hk.Module,), _NAME, "hk.Module", "(hk.Linear, hk.Conv2D)"
  )
  units = (DEFAULT_MODULES if chosen is None else chosen) + IMMEDIATE_CLASSES
  if chosen is not None:
    chosen += IMMEDIATE_CLASSES

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with _casting(units, compute_dtype):
      whole = context.analysing()
      if whole is not None and not _active() and not hk.running_init():
        return _as_units(fn, units, whole, args, kwargs)
      step = context.current() or auto.surveying()
      if step is None or _active() or hk.running_init():
        return fn(*args, **kwargs)
      return _step(fn, step, chosen, units, strict, args, kwargs)

  return wrapped


def _step(
  fn, step, chosen: tuple[type, ...] | None, units, strict: bool, args, kwargs
):
  """``fn(*args, **kwargs)`` through ``immgrad.immediate``, in a step.

  ``chosen``: the classes whose modules' parameters are stepped (None:
  every parameter ``fn`` reads); ``units``: those whose calls are one
  layer each when dX is taken at other weights than the old ones;
  ``strict``: as :func:`immgrad.immediate`'s.

  ``fn`` runs in a Haiku frame holding the traced params, state and rng
  (Haiku's own ``temporary_internal_state``, which ``hk.remat`` and
  ``hk.vmap`` use), and the state and rng it leaves are written back to the
  caller's frame, so that ``hk.BatchNorm``'s statistics and
  ``hk.next_rng_key`` work as in plain Haiku. Every leaf not chosen is an
  argument like the data: it keeps an ordinary gradient, which the shim
  applies. A weight a custom getter computes (``hk.custom_getter``,
  ``hk.mixed_precision``) is parameter-only preprocessing of its layer.
  """
  params = hk.get_params()
  outer = haiku_private.frame(params=False)
  owners = _owners(fn, params, outer, args, kwargs)
  mine, others = {}, {}
  for bundle, leaves in params.items():
    for name, leaf in leaves.items():
      read, owner = _owner(owners, bundle, name)
      stepped = read and (
        chosen is None or (owner is not None and issubclass(owner, chosen))
      )
      if stepped and step.find(leaf, _NAME) is not None:
        mine.setdefault(bundle, {})[name] = leaf
      elif stepped and isinstance(leaf, jax.core.Tracer):
        raise ValueError(
          _COPY.format(path=f"{bundle}/{name}", fn=common.name(fn))
        )
      else:
        others.setdefault(bundle, {})[name] = leaf

  # Module boundaries matter only for dX taken at other weights than the
  # old ones. At the old weights (mode="current") every primitive is its
  # own layer, so the backward pass is plain's, operation for operation:
  # a unit would sum the cotangents of its input's uses inside itself,
  # a different float association (bfloat16 models round it apart).
  intercept = functools.partial(_unit, units) if _by_module(step) else _through

  def call(mine, others, state, rng, args, kwargs):
    full = {b: {**others.get(b, {}), **mine.get(b, {})} for b in params}
    with haiku_private.running_in(full, state, rng, share_python_state=True):
      with hk.intercept_methods(intercept):
        out = fn(*args, **kwargs)
      after = haiku_private.frame(params=False)
    return out, after.state, after.rng

  with _running():
    out, state, rng = auto.immediate(call, strict=strict)(
      mine, others, outer.state, outer.rng, args, kwargs
    )
  haiku_private.write_back(state, rng)
  return out


def _as_units(fn, units, step, args, kwargs):
  """``fn`` traced for a loss planned whole: each call of a module of
  ``units`` one unit where the step's dX needs module boundaries, as in
  :func:`_step`.

  With dX at the old weights (``mode="current"``) every primitive is its own
  layer and the backward pass is plain Haiku's. Otherwise each call of a
  chosen module is one ``custom_vjp`` unit (:func:`_unit`), which
  ``immgrad.immediate`` takes for one layer: a normalisation's statistics are
  inside it, and ``mode="updated"`` takes dX of the whole module at its new
  weights.
  """
  if not _by_module(step):
    return fn(*args, **kwargs)
  with hk.intercept_methods(functools.partial(_unit, units)):
    return fn(*args, **kwargs)


def _by_module(step) -> bool:
  """Whether each chosen module's call is one unit: where the step takes dX
  at other weights than the old ones. Not in ``immgrad.layers``' survey,
  which reports ``mode="current"``'s layers.
  """
  return isinstance(step, context.Registry) and (
    step.settings.dx_at != 0 or step.settings.measure_dx
  )


def _owners(fn, params, outer, args, kwargs) -> dict:
  """(bundle, name) -> the class of the module that reads that parameter.

  An abstract run of ``fn`` (``jax.eval_shape``) in a copy of the frame,
  whose names and state the real run does not see.

  It runs under an ``hk.custom_getter``, which sees the module that reads each
  parameter (``GetterContext.module``).
  """
  owners = {}

  def record(next_getter, value, ctx):
    module = ctx.module
    owners.setdefault(
      tuple(ctx.full_name.rsplit("/", 1)), type(module) if module else None
    )
    return next_getter(value)

  def probe(params, state, rng, dynamic):
    full = list(leaves)
    for i, value in zip(positions, dynamic):
      full[i] = value
    args, kwargs = treedef.unflatten(full)
    with haiku_private.running_in(params, state, rng), _running():
      with hk.custom_getter(record):
        fn(*args, **kwargs)

  leaves, treedef = jax.tree.flatten((args, kwargs))
  positions = [i for i, leaf in enumerate(leaves) if common.is_array(leaf)]
  jax.eval_shape(
    probe, params, outer.state, outer.rng, [leaves[i] for i in positions]
  )
  return owners


def _owner(owners: dict, bundle: str, name: str) -> tuple[bool, type | None]:
  """Whether ``fn`` reads ``bundle/name``; the class of the module that
  does (None: read outside any module).

  A transform inside ``fn`` (``hk.layer_stack``'s per-layer
  ``hk.transform``) reads its parameters under names relative to the
  module that lifted them: ``linear`` for ``__layer_stack_no_per_layer/
  linear``. Those match the end of the outer name.
  """
  if (bundle, name) in owners:
    return True, owners[bundle, name]
  inner = [b for b, n in owners if n == name and bundle.endswith("/" + b)]
  return (True, owners[max(inner, key=len), name]) if inner else (False, None)


def _through(next_f, args, kwargs, ctx):
  del ctx
  return next_f(*args, **kwargs)


def _unit(chosen, next_f, args, kwargs, ctx):
  """A chosen module's call, bound as one unit (``immediate`` sees a layer).

  Traces the call to a jaxpr whose inputs are the module's own parameters
  and state (bundles at or below its name), the rng and the call's array
  arguments, in a frame holding those, and binds it as a ``custom_vjp``
  whose rule is the jaxpr's own ``jax.vjp``: plain arithmetic, one layer.
  """
  module = ctx.module
  if (
    ctx.method_name != "__call__"
    or not isinstance(module, chosen)
    or getattr(_local, "unit", False)
  ):
    return next_f(*args, **kwargs)
  prefix = module.module_name
  own = lambda b: b == prefix or b.startswith(prefix + "/")
  frame = haiku_private.frame()
  params = {b: p for b, p in frame.params.items() if own(b)}
  state = {b: s for b, s in frame.state.items() if own(b)}
  leaves, treedef = jax.tree.flatten((params, state, frame.rng, args, kwargs))
  positions = [i for i, leaf in enumerate(leaves) if common.is_array(leaf)]

  def body(*dynamic):
    full = list(leaves)
    for i, value in zip(positions, dynamic):
      full[i] = value
    p, s, rng, a, kw = treedef.unflatten(full)
    outer, _local.unit = getattr(_local, "unit", False), True
    try:
      with haiku_private.running_in(
        {**frame.params, **p},
        {**frame.state, **s},
        rng,
        share_python_state=True,
      ):
        out = next_f(*a, **kw)
        after = haiku_private.frame(params=False)
    finally:
      _local.unit = outer
    mine = {b: v for b, v in after.state.items() if own(b)}
    return out, mine, after.rng

  closed, shape = jax.make_jaxpr(body, return_shape=True)(
    *[leaves[i] for i in positions]
  )
  flat = _bound(closed.jaxpr)(closed.consts, [leaves[i] for i in positions])
  out, state, rng = jax.tree.unflatten(jax.tree.structure(shape), flat)
  haiku_private.write_back(state, rng)
  return out


def _bound(jaxpr) -> Callable:
  """``jaxpr`` as one ``custom_vjp`` of (consts, args): plain derivative."""

  def run(consts, args):
    return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, consts))(*args)

  unit = jax.custom_vjp(run)

  def fwd(consts, args):
    return jax.vjp(run, consts, args)

  unit.defvjp(fwd, lambda vjp, dy: vjp(dy))
  return unit


@contextlib.contextmanager
def _casting(chosen: tuple[type, ...], compute_dtype):
  """The chosen matrix products compute in ``compute_dtype``, if set.

  A getter that casts the chosen ``hk.Linear``, ``hk.ConvND`` and ``hk.Embed``
  weights, and an interceptor that casts their floating inputs, in and out of
  a step alike.
  """
  if compute_dtype is None:
    yield
    return

  def cast(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(compute_dtype)
    return x

  def getter(next_getter, value, ctx):
    del ctx
    return next_getter(cast(value))

  def interceptor(next_f, args, kwargs, ctx):
    if (
      ctx.method_name != "__call__"
      or not isinstance(ctx.module, chosen)
      or not isinstance(ctx.module, _CASTING)
      or hk.running_init()  # Haiku's parameters, in Haiku's dtypes.
    ):
      return next_f(*args, **kwargs)
    args, kwargs = jax.tree.map(cast, (args, kwargs))
    with hk.custom_getter(getter):
      return next_f(*args, **kwargs)

  with hk.intercept_methods(interceptor):
    yield


def layer_stack(num_layers: int, **kwargs) -> Callable[[Callable], Callable]:
  """``hk.layer_stack`` whose stacked layers update immediately.

  Same arguments as ``hk.layer_stack`` (``with_per_layer_inputs``,
  ``unroll``, ``name``, ...). The stack runs through :func:`immediate`, so
  its ``lax.scan`` over the stacked weights becomes ``immgrad.scan``: each
  layer's modules of ``immgrad.haiku`` step their own slice of the stacked
  weights and optimizer state once per step. Inside :func:`immediate` a
  plain ``hk.layer_stack`` already does this for the chosen modules.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import immgrad.haiku
    >>> def forward(x):
    ...   @immgrad.haiku.layer_stack(3)
    ...   def block(x):
    ...     return jax.nn.relu(immgrad.haiku.Linear(4)(x))
    ...   return block(x)
    >>> model = hk.without_apply_rng(hk.transform(forward))
    >>> params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    >>> params["__layer_stack_no_per_layer/linear"]["w"].shape
    (3, 4, 4)
  """
  stack = hk.layer_stack(num_layers, **kwargs)
  return lambda f: immediate(stack(f), modules=())


def _module_call(module: hk.Module, call, *args, **kwargs):
  """A module of ``immgrad.haiku``: its own call, through :func:`immediate`."""
  return immediate(call, modules=(type(module),))(*args, **kwargs)


class Linear(hk.Linear):
  """``hk.Linear`` whose weights update immediately in ``value_and_grad``.

  Same constructor, parameter names, shapes, dtypes and initialisers as
  ``hk.Linear``: checkpoints move between the two unchanged.

  Example:
    >>> import haiku as hk, jax, jax.numpy as jnp
    >>> import immgrad.haiku
    >>> f = hk.without_apply_rng(hk.transform(
    ...     lambda x: immgrad.haiku.Linear(2)(x)))
    >>> g = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(2)(x)))
    >>> x = jnp.ones((1, 3))
    >>> key = jax.random.PRNGKey(0)
    >>> jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
    ...              f.init(key, x), g.init(key, x))
    {'linear': {'b': True, 'w': True}}
  """

  def __call__(self, inputs, *, precision=None):
    return _module_call(self, super().__call__, inputs, precision=precision)


class ConvND(hk.ConvND):
  """``hk.ConvND`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return _module_call(self, super().__call__, inputs, precision=precision)


class Conv1D(hk.Conv1D):
  """``hk.Conv1D`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return _module_call(self, super().__call__, inputs, precision=precision)


class Conv2D(hk.Conv2D):
  """``hk.Conv2D`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return _module_call(self, super().__call__, inputs, precision=precision)


class Conv3D(hk.Conv3D):
  """``hk.Conv3D`` whose weights update immediately in ``value_and_grad``."""

  def __call__(self, inputs, *, precision=None):
    return _module_call(self, super().__call__, inputs, precision=precision)


class LayerNorm(hk.LayerNorm):
  """``hk.LayerNorm`` whose scale and offset update immediately."""

  def __call__(self, inputs, scale=None, offset=None):
    return _module_call(self, super().__call__, inputs, scale, offset)


class RMSNorm(hk.RMSNorm):
  """``hk.RMSNorm`` whose scale updates immediately."""

  def __call__(self, inputs):
    return _module_call(self, super().__call__, inputs)


class Embed(hk.Embed):
  """``hk.Embed`` whose embeddings update immediately."""

  def __call__(self, ids, lookup_style=None, precision=None):
    return _module_call(self, super().__call__, ids, lookup_style, precision)


IMMEDIATE_CLASSES = (
  Linear,
  ConvND,
  Conv1D,
  Conv2D,
  Conv3D,
  LayerNorm,
  RMSNorm,
  Embed,
)
