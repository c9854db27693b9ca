"""``immgrad.flax.immediate``: unmodified Flax models (NNX and Linen).

``immediate(fn)`` runs ``fn`` with two interceptions in place; inside
``immgrad.value_and_grad`` each call of a chosen Flax module (by default
NNX's ``Linear``, ``LinearGeneral``, ``Einsum``, ``Conv``, ``LayerNorm``,
``RMSNorm``, ``Embed`` and Linen's ``Dense``, ``DenseGeneral``, ``Conv``,
``LayerNorm``, ``RMSNorm``, ``Embed``, including those inside
``nnx.MultiHeadAttention`` or your own modules) is computed by
``flax_layers``: the module's own parameter arrays, through an immediate
layer. Other modules (``BatchNorm``, whose statistics are not parameters,
transposed or local convolutions, your own) keep ordinary gradients, which
the shim applies. Outside a step every module runs Flax's code unchanged.

* Linen: ``nn.intercept_methods``, Linen's public seam (thread-local). Its
  context names the method, not the class that defines it, so a call is
  matched by the undecorated function (``nn.Dense.__call__.__wrapped__``):
  a subclass whose ``__call__`` calls ``super().__call__`` is reached at
  the base, as with Haiku's ``orig_class``. ``init`` is never intercepted.
* NNX has no interception seam, so, as ``nnx.capture`` does, we replace
  ``__call__`` on the classes that define it, while a wrapped ``fn`` runs
  in any thread (a lock and a depth count install and remove it). The
  replacement does its work only on the threads that are inside a wrapped
  ``fn``; elsewhere it calls the original at once.

The modules read their parameters as the objects in the params tree (NNX's
``variable[...]`` and Linen's ``get_variable``), which is how an immediate
layer finds their optimizer state. A module whose weights are
reparametrised is refused by name (``reparam.py``): a Linen subclass
overriding a method of its Flax class (BiT's ``StdConv`` overrides
``param()``), a weight computed from the params (``nn.WeightNorm``,
``nnx.SpectralNorm``, ``nn.map_variables``, a property), or a Linen
interceptor installed inside ``immediate``, which ours would skip (found in
Linen's private ``_global_interceptor_stack``). See
``docs/reparametrised.md``.
"""

import functools
import threading
from typing import Any, Callable, Sequence

from flax import linen as nn
from flax.linen import module as linen_module

from immgrad._src import context
from immgrad._src import flax_layers
from immgrad._src import reparam

_ADAPTER = "immgrad.flax.immediate"

DEFAULT_MODULES = tuple(flax_layers.NNX) + flax_layers.LINEN_CLASSES


def immediate(
  fn: Callable[..., Any], modules: Sequence[type] = DEFAULT_MODULES
) -> Callable[..., Any]:
  """Makes the chosen Flax modules called in ``fn`` immediate layers.

  Args:
    fn: a loss (or forward) function that calls Flax modules: an NNX model
      (``nnx.merge(graphdef, params)(x)``) or a Linen ``model.apply``.
    modules: the module classes to make immediate (subclasses included):
      any of :data:`DEFAULT_MODULES` (the default: all of them).

  Returns:
    ``fn``, with those modules' weights updated during the backward pass
    inside ``immgrad.value_and_grad``. Outside it, ``fn`` is unchanged.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import immgrad, immgrad.flax
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> graphdef, params = nnx.split(model, nnx.Param)
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)
    >>> tx = immgrad.shim(optax.adam(1e-3))
    >>> opt_state = tx.init(params)
    >>> step = jax.jit(immgrad.value_and_grad(immgrad.flax.immediate(loss_fn),
    ...                                       tx))
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> loss, grads = step(params, opt_state, x, y)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["kernel"].shape
    (3, 1)

    Linen, through ``model.apply``:

    >>> from flax import linen as nn
    >>> model = nn.Dense(1)
    >>> params = model.init(jax.random.PRNGKey(0), x)["params"]
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((model.apply({"params": params}, x) - y) ** 2)
    >>> step = immgrad.value_and_grad(immgrad.flax.immediate(loss_fn), tx)
    >>> loss, grads = step(params, tx.init(params), x, y)
    >>> type(grads["kernel"]).__name__
    'ImmediateGrad'
  """
  if not callable(fn):
    raise TypeError(
      f"immgrad.flax.immediate expects a function that calls Flax "
      f"modules, got {fn!r}."
    )
  chosen = _check_modules(modules)

  def interceptor(next_fun, args, kwargs, ctx):
    if context.current() is None:
      return next_fun(*args, **kwargs)
    implementation = flax_layers.LINEN.get(
      getattr(ctx.orig_method, "func", None)
    )
    if (
      implementation is None
      or not isinstance(ctx.module, chosen)
      or ctx.module.is_initializing()
    ):
      return next_fun(*args, **kwargs)
    _check_linen_call(ctx.module, interceptor)
    return implementation(ctx.module, next_fun, *args, **kwargs)

  interceptor.immgrad = True  # Ours: see _check_linen_call.

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with nn.intercept_methods(interceptor), _nnx_calls(chosen):
      return fn(*args, **kwargs)

  return wrapped


