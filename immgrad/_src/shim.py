"""``shim``: the optax optimizer that applies what immediate layers computed.

The shim keeps one optimizer state per parameter leaf (``tx.init`` of that
leaf alone), because an immediate layer steps its own leaves during the
backward pass, long before the other gradients exist. ``update`` takes the
tree that ``immgrad.value_and_grad`` returns: a leaf that is a
:class:`Stepped` already holds its new weights and state (an immediate layer
stepped it, or the step did not touch it); any other leaf is an ordinary
gradient and gets ``tx``'s normal update.

So ``tx`` must act on each parameter on its own. ``shim`` checks this once,
by running ``tx`` on a small probe tree whole and leaf by leaf, and rejects
a transformation that needs the whole tree (``clip_by_global_norm``,
``MultiSteps``, ``apply_if_finite``) with an error instead of letting it
silently do something else.
"""

from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax


class ShimState(NamedTuple):
  """State of :func:`shim`.

  Attributes:
    inner: the params tree with each leaf replaced by that leaf's own
      ``tx`` state (``tx.init(leaf)``).
  """
  inner: Any


class Stepped(NamedTuple):
  """A leaf of the tree from ``immgrad.value_and_grad`` that is already done.

  Attributes:
    params: the parameter's new value.
    state: the parameter's new ``tx`` state.
  """
  params: chex.Array
  state: Any


