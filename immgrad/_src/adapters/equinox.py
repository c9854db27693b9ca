"""``immgrad.equinox.immediate``: unmodified Equinox models, immediate.

:func:`immgrad.immediate` over the step's parameter leaves among ``fn``'s
arguments; ``modules=`` keeps those whose innermost ``eqx.Module`` (found by
walking the pytree) is one of the given classes.
"""

from typing import Any, Callable, Sequence

import equinox as eqx
import jax

from immgrad._src.adapters import common

_NAME = "immgrad.equinox.immediate"

DEFAULT_MODULES = (
  eqx.nn.Linear,
  eqx.nn.Conv,
  eqx.nn.LayerNorm,
  eqx.nn.RMSNorm,
  eqx.nn.Embedding,
)


def immediate(
  fn: Callable[..., Any],
  modules: Sequence[type] | None = None,
  *,
  strict: bool = False,
) -> Callable[..., Any]:
  """Makes the parameters of the Equinox model in ``fn`` immediate.

  Args:
    fn: a function that calls an Equinox model, with its parameters among
      its arguments (anywhere, keyword arguments too): usually the loss
      given to ``immgrad.value_and_grad``. The model is per-example and
      called under ``jax.vmap`` (or ``eqx.filter_vmap``) inside ``fn``, as
      usual; call ``fn`` itself at the top level of the loss.
    modules: None (the default): every parameter leaf among ``fn``'s arguments,
      as :func:`immgrad.immediate` takes them; what still trains ordinarily (a
      tied weight, a recurrent cell's weights) is reported. A tuple of
      ``eqx.Module`` classes (subclasses included): only the arrays those
      modules hold themselves; it replaces the default, so ``DEFAULT_MODULES +
      (MyModule,)`` is Equinox's weight-carrying modules (``eqx.nn.Linear``,
      ``eqx.nn.Conv``, ``eqx.nn.LayerNorm``, ``eqx.nn.RMSNorm``,
      ``eqx.nn.Embedding``) and yours.
    strict: raise ``ValueError`` where an :class:`immgrad.OrdinaryWarning`
      would be issued (a parameter this function was asked to step that
      trains ordinarily: tied, read outside its layer, reused by a loop).

  Returns:
    ``fn``, with those parameters updated during the backward pass inside
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

    Only the linear layers' arrays (a tuple replaces the default, every
    parameter):

    >>> def linear_loss(params, x, y):
    ...   model = eqx.combine(params, static)
    ...   return jnp.mean((jax.vmap(model)(x) - y) ** 2)
    >>> linear_only = immgrad.equinox.immediate(
    ...     linear_loss, modules=(eqx.nn.Linear,))
  """
  common.check_callable(fn, _NAME, "a function")
  chosen = common.check_modules(
    modules, (eqx.Module,), _NAME, "eqx.Module", "(eqx.nn.Linear,)"
  )

  if chosen is None:
    return common.wrap(fn, _NAME, strict)

  def owned(tree, keyed, treedef, found):
    del keyed, treedef
    return [f and o for f, o in zip(found, _owned(chosen, tree))]

  return common.wrap(fn, _NAME, strict, owned)


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
