"""``shim``: the optax optimizer that commits what immediate layers computed.

Its state is ``tx``'s own, in optax's layout. Each parameter is stepped by
its own program, cut out of ``tx.update`` (``plan.py``), so that each step is
the one plain optax takes; a ``tx`` that mixes parameters is refused
(``plan.cut``).
"""

from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax

from immgrad._src import commit as commit_lib
from immgrad._src import plan as plan_lib
from immgrad._src.base import ImmediateGrad
from immgrad._src.base import ShimState
from immgrad._src.base import ShimTransformation
from immgrad._src.base import Stepped


def _check_params(params: Any) -> None:
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
        f"immgrad.shim: parameter {jax.tree_util.keystr(path)} has dtype "
        f"{dtype}; parameters must be real floating point arrays (keep "
        "integer or complex values out of the params tree)."
      )


def shim(
  tx: optax.GradientTransformation, *, atomic: bool = True
) -> ShimTransformation:
  """The optimizer to use with immediate layers, in place of ``tx``.

  ``init(params)`` is ``tx.init(params)`` (as a :class:`ShimState`).
  ``update(grads, state, params)`` takes the tree from
  ``immgrad.value_and_grad`` and commits the step: a parameter an
  immediate layer stepped (:class:`ImmediateGrad`) gets the new weights and
  state its layer computed, a :class:`Stepped` leaf the value it holds,
  and every other leaf ``tx``'s own update. Plain gradients (from
  ``jax.grad``) train exactly as ``tx`` would. Each parameter's step is
  the one ``tx.update`` takes on the whole tree, so options shaped like
  the params (``optax.adamw(lr, mask=tree)``, ``optax.multi_transform``
  labels), path-aware callables and PRNG state (``noisy_sgd``) work as in
  plain optax.

  Atomic steps: by the time the backward pass meets a non-finite gradient,
  the layers after it have already computed their new weights. With
  ``atomic=True`` (the default) every gradient, new weight and new
  optimizer state of the step is checked (an immediate layer's in its
  backward rule, an ordinary parameter's here); if any is NaN or infinite
  the whole step is rejected: every update is ``-0.0`` (so every weight,
  ``-0.0`` included, stays bit for bit as it was), every state keeps its
  old value, and ``state.rejected`` counts the step. The commit is gated
  on that check (a select on a TPU or GPU, a ``lax.cond`` per parameter on
  the CPU), so a clean step updates the weights and state in place; what the check keeps alive is the step's gradients (as
  ``optax.apply_if_finite`` does), not a second copy of the weights and
  state. ``atomic=False`` leaves a non-finite step half applied.

  Exactness: an immediate parameter's new weights are computed here by the
  same function, on the same gradient, state and weights, as in its
  layer's backward rule. Its update is ``new - p``, so
  ``optax.apply_updates`` computes ``p + (new - p)``: bitwise ``new``
  whenever any float update reaches ``new`` from ``p`` (always when
  ``new / p`` lies in ``[1/2, 2]``, by Sterbenz's lemma, and whenever the
  step rounded ``p + u`` as one float addition). When XLA fused the
  optimizer's arithmetic (an FMA, say) ``new`` can fall between the values
  reachable from ``p``; it then lands within one ulp of
  ``max(|p|, |new|)`` of ``new``, and no other update would do better.

  Args:
    tx: an optax transformation that acts on each parameter separately
      (sgd, momentum, adam, adamw, lion, rmsprop, adafactor, schedules,
      ``optax.inject_hyperparams``, masks, ``multi_transform``,
      ``optax.MultiSteps`` for gradient accumulation, chains of these:
      docs/optimizer.md's catalogue lists every optax rule). An optimizer
      object with optax's ``init`` and ``update`` methods, such as
      ``optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)``, is
      taken as it is.
    atomic: reject a step with any non-finite value, whole (see above).

  Returns:
    An ``optax.GradientTransformation``; pass it to
    ``immgrad.value_and_grad`` too.

  Raises:
    TypeError: if ``tx`` has no ``init`` and ``update``.
    ValueError: if ``tx`` needs the whole gradient tree (here, if a probe
      tree shows it; else at ``init``, on the real params).

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
  tx = _as_transformation(tx)
  plan_lib.check(tx)

  def init_fn(params):
    _check_params(params)
    plan_lib.cut(tx, params)
    return ShimState(inner=tx.init(params), rejected=jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
        "immgrad.shim: update needs params: call "
        "tx.update(grads, opt_state, params)."
      )
    keyed, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(path) for path, _ in keyed]
    grads = flatten_like(treedef, updates, "grads")
    for path, g, (_, p) in zip(paths, grads, keyed):
      _check_like(path, _value_of(g), p)
    plan = plan_lib.cut(tx, params)
    step = commit_lib.Commit(tx, params, plan, paths, grads)
    updates, new, ok = step.commit(state_leaves(plan, state), atomic)
    rejected = state.rejected
    if ok is not None:
      rejected = rejected + jnp.where(ok, 0, 1).astype(rejected.dtype)
    return (
      treedef.unflatten(updates),
      ShimState(inner=plan.state_def.unflatten(new), rejected=rejected),
    )

  return ShimTransformation(init_fn, update_fn, inner=tx, atomic=atomic)


def _as_transformation(tx: Any) -> optax.GradientTransformation:
  """``tx``, or an optimizer object with optax's ``init`` and ``update``
  (``optax.MultiSteps``) as the transformation it is.
  """
  if isinstance(tx, optax.GradientTransformation):
    return tx
  if callable(getattr(tx, "init", None)) and callable(
    getattr(tx, "update", None)
  ):
    return optax.GradientTransformation(tx.init, tx.update)
  raise TypeError(
    "immgrad.shim expects an optax.GradientTransformation (or an optimizer "
    f"with optax's init and update methods, like optax.MultiSteps), got {tx!r}."
  )


def _value_of(g) -> chex.Array:
  if isinstance(g, ImmediateGrad):
    return g.grad
  if isinstance(g, Stepped):
    return g.params
  return g


def _check_like(path: str, value, param) -> None:
  """A clear error if a gradient or new value does not fit its parameter."""
  got = (jnp.shape(value), jnp.result_type(value))
  want = (jnp.shape(param), jnp.result_type(param))
  if got != want:
    raise ValueError(
      f"immgrad.shim: the gradient or new value for parameter "
      f"{path} is {got[1]}{list(got[0])}, but the "
      f"parameter is {want[1]}{list(want[0])}. Did the params change "
      "shape between value_and_grad and update?"
    )


def state_of(state: Any) -> Any:
  """``state.inner``, or a clear error if ``state`` is not a ShimState."""
  if not isinstance(state, ShimState):
    raise TypeError(
      f"immgrad: expected the optimizer state from immgrad.shim(tx).init, "
      f"got {type(state).__name__}. Initialise it with the shim, not with "
      "the inner optax transformation."
    )
  return state.inner


def shim_state_from_optax(opt_state: Any) -> ShimState:
  """The shim's state holding ``opt_state``, a plain optax state of ``tx``.

  The shim keeps ``tx``'s state in optax's own layout, so this wraps it
  bit for bit: a run trained with plain optax continues with immgrad from
  where it stopped (``rejected`` starts at 0).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> params = {"w": jnp.ones(3)}
    >>> opt_state = optax.adam(1e-3).init(params)  # ... trained plainly.
    >>> state = immgrad.shim_state_from_optax(opt_state)
    >>> tx = immgrad.shim(optax.adam(1e-3))  # Continue with immgrad.
    >>> _ = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
  """
  if isinstance(opt_state, ShimState):
    raise TypeError(
      "immgrad.shim_state_from_optax: opt_state is already a ShimState."
    )
  return ShimState(inner=opt_state, rejected=jnp.zeros((), jnp.int32))


def shim_state_to_optax(state: ShimState) -> Any:
  """The plain optax state inside the shim's ``state``, bit for bit.

  Continue with ``tx`` itself (``jax.grad`` + ``tx.update``) where immgrad
  stopped. The count of rejected steps is dropped.
  """
  return state_of(state)


def state_leaves(plan: plan_lib.Plan, state: Any) -> list:
  """The leaves of ``state.inner``, or a clear error if not ``plan``'s.

  Compared leaf by leaf (count, order, shape, dtype), not by tree
  structure: a library that keeps each leaf of the state in a box of its
  own (Flax's ``nnx.Optimizer`` wraps each in an ``nnx.OptState``, the
  params in ``nnx.Param``) hands it in as it holds it.
  """
  inner = state_of(state)
  keyed = jax.tree_util.tree_flatten_with_path(inner)[0]
  if len(keyed) != len(plan.state_avals):
    why = (
      f"it has {len(keyed)} leaves ({_kinds(inner)}), where tx.init makes "
      f"{len(plan.state_avals)} "
      f"({_kinds(plan.state_def.unflatten(plan.state_avals))})"
    )
  else:
    why = None
    for (path, leaf), want in zip(keyed, plan.state_avals):
      got = (jnp.shape(leaf), jnp.result_type(leaf))
      if got != (want.shape, want.dtype):
        why = (
          f"its leaf {jax.tree_util.keystr(path)} is "
          f"{got[1]}{list(got[0])}, where tx.init makes "
          f"{want.dtype}{list(want.shape)}"
        )
        break
  if why is not None:
    raise ValueError(
      f"immgrad: opt_state does not match what tx.init makes for these "
      f"params: {why}. Was opt_state made by this immgrad.shim for these "
      "params (same model, same optimizer)?"
    )
  return [leaf for _, leaf in keyed]


def _kinds(state: Any) -> str:
  """The names of the outermost optax states in ``state``, in order."""
  is_kind = lambda x: isinstance(x, tuple) and hasattr(x, "_fields")
  kinds = jax.tree.leaves(state, is_leaf=is_kind)
  return ", ".join(type(k).__name__ for k in kinds if is_kind(k)) or "none"


def flatten_like(treedef, tree: Any, what: str) -> list:
  """Flattens ``tree`` up to the params structure, or a clear error."""
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"immgrad: {what} does not match the params tree ({e}). Was it made "
      "for these params (same model, same immgrad.shim)?"
    ) from e
