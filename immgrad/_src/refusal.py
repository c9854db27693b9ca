"""The per-parameter cut of ``tx``, or an error naming the part that mixes.

:func:`cut` is ``plan.make`` with the refusal worded for the user: it names
the innermost part of ``tx`` that has no cut, by the optax factory that
made it.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from immgrad._src import plan as plan_lib

_NOT_SEPARABLE = (
  "immgrad.shim({name}): this transformation does not act on each "
  "parameter separately ({why}). Immediate layers step each layer as soon "
  "as its gradient exists, before the other gradients do, so a rule that "
  "needs the whole gradient tree (clip_by_global_norm, apply_if_finite, "
  "a MultiSteps should_skip_update_fn, ...) cannot run there. {fix}"
)
_FIXES = {
  "clip_by_global_norm": (
    "Replace optax.clip_by_global_norm(max_norm) with "
    "immgrad.clip_by_layer_norm(max_norm): it clips each parameter "
    "tensor's gradient to max_norm by its own norm, where the global "
    "version scales every gradient by the norm of them all."
  ),
  "apply_if_finite": (
    "Drop it: immgrad.shim(tx) (atomic=True, the default) already rejects "
    "a step with any non-finite gradient whole and counts it in "
    "state.rejected."
  ),
  "MultiSteps": (
    "MultiSteps itself accumulates per parameter; its "
    "should_skip_update_fn reads every gradient. Drop it: immgrad.shim's "
    "atomic steps (the default) reject a non-finite micro-batch whole, "
    "leaving the accumulated gradients as they were, as "
    "optax.skip_not_finite does."
  ),
}
_FIX = (
  "Use a per-parameter rule instead: immgrad.clip_by_layer_norm, "
  "optax.clip or optax.clip_by_block_rms for clipping."
)

_GENERIC = ("", "init_empty_state", "with_extra_args_support")


def _factory_name(fn) -> str:
  """The optax factory that made ``fn``, looking through generic wrappers."""
  name = getattr(fn, "__qualname__", "").split(".<locals>")[0]
  name = name.removesuffix(".init").removesuffix(".update")
  if name not in _GENERIC:
    return name
  for value in _closure(fn):
    if callable(value) and (inner := _factory_name(value)) not in _GENERIC:
      return inner
  return name


def _tx_name(tx: optax.GradientTransformation) -> str:
  for fn in (tx.update, tx.init):
    if (name := _factory_name(fn)) not in _GENERIC:
      return name
  return repr(tx)


def _closure(fn) -> list:
  values = []
  for cell in getattr(fn, "__closure__", None) or ():
    try:
      values.append(cell.cell_contents)
    except ValueError:  # An empty cell.
      pass
  return values


_PROBE = {
  "a": jax.ShapeDtypeStruct((4, 3), jnp.float32),
  "b": jax.ShapeDtypeStruct((5,), jnp.float32),
}


def _why_not_separable(
  tx: optax.GradientTransformation, params: Any
) -> str | None:
  """Why ``tx`` has no per-parameter cut for ``params``, or None.

  Structural, not numerical (``plan.py`` follows the data flow): a
  numerical probe would miss a global-norm clip that happens not to
  trigger on it (after adam, say).
  """
  try:
    plan_lib.make(tx, params)
  except plan_lib.NotSeparable as e:
    return str(e)
  return None


def _applies_to(tx, params) -> bool:
  """Whether ``tx`` runs at all on a tree shaped like ``params``."""
  try:
    state = jax.eval_shape(tx.init, params)
    jax.eval_shape(tx.update, params, state, params)
  except Exception:
    return False
  return True


def _parts(tx: optax.GradientTransformation) -> list:
  """The transformations ``tx`` is built from, as far as its closures say.

  Only used to name the culprit in an error; ``optax.chain`` keeps its
  parts' init and update functions in two tuples, wrappers keep the inner
  transformation itself (an optimizer object such as ``optax.MultiSteps``
  as an attribute).
  """
  held = _closure(tx.init) + _closure(tx.update)
  owner = getattr(tx.update, "__self__", None)  # An optimizer object's method.
  held += list(vars(owner).values()) if hasattr(owner, "__dict__") else []
  found = [
    v
    for v in held
    if isinstance(v, optax.GradientTransformation) and v is not tx
  ]
  # Exactly tuples: a NamedTuple state is not a list of functions.
  tuples = [v for v in held if type(v) is tuple and v and all(map(callable, v))]
  if len(tuples) == 2 and len(tuples[0]) == len(tuples[1]):
    found += [optax.GradientTransformation(i, u) for i, u in zip(*tuples)]
  return found


def _check_separable(tx: optax.GradientTransformation, params: Any) -> None:
  """Raises, naming the innermost culprit, unless ``tx`` cuts for ``params``."""
  why = _why_not_separable(tx, params)
  if why is None:
    return
  name = culprit = _tx_name(tx)
  parts = _parts(tx)
  while parts:
    for part in parts:
      part_why = (
        _why_not_separable(part, params) if _applies_to(part, params) else None
      )
      if part_why is not None:
        culprit, why, parts = _tx_name(part), part_why, _parts(part)
        break
    else:
      break
  if culprit != name:
    name = f"{name}: {culprit}"
  fix = _FIXES.get(culprit, _FIX)
  raise ValueError(_NOT_SEPARABLE.format(name=name, why=why, fix=fix))


def cut(tx: optax.GradientTransformation, params: Any) -> plan_lib.Plan:
  """``tx``'s per-parameter programs for ``params``, or an error naming it.

  It searches ``tx``'s parts (``chain``'s members, a wrapper's inner
  transformation, as far as their closures show) for the innermost one that
  has no cut.
  """
  try:
    return plan_lib.make(tx, params)
  except plan_lib.NotSeparable:
    _check_separable(tx, params)
    raise
  except Exception as e:
    name = culprit = _tx_name(tx)
    parts = _parts(tx)
    while parts:
      failing = [p for p in parts if not _applies_to(p, params)]
      if not failing:
        break
      culprit, parts = _tx_name(failing[0]), _parts(failing[0])
    if culprit != name:
      name = f"{name}: {culprit}"
    raise ValueError(
      f"immgrad.shim({name}): the optimizer fails on these params: "
      f"{type(e).__name__}: {e}. An option shaped like the params (a mask, "
      "multi_transform labels) must have the params' tree structure."
    ) from e


def check(tx: optax.GradientTransformation) -> None:
  """Refuses ``tx`` early, on a probe tree, if it shows ``tx`` mixes leaves.

  A ``tx`` that needs the params' own tree (a mask shaped like them) does
  not run on the probe: it is checked at ``init``, on the real params.
  """
  if _applies_to(tx, _PROBE):
    cut(tx, _PROBE)
