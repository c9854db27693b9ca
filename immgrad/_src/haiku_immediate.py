"""``immgrad.haiku.immediate`` and ``layer_stack``: unmodified Haiku models.

``immediate(fn)`` runs ``fn`` under ``hk.intercept_methods``: inside
``immgrad.value_and_grad``, each call of a chosen Haiku module (by default
every ``hk.Linear``, ``hk.Conv*``, ``hk.LayerNorm``, ``hk.RMSNorm`` and
``hk.Embed``, including those inside ``hk.nets.MLP``, attention and ResNet
blocks) is computed by ``haiku_layers``: the same parameters, through an
immediate layer. Other modules (``hk.BatchNorm``, whose statistics are Haiku
state, or a module not chosen) keep ordinary gradients, which the shim
applies. A module whose weights a custom getter changes
(``hk.custom_getter``, ``hk.mixed_precision``), or one an interceptor
installed inside ``immediate`` would see (ours runs first and would skip
it; found in Haiku's private ``interceptor_stack``), is refused by name
(``reparam.py``, ``docs/reparametrised.md``).

Stacked layers: Haiku's ``layer_stack`` scans its body over stacked
parameters with ``jax.lax.scan``. Inside ``immediate`` (and in
:func:`layer_stack`) that scan is ``immgrad.scan``, which passes each layer
its own slice of the weights and optimizer state. Haiku's layer_stack looks
``jax.lax.scan`` up when it runs, so we hand its module a ``jax`` whose
``lax.scan`` is ours while the model runs; outside a step ``immgrad.scan``
is ``jax.lax.scan``, so nothing else changes.
"""

import functools
import threading
from typing import Any, Callable, Sequence

import haiku as hk
from haiku._src import layer_stack as hk_layer_stack
from haiku._src import module as hk_module
from haiku._src import stateful as hk_stateful
import jax

from immgrad._src import context
from immgrad._src import haiku_layers
from immgrad._src import remat as remat_lib
from immgrad._src import scan as scan_lib

DEFAULT_MODULES = (hk.Linear, hk.ConvND, hk.LayerNorm, hk.RMSNorm, hk.Embed)


def immediate(
  fn: Callable[..., Any],
  modules: Sequence[type] = DEFAULT_MODULES,
  *,
  compute_dtype: Any | None = None,
) -> Callable[..., Any]:
  """Makes the chosen Haiku modules in ``fn`` immediate layers.

  Args:
    fn: a Haiku forward function, to be passed to ``hk.transform`` or
      ``hk.transform_with_state`` as usual.
    modules: the module classes to make immediate (subclasses included):
      any of ``hk.Linear``, ``hk.ConvND`` (or ``hk.Conv1D``/``2D``/``3D``),
      ``hk.LayerNorm``, ``hk.RMSNorm``, ``hk.Embed``. Default: all of them.
    compute_dtype: mixed precision (e.g. ``jnp.bfloat16``): the chosen
      ``hk.Linear``, ``hk.ConvND`` and ``hk.Embed`` cast their floating
      inputs and weights to it inside the immediate layer
      (``immediate_layer(compute_dtype=...)``) and return it; the weights
      and their updates stay float32. Normalisations compute in their
      inputs' dtype. It applies outside ``immgrad.value_and_grad`` too, so
      plain training of ``fn`` runs the same arithmetic.

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
  """
  if not callable(fn):
    raise TypeError(
      f"immgrad.haiku.immediate expects a Haiku forward function, got {fn!r}."
    )
  chosen = _check_modules(modules)

  def interceptor(next_f, args, kwargs, ctx):
    implementation = haiku_layers.IMPLEMENTATIONS.get(ctx.orig_class)
    cast = (
      compute_dtype
      if issubclass(ctx.orig_class, haiku_layers.CASTING)
      else None
    )
    if (
      ctx.method_name != "__call__"
      or implementation is None
      or not isinstance(ctx.module, chosen)
      or (context.current() is None and cast is None)
    ):
      return next_f(*args, **kwargs)
    _check_inner_interceptors(ctx.module, interceptor)
    if cast is not None:
      kwargs = dict(kwargs, compute_dtype=cast)
    return implementation(ctx.module, next_f, *args, **kwargs)

  interceptor.immgrad = True  # Ours: see _check_inner_interceptors.

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with hk.intercept_methods(interceptor), _immediate_transforms():
      return fn(*args, **kwargs)

  return wrapped


