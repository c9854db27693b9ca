"""``immgrad.equinox.immediate``: unmodified Equinox models, immediate.

``immediate(fn)`` runs ``fn`` with the ``__call__`` of Equinox's
weight-carrying modules routed to ``equinox_layers``: inside
``immgrad.value_and_grad``, every call of an ``eqx.nn.Linear``,
``eqx.nn.Conv`` (``Conv1d``/``2d``/``3d``), ``eqx.nn.LayerNorm``,
``eqx.nn.RMSNorm`` or ``eqx.nn.Embedding`` (including those inside
``eqx.nn.MLP`` and ``eqx.nn.MultiheadAttention``) is computed from the same
parameter arrays through an immediate layer. Other modules
(``eqx.nn.ConvTranspose``, ``eqx.nn.BatchNorm``, whose statistics are
``eqx.nn.State``, dropout, your own) keep ordinary gradients, which the
shim applies. The params tree is Equinox's own,
``eqx.partition(model, eqx.is_inexact_array)``. A module whose weight is
computed from the params (``eqx.nn.WeightNorm``, ``eqx.nn.SpectralNorm``, a
cast) is refused by name (``reparam.py``, ``docs/reparametrised.md``).

The seam. Equinox has no interception hook, so while a wrapped ``fn`` runs
the defining classes' ``__call__`` is replaced, at class level, by a
dispatcher (Flax NNX's ``nnx.capture`` patches classes the same way). It
is held by a lock and a depth count while any thread runs a wrapped
``fn``; the dispatcher calls the original unless the calling thread is
itself inside ``immediate`` and inside ``immgrad.value_and_grad``. So
outside a step, and for every other thread, the model is Equinox's, and
``tests/test_equinox.py`` pins that the defining classes are these.
"""

import functools
import threading
from typing import Any, Callable, Sequence

import equinox as eqx

from immgrad._src import context
from immgrad._src import equinox_layers

DEFAULT_MODULES = (
  eqx.nn.Linear,
  eqx.nn.Conv,
  eqx.nn.LayerNorm,
  eqx.nn.RMSNorm,
  eqx.nn.Embedding,
)


def immediate(
  fn: Callable[..., Any], modules: Sequence[type] = DEFAULT_MODULES
) -> Callable[..., Any]:
  """Makes the chosen Equinox modules called in ``fn`` immediate layers.

  Args:
    fn: a function that calls an Equinox model: the loss given to
      ``immgrad.value_and_grad`` or the model's forward pass. The model is
      per-example and called under ``jax.vmap`` as usual (or
      ``eqx.filter_vmap``); its parameters must be unmapped (closed over,
      or ``in_axes=None``), and each layer steps once, on the gradient of
      the whole batch.
    modules: the module classes to make immediate (subclasses included):
      any of ``eqx.nn.Linear``, ``eqx.nn.Conv`` (or ``Conv1d``/``2d``/
      ``3d``), ``eqx.nn.LayerNorm``, ``eqx.nn.RMSNorm``,
      ``eqx.nn.Embedding``. Default: all of them.

  Returns:
    ``fn``, with those modules' weights updated during the backward pass
    inside ``immgrad.value_and_grad``. Outside it ``fn`` is unchanged.

  Example:
    >>> import equinox as eqx, jax, jax.numpy as jnp, optax
    >>> import immgrad, immgrad.equinox
    >>> model = eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(0))
    >>> params, static = eqx.partition(model, eqx.is_inexact_array)
    >>> @immgrad.equinox.immediate
    ... def loss_fn(params, x, y):
    ...   model = eqx.combine(params, static)
    ...   return jnp.mean((jax.vmap(model)(x) - y) ** 2)
    >>> tx = immgrad.shim(optax.adam(1e-3))
    >>> opt_state = tx.init(params)
    >>> @eqx.filter_jit
    ... def train_step(params, opt_state, x, y):
    ...   loss, grads = immgrad.value_and_grad(loss_fn, tx)(
    ...       params, opt_state, x, y)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, loss
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> params, opt_state, loss = train_step(params, opt_state, x, y)
  """
  if not callable(fn):
    raise TypeError(
      f"immgrad.equinox.immediate expects a function, got {fn!r}."
    )
  chosen = _check_modules(modules)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with _patched(chosen):
      return fn(*args, **kwargs)

  return wrapped


def _check_modules(modules) -> tuple[type, ...]:
  if isinstance(modules, type):
    modules = (modules,)
  supported = tuple(equinox_layers.IMPLEMENTATIONS)
  names = ", ".join(f"eqx.nn.{c.__name__}" for c in supported)
  for cls in modules:
    if not (isinstance(cls, type) and issubclass(cls, supported)):
      raise ValueError(
        f"immgrad.equinox.immediate: cannot make {cls!r} immediate. "
        f"Supported modules (and their subclasses): {names}. Other "
        "modules, such as eqx.nn.ConvTranspose, eqx.nn.BatchNorm (its "
        "statistics are eqx.nn.State, not weights) or your own, keep "
        "ordinary gradients: build custom ones from these, or from "
        "immgrad.immediate_layer."
      )
  return tuple(modules)


def _dispatcher(cls: type, original: Callable) -> Callable:
  """``cls.__call__`` that routes chosen modules' calls in a step to us."""
  implementation = equinox_layers.IMPLEMENTATIONS[cls]

  @functools.wraps(original)
  def __call__(self, *args, **kwargs):  # pylint: disable=invalid-name
    chosen = _chosen()
    if (
      chosen is None
      or not isinstance(self, chosen)
      or context.current() is None
    ):
      return original(self, *args, **kwargs)
    bound = functools.partial(original, self)
    return implementation(self, bound, *args, **kwargs)

  return __call__


_local = threading.local()  # This thread's stack of chosen modules.
_lock = threading.Lock()
_depth = 0  # How many wrapped functions run now, in all threads.
_originals = {}  # Each patched class's own __call__, while patched.


def _chosen():
  stack = getattr(_local, "stack", None)
  return stack[-1] if stack else None


class _patched:  # pylint: disable=invalid-name
  """Context manager: this thread's calls of ``chosen`` modules are ours."""

  def __init__(self, chosen: tuple[type, ...]):
    self._chosen = chosen

  def __enter__(self):
    global _depth
    with _lock:
      if _depth == 0:
        for cls in equinox_layers.IMPLEMENTATIONS:
          _originals[cls] = cls.__dict__["__call__"]
          cls.__call__ = _dispatcher(cls, _originals[cls])
      _depth += 1
    if not hasattr(_local, "stack"):
      _local.stack = []
    _local.stack.append(self._chosen)

  def __exit__(self, *exc):
    global _depth
    _local.stack.pop()
    with _lock:
      _depth -= 1
      if _depth == 0:
        for cls, original in _originals.items():
          cls.__call__ = original
        _originals.clear()
