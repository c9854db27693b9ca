"""Refusing a claimed module whose weights are not the params tree's own.

An adapter (``haiku_immediate``, ``flax_immediate``, ``equinox_immediate``)
computes a claimed module's call with its own copy of the module's
arithmetic, reading each parameter the way the module reads it. Whatever
changes how the module gets its weights would make that copy a different
model, so it is refused here, by name, before a step trains it silently:

* a Linen subclass overriding a method its call relies on (BiT's
  ``StdConv`` standardises its kernel in ``param()``):
  :func:`check_overrides`;
* a weight that reaches the module computed from the params tree (weight or
  spectral norm wrappers, ``nn.map_variables``, a Haiku custom getter, a
  property): :func:`check_parameters`. The core refuses it too, but cannot
  say which module or what did it.

The second check asks whether the array was made by arithmetic in the
step's own trace: a transformation inside the loss (``jax.checkpoint``, a
loop) hands a layer arrays of another trace, and the core's message about
those stays. That uses ``jax.core.Tracer``'s private ``_trace``; if a JAX
release drops it, the check stands aside and the core's message remains.
"""

from typing import Any

import jax

from immgrad._src import context


def check_overrides(
  adapter: str, module: Any, base: type, base_name: str
) -> None:
  """Raises if ``type(module)`` overrides a method of ``base``.

  Dataclass fields (options the adapter reads from the module) and dunder
  methods (``__call__``, which reaches the adapter only through ``base``'s
  own, and dataclass-generated ones) are not counted.
  """
  cls = type(module)
  fields = getattr(cls, "__dataclass_fields__", {})
  for klass in cls.__mro__[: cls.__mro__.index(base)]:
    for name, value in vars(klass).items():
      if (
        name.startswith("__")
        or name in fields
        or not hasattr(base, name)
        or not (
          callable(value)
          or isinstance(value, (property, classmethod, staticmethod))
        )
      ):
        continue
      where = "" if klass is cls else f" (in {klass.__name__})"
      raise ValueError(
        f"{adapter}: {base_name} subclass {cls.__name__} overrides "
        f"{name}(){where}, which {base_name}'s call relies on; immgrad computes {base_name}'s own arithmetic and would skip "
        f"yours, training a different model. Leave {base_name} out of "
        f"`modules=` so that {cls.__name__} trains ordinarily."
      )


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
