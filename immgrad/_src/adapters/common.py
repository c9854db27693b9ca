"""What the three library adapters share: ``modules=`` and the hand-off.

Each adapter (``haiku.py``, ``flax.py``, ``equinox.py``) decides which parameter leaves of ``fn``'s
arguments :func:`immgrad.immediate` may step, and hands those over here.
"""

from typing import Any, Callable, Sequence

import jax

from immgrad._src import auto

_BAD_MODULES = (
  "{adapter}: modules= takes a tuple of {kind} classes, such as "
  "{example}, got {got}. Leave it out to step every parameter of the "
  "model, or add your own classes to the library's: "
  "modules={package}.DEFAULT_MODULES + (MyModule,)."
)


def check_modules(
  modules: Sequence[type] | None,
  base: tuple[type, ...],
  adapter: str,
  kind: str,
  example: str,
) -> tuple[type, ...] | None:
  """``modules`` as a tuple of subclasses of ``base``, or None (every one).

  Raises TypeError naming ``adapter``'s parameter and the fix for anything
  else (a bare class, an instance, a function).
  """
  if modules is None:
    return None
  if not isinstance(modules, (tuple, list)) or not all(
    isinstance(cls, type) and issubclass(cls, base) for cls in modules
  ):
    raise TypeError(
      _BAD_MODULES.format(
        adapter=adapter,
        kind=kind,
        example=example,
        got=_culprit(modules, base),
        package=adapter.rsplit(".", 1)[0],
      )
    )
  return tuple(modules)


def _culprit(modules, base: tuple[type, ...]) -> str:
  """The wrong part of a ``modules=`` value, briefly (no model repr)."""
  if isinstance(modules, type):
    return f"the class {modules.__name__} alone (write ({modules.__name__},))"
  items = modules if isinstance(modules, (tuple, list)) else [modules]
  bad = next(
    (c for c in items if not (isinstance(c, type) and issubclass(c, base))),
    modules,
  )
  return bad.__name__ if isinstance(bad, type) else f"a {type(bad).__name__}"


def name(fn) -> str:
  """How errors name the user's function."""
  return getattr(fn, "__qualname__", repr(fn))


def place(path) -> str:
  """``args[0]['layers'][1]['kernel']``: a leaf's place in fn's arguments."""
  return ("args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:])


def step_chosen(
  fn: Callable[..., Any],
  keyed: list,
  treedef: Any,
  chosen: list[bool],
  strict: bool = False,
) -> Any:
  """``fn(*args, **kwargs)`` through :func:`immgrad.immediate`, with the
  ``chosen`` leaves of ``(args, kwargs)`` (``keyed``, flattened with their
  paths) as its parameter tree, named by their place in fn's arguments;
  every other leaf goes in as the data does. ``strict``: as
  :func:`immgrad.immediate`'s.
  """
  names = [place(path) if c else None for (path, _), c in zip(keyed, chosen)]
  params = {n: leaf for n, (_, leaf) in zip(names, keyed) if n}
  others = [leaf for n, (_, leaf) in zip(names, keyed) if not n]

  def call(params, others):
    others = iter(others)
    full = [params[n] if n else next(others) for n in names]
    args, kwargs = treedef.unflatten(full)
    return fn(*args, **kwargs)

  return auto.immediate(call, strict=strict)(params, others)