def _check_inner_interceptors(module: hk.Module, ours: Callable) -> None:
  """Refuses the call if an interceptor was installed inside ``immediate``.

  Haiku runs interceptors outermost first, so ours would answer the call
  and skip the inner one. (The stack is Haiku's private
  ``haiku._src.module.interceptor_stack``, iterated innermost first.)
  """
  for interceptor in hk_module.interceptor_stack:
    if interceptor is ours:
      return
    if not getattr(interceptor, "immgrad", False):
      name = haiku_layers.public_name(module)
      raise ValueError(
        f"immgrad.haiku.immediate: the Haiku interceptor {interceptor!r}, "
        f"installed inside it, would be skipped for {name} "
        f"{module.module_name!r}, whose call immgrad computes itself. "
        "Install it outside instead (hk.intercept_methods around the "
        "wrapped function), so that it runs first, or leave "
        f"{name} out of `modules=`."
      )


def _check_modules(modules) -> tuple[type, ...]:
  if isinstance(modules, type):
    modules = (modules,)
  supported = tuple(haiku_layers.IMPLEMENTATIONS)
  names = ", ".join(f"hk.{c.__name__}" for c in supported)
  for cls in modules:
    if not (isinstance(cls, type) and issubclass(cls, supported)):
      raise ValueError(
        f"immgrad.haiku.immediate: cannot make {cls!r} immediate. Supported "
        f"modules (and their subclasses): {names}. Other modules, such as "
        "hk.BatchNorm (its statistics are Haiku state, not weights) or "
        "your own, keep ordinary gradients: build custom ones from these, "
        "or from immgrad.immediate_layer."
      )
  return tuple(modules)


def layer_stack(num_layers: int, **kwargs) -> Callable[[Callable], Callable]:
  """``hk.layer_stack`` whose stacked layers update immediately.

  Same arguments as ``hk.layer_stack`` (``with_per_layer_inputs``,
  ``unroll``, ``name``, ...). Its scan is ``immgrad.scan``, so each layer's
  immediate modules step their own slice of the stacked weights and
  optimizer state once per step. Inside :func:`immediate` a plain
  ``hk.layer_stack`` already does this; use this one with the modules of
  ``immgrad.haiku`` in a model not wrapped by ``immediate``.

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

  def iterate(f):
    stacked = stack(f)

    @functools.wraps(stacked)
    def wrapped(*args, **call_kwargs):
      with _immediate_transforms():
        return stacked(*args, **call_kwargs)

    return wrapped

  return iterate


class _Lax:
  """``jax.lax`` with ``scan`` replaced by ``immgrad.scan``."""

  scan = staticmethod(scan_lib.scan)

  def __getattr__(self, name):
    return getattr(jax.lax, name)


class _JaxForLayerStack:
  """``jax`` as Haiku's layer_stack sees it while a model runs here."""

  lax = _Lax()

  def __getattr__(self, name):
    return getattr(jax, name)


class _JaxForRemat:
  """``jax`` as Haiku's ``hk.remat`` sees it while a model runs here."""

  remat = checkpoint = staticmethod(remat_lib.checkpoint)

  def __getattr__(self, name):
    return getattr(jax, name)


_PATCHES = (
  (hk_layer_stack, _JaxForLayerStack()),
  (hk_stateful, _JaxForRemat()),
)
_patch_lock = threading.Lock()
_patch_depth = 0


class _immediate_transforms:  # pylint: disable=invalid-name
  """Context manager: Haiku's layer_stack and remat use immgrad's versions.

  Process-wide while any model runs here (threads included), which is
  harmless: ``immgrad.scan`` and ``immgrad.checkpoint`` are JAX's own
  unless the calling thread is inside ``immgrad.value_and_grad``.
  """

  def __enter__(self):
    global _patch_depth
    with _patch_lock:
      if _patch_depth == 0:
        for haiku_module, ours in _PATCHES:
          haiku_module.jax = ours
      _patch_depth += 1

  def __exit__(self, *exc):
    global _patch_depth
    with _patch_lock:
      _patch_depth -= 1
      if _patch_depth == 0:
        for haiku_module, _ in _PATCHES:
          haiku_module.jax = jax