def _check_linen_call(module: nn.Module, ours: Callable) -> None:
  """Refuses a Linen call whose arithmetic ours would not reproduce.

  That is a subclass overriding a method of the Flax class (BiT's
  ``StdConv`` overrides ``param()``), or an interceptor installed inside
  ``immediate``: Linen runs interceptors outermost first, so ours would
  answer the call and skip it. (The interceptor stack is Linen's private
  ``_global_interceptor_stack``, innermost first.)
  """
  base, base_name = flax_layers.base_class(module)
  reparam.check_overrides(_ADAPTER, module, base, base_name)
  for interceptor in linen_module._global_interceptor_stack:
    if interceptor is ours:
      return
    if not getattr(interceptor, "immgrad", False):
      raise ValueError(
        f"{_ADAPTER}: the Linen interceptor {interceptor!r}, installed "
        f"inside it, would be skipped for {base_name} "
        f"{flax_layers.linen_name(module)!r}, whose call immgrad computes "
        "itself. Install it outside instead (nn.intercept_methods around "
        "the call of the wrapped function), so that it runs first, or "
        f"leave {base_name} out of `modules=`."
      )


def _check_modules(modules) -> tuple[type, ...]:
  if isinstance(modules, type):
    modules = (modules,)
  names = ", ".join(
    f"{'nnx' if c in flax_layers.NNX else 'nn'}.{c.__name__}"
    for c in DEFAULT_MODULES
  )
  for cls in modules:
    if not (isinstance(cls, type) and issubclass(cls, DEFAULT_MODULES)):
      raise ValueError(
        f"immgrad.flax.immediate: cannot make {cls!r} immediate. Supported "
        f"modules (and their subclasses): {names}. Other modules, such as "
        "BatchNorm (its statistics are not parameters) or your own, keep "
        "ordinary gradients: build custom ones from these, or from "
        "immgrad.immediate_layer."
      )
  return tuple(modules)


_local = threading.local()  # .chosen: this thread's modules, or None.
_patch_lock = threading.Lock()
_patch_depth = 0


def _patched(cls: type, original: Callable) -> Callable:
  """``cls.__call__`` that routes a chosen module's call in a step to ours."""
  implementation = flax_layers.NNX[cls]

  @functools.wraps(original)
  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    if context.current() is None:
      return original(self, *args, **kwargs)
    chosen = getattr(_local, "chosen", None)
    if chosen is None or not isinstance(self, chosen):
      return original(self, *args, **kwargs)
    return implementation(
      self, functools.partial(original, self), *args, **kwargs
    )

  __call__.immgrad_original = original
  return __call__


class _nnx_calls:  # pylint: disable=invalid-name
  """Context manager: NNX modules' calls on this thread go to ``chosen``'s.

  The class patch is process-wide while any thread is inside, which is
  harmless: on other threads it calls the original.
  """

  def __init__(self, chosen: tuple[type, ...]):
    self._chosen = chosen
    self._outer = None

  def __enter__(self):
    global _patch_depth
    with _patch_lock:
      if _patch_depth == 0:
        for cls in flax_layers.NNX:
          type.__setattr__(
            cls, "__call__", _patched(cls, cls.__dict__["__call__"])
          )
      _patch_depth += 1
    self._outer = getattr(_local, "chosen", None)
    _local.chosen = self._chosen

  def __exit__(self, *exc):
    global _patch_depth
    _local.chosen = self._outer
    with _patch_lock:
      _patch_depth -= 1
      if _patch_depth == 0:
        for cls in flax_layers.NNX:
          type.__setattr__(cls, "__call__", cls.__call__.immgrad_original)