class ShimTransformation(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that also knows its inner ``tx``."""

  @property
  def inner(self) -> optax.GradientTransformation:
    """The per-parameter rule that immediate layers apply."""
    return self._inner


_NOT_SEPARABLE = (
    "immgrad.shim({name}): this transformation does not act on each "
    "parameter separately ({why}). Immediate layers step each layer as soon "
    "as its gradient exists, before the other gradients do, so a rule that "
    "needs the whole gradient tree (clip_by_global_norm, MultiSteps, "
    "apply_if_finite, ...) cannot run there. Use a per-parameter rule "
    "instead, e.g. optax.clip or optax.clip_by_block_rms for clipping.")

_WHOLE_TREE_STATES = (optax.MultiStepsState, optax.ApplyIfFiniteState)


def _name(tx: optax.GradientTransformation) -> str:
  init = getattr(tx.init, "__qualname__", "")
  return init.split(".<locals>")[0] if init else repr(tx)


def _check_separable(tx: optax.GradientTransformation) -> None:
  """Raises unless ``tx`` on a probe tree equals ``tx`` leaf by leaf."""
  name = _name(tx)
  probe = {"a": jnp.linspace(-1.0, 2.0, 12).reshape(4, 3),
           "b": jnp.linspace(0.5, -3.0, 5)}
  grads = [jax.tree.map(lambda p, k=k: 100.0 * (k + 1) * jnp.cos(p + k), probe)
           for k in range(3)]
  with jax.ensure_compile_time_eval():
    try:
      whole_state = tx.init(probe)
      leaf_states = {k: tx.init(v) for k, v in probe.items()}
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(_NOT_SEPARABLE.format(
          name=name, why=f"its init fails on a single array: {e}")) from e
    found = [type(s).__name__ for s in jax.tree.leaves(
        whole_state, is_leaf=lambda s: isinstance(s, _WHOLE_TREE_STATES))
             if isinstance(s, _WHOLE_TREE_STATES)]
    if found:
      raise ValueError(_NOT_SEPARABLE.format(
          name=name, why=f"its state holds a {found[0]}"))
    params = probe
    for g in grads:
      try:
        whole, whole_state = tx.update(g, whole_state, params)
        leaf = {}
        for k in probe:
          leaf[k], leaf_states[k] = tx.update(g[k], leaf_states[k], params[k])
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(_NOT_SEPARABLE.format(
            name=name, why=f"its update fails on a single array: {e}")) from e
      for k in probe:
        if not np.allclose(whole[k], leaf[k], rtol=1e-5, atol=1e-7):
          raise ValueError(_NOT_SEPARABLE.format(
              name=name, why="applied to each parameter alone it gives "
              "different updates than applied to the whole tree"))
      params = optax.apply_updates(params, whole)


def _init_leaf(tx, path, leaf):
  dtype = jnp.result_type(leaf)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"immgrad.shim: parameter {jax.tree_util.keystr(path)} has dtype "
        f"{dtype}; parameters must be real floating point arrays (keep "
        "integer or complex values out of the params tree).")
  return tx.init(leaf)


def shim(tx: optax.GradientTransformation) -> ShimTransformation:
  """The optimizer to use with immediate layers, in place of ``tx``.

  ``init(params)`` gives every parameter its own ``tx`` state.
  ``update(grads, state, params)`` takes the tree from
  ``immgrad.value_and_grad``: leaves an immediate layer already stepped
  (:class:`Stepped`) come back as the updates that land on their new
  values, with their new state; every other leaf gets ``tx``'s own update.
  Plain gradients (from ``jax.grad``) train exactly as ``tx`` would.

  Exactness: the update for an immediate weight is ``new - p``, so
  ``optax.apply_updates`` computes ``p + (new - p)``. That is bitwise
  ``new`` whenever any float update reaches ``new`` from ``p`` (always when
  ``new / p`` lies in ``[1/2, 2]``, by Sterbenz's lemma, and whenever the
  step rounded ``p + u`` as one float addition). When XLA fused the
  optimizer's arithmetic (an FMA, say) ``new`` can fall between the values
  reachable from ``p``; it then lands within one ulp of
  ``max(|p|, |new|)`` of ``new``, and no other update would do better.

  Args:
    tx: an optax transformation that acts on each parameter separately
      (sgd, momentum, adam, adamw, lion, rmsprop, adafactor, schedules,
      ``optax.inject_hyperparams``, chains of these).

  Returns:
    An ``optax.GradientTransformation``; pass it to
    ``immgrad.value_and_grad`` too.

  Raises:
    ValueError: if ``tx`` needs the whole gradient tree.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> tx = immgrad.shim(optax.sgd(0.1))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([0.8, 0.8], dtype=float32)
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
        f"immgrad.shim expects an optax.GradientTransformation, got {tx!r}.")
  _check_separable(tx)

  def init_fn(params):
    return ShimState(inner=jax.tree_util.tree_map_with_path(
        lambda path, leaf: _init_leaf(tx, path, leaf), params))

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError(
          "immgrad.shim: update needs params: call "
          "tx.update(grads, opt_state, params).")
    treedef = jax.tree.structure(params)
    leaves = treedef.flatten_up_to(params)
    updates, states = [], []
    for g, s, p in zip(flatten_like(treedef, grads, "grads"),
                       flatten_like(treedef, state_of(state), "opt_state"),
                       leaves):
      if isinstance(g, Stepped):
        updates.append(g.params - p)
        states.append(g.state)
      else:
        u, s = tx.update(g, s, p)
        updates.append(u)
        states.append(s)
    return (treedef.unflatten(updates),
            ShimState(inner=treedef.unflatten(states)))

  result = ShimTransformation(init_fn, update_fn)
  result._inner = tx  # pylint: disable=protected-access
  return result


def state_of(state: Any) -> Any:
  """``state.inner``, or a clear error if ``state`` is not a ShimState."""
  if not isinstance(state, ShimState):
    raise TypeError(
        f"immgrad: expected the optimizer state from immgrad.shim(tx).init, "
        f"got {type(state).__name__}. Initialise it with the shim, not with "
        "the inner optax transformation.")
  return state.inner


def flatten_like(treedef, tree: Any, what: str) -> list:
  """Flattens ``tree`` up to the params structure, or a clear error."""
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"immgrad: {what} does not match the params tree ({e}). Was it made "
        "for these params (same model, same immgrad.shim)?") from e
