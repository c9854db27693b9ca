"""The errors for a ``tx`` that ``plan.cut`` cannot cut per parameter.

Each names the innermost part of ``tx`` at fault by the optax factory
that made it and says what to use instead; ``plan.py`` calls them once
its cut has failed.
"""

from typing import Any, Callable

import optax

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


def not_separable(
  tx: optax.GradientTransformation,
  params: Any,
  error: Exception,
  why_not: Callable[[Any, Any], str | None],
  runs_on: Callable[[Any, Any], bool],
) -> ValueError:
  """The error for a ``tx`` with no per-parameter cut for ``params``.

  ``error`` says why ``tx`` has none; ``why_not(part, params)`` why a part
  has none (None if it has one), ``runs_on(part, params)`` whether it runs
  on them at all.
  """
  why = str(error)
  name = culprit = _tx_name(tx)
  parts = _parts(tx)
  while parts:
    for part in parts:
      part_why = why_not(part, params) if runs_on(part, params) else None
      if part_why is not None:
        culprit, why, parts = _tx_name(part), part_why, _parts(part)
        break
    else:
      break
  if culprit != name:
    name = f"{name}: {culprit}"
  fix = _FIXES.get(culprit, _FIX)
  return ValueError(_NOT_SEPARABLE.format(name=name, why=why, fix=fix))


def fails_on(
  tx: optax.GradientTransformation,
  params: Any,
  error: Exception,
  runs_on: Callable[[Any, Any], bool],
) -> ValueError:
  """The error for a ``tx`` that fails on ``params`` (with ``error``)."""
  name = culprit = _tx_name(tx)
  parts = _parts(tx)
  while parts:
    failing = [p for p in parts if not runs_on(p, params)]
    if not failing:
      break
    culprit, parts = _tx_name(failing[0]), _parts(failing[0])
  if culprit != name:
    name = f"{name}: {culprit}"
  return ValueError(
    f"immgrad.shim({name}): the optimizer fails on these params: "
    f"{type(error).__name__}: {error}. An option shaped like the params (a "
    "mask, multi_transform labels) must have the params' tree structure."
  )
