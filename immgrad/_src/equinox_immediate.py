"""``immgrad.equinox.immediate``: unmodified Equinox models, immediate.

``immediate(fn, modules)`` is :func:`immgrad.immediate` (``auto.py``) with
one piece of Equinox knowledge: which parameter leaves it may step. Inside
``immgrad.value_and_grad`` it finds, among all of ``fn``'s arguments, the
parameter leaves of the step whose innermost ``eqx.Module`` is one of
``modules`` (by default ``eqx.nn.Linear``, ``eqx.nn.Conv*``,
``eqx.nn.LayerNorm``, ``eqx.nn.RMSNorm``, ``eqx.nn.Embedding``, so
``self.weight`` of each, inside ``eqx.nn.MLP`` or
``eqx.nn.MultiheadAttention`` too), and hands those to
:func:`immgrad.immediate` as the parameter tree. Every other leaf is an
argument like the data: it keeps an ordinary gradient, which the shim
applies. Equinox's own ``__call__`` runs unchanged; the program it traces
says where the layers are, so subclasses, wrappers that compute the weight
(``eqx.nn.WeightNorm``) and vmapped or scanned weights need nothing here.
"""

import functools
from typing import Any, Callable, Sequence

import equinox as eqx
import jax

from immgrad._src import auto
from immgrad._src import context

_NAME = "immgrad.equinox.immediate"
_NO_PARAMETERS = (
  "immgrad.equinox.immediate: {fn} was called in a step with none of the "
  "step's parameters among its arguments. Parameters it closes over would "
  "train ordinarily: pass them to it (as the loss gets them)."
)

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
  """Makes the weights of the chosen Equinox modules in ``fn`` immediate.

  Args:
    fn: a function that calls an Equinox model, with its parameters among
      its arguments (anywhere, keyword arguments too): usually the loss
      given to ``immgrad.value_and_grad``. The model is per-example and
      called under ``jax.vmap`` (or ``eqx.filter_vmap``) inside ``fn``, as
      usual; call ``fn`` itself at the top level of the loss.
    modules: the ``eqx.Module`` classes (subclasses included) whose own
      arrays are stepped in the backward pass, where the traced program
      allows it (see :func:`immgrad.layers`). Default: ``eqx.nn.Linear``,
      ``eqx.nn.Conv`` (``Conv1d``/``2d``/``3d``), ``eqx.nn.LayerNorm``,
      ``eqx.nn.RMSNorm``, ``eqx.nn.Embedding``. ``(eqx.Module,)`` chooses
      every module's arrays.

  Returns:
    ``fn``, with those weights updated during the backward pass inside
    ``immgrad.value_and_grad``. Outside it, ``fn`` itself.

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
    step = context.current()
    if step is None:
      return fn(*args, **kwargs)
    keyed, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    found = [step.find(leaf, _NAME) is not None for _, leaf in keyed]
    if not any(found):
      raise ValueError(_NO_PARAMETERS.format(fn=_name(fn)))
    owned = _owned(chosen, (args, kwargs))
    # Named by their place in fn's arguments, for immgrad.immediate's errors.
    names = [
      _place(path) if f and o else None
      for (path, _), f, o in zip(keyed, found, owned)
    ]
    params = {n: leaf for n, (_, leaf) in zip(names, keyed) if n}
    others = [leaf for n, (_, leaf) in zip(names, keyed) if not n]

    def call(params, others):
      others = iter(others)
      full = [params[n] if n else next(others) for n in names]
      args, kwargs = treedef.unflatten(full)
      return fn(*args, **kwargs)

    return auto.immediate(call)(params, others)

  return wrapped


def _place(path) -> str:
  """``args[0].layers[1].weight``: where a leaf is among fn's arguments."""
  return ("args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:])


def _name(fn) -> str:
  return getattr(fn, "__qualname__", repr(fn))


def _check_modules(modules) -> tuple[type, ...]:
  if isinstance(modules, type):
    modules = (modules,)
  for cls in modules:
    if not (isinstance(cls, type) and issubclass(cls, eqx.Module)):
      raise TypeError(
        "immgrad.equinox.immediate: modules= takes eqx.Module classes "
        f"(such as eqx.nn.Linear, or eqx.Module for all), got {cls!r}."
      )
  return tuple(modules)


def _owned(chosen: tuple[type, ...], tree: Any) -> list[bool]:
  """For each leaf of ``tree``: is its innermost ``eqx.Module`` chosen?"""

  def visit(node, owned: bool) -> list[bool]:
    if isinstance(node, eqx.Module):
      owned = isinstance(node, chosen)
    children, shape = jax.tree.flatten(node, is_leaf=lambda x: x is not node)
    if jax.tree_util.treedef_is_leaf(shape):
      return [owned] * len(children)
    return [flag for child in children for flag in visit(child, owned)]

  return visit(tree, False)
