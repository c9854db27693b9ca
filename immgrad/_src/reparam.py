"""Refusing a claimed module whose weights are not the params tree's own.

The Haiku adapter (``haiku_immediate``) computes a claimed module's call
with its own copy of the module's arithmetic, reading each parameter the
way the module reads it. A weight that reaches the module computed from
the params tree (a Haiku custom getter, mixed precision, a property) would
make that copy a different model, so it is refused here, by name, before a
step trains it silently: :func:`check_parameters`. The core refuses it
too, but cannot say which module or what did it. (The Flax and Equinox
adapters stand on ``immgrad.immediate``, which runs the module's own code
and needs no such check.)

The check asks whether the array was made by arithmetic in the
step's own trace: a transformation inside the loss (``jax.checkpoint``, a
loop) hands a layer arrays of another trace, and the core's message about
those stays. That uses ``jax.core.Tracer``'s private ``_trace``; if a JAX
release drops it, the check stands aside and the core's message remains.
"""

from typing import Any

import jax

from immgrad._src import context


def check_parameters(
  adapter: str, culprit: str, base_name: str, params: Any, suspects: str
) -> None:
  """Raises if a leaf of ``params`` was computed from the step's params.

  Args:
    adapter: the public function, for the message.
    culprit: the module, as the message names it.
    base_name: the class to leave out of ``modules=``.
    params: what the module read, by parameter name.
    suspects: what in this library computes weights, for the message.
  """
  step = context.current()
  if step is None or not step.slots:
    return
  views = set()
  outer = step
  while outer is not None:
    views.update(id(slot.view) for slot in outer.slots)
    outer = outer.parent
  here = _trace_of(step.slots[0].view)
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if id(leaf) in views or here is None or _trace_of(leaf) is not here:
      continue
    name = jax.tree_util.keystr(keypath, simple=True, separator="/")
    raise ValueError(
      f"{adapter}: {culprit} reads its parameter {name!r} as an array "
      f"computed from the params, not as the params tree's own array "
      f"({suspects}). A step would update the raw weights with the "
      f"gradient of the computed ones, training a different model. Leave "
      f"{base_name} out of `modules=` so that it trains ordinarily."
    )


def _trace_of(x) -> Any | None:
  """The JAX trace ``x`` belongs to, or None (not a tracer)."""
  if not isinstance(x, jax.core.Tracer):
    return None
  return getattr(x, "_trace", None)
