"""What the three library adapters share: ``modules=``, the wrapper and the
hand-off.

Each adapter (``haiku.py``, ``flax.py``, ``equinox.py``) decides which
parameter leaves of ``fn``'s arguments :func:`immgrad.immediate` may step,
and hands those over here. All raise ``TypeError`` for a wrong argument
(``fn``, ``modules=``) and ``ValueError`` for a call that cannot step.
"""

import functools
from typing import Any, Callable, Sequence

import jax

from immgrad._src import auto
from immgrad._src import context

_NOT_CALLABLE = "{adapter} expects {what}, got {fn!r}."
_NO_PARAMETERS = (
  "{adapter}: {fn} was called in a step with none of the step's parameters "
  "among its arguments. Parameters it closes over would train ordinarily: "
  "pass them to it (as the loss gets them)."
)
_BAD_MODULES = (
  "{adapter}: modules= takes a tuple of {kind} classes, such as "
  "{example}, got {got}. Leave it out to step every parameter of the "
  "model, or add your own classes to the library's: "
  "modules={package}.DEFAULT_MODULES + (MyModule,)."
)


def check_callable(fn, adapter: str, what: str) -> None:
  """Raises TypeError, naming ``adapter``, unless ``fn`` is callable."""
  if not callable(fn):
    raise TypeError(_NOT_CALLABLE.format(adapter=adapter, what=what, fn=fn))


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


def wrap(
  fn: Callable[..., Any],
  adapter: str,
  strict: bool,
  owned: Callable[[Any, list, Any, list[bool]], list[bool]] | None = None,
) -> Callable[..., Any]:
  """``fn``, stepping the step's parameter leaves among its arguments.

  Inside a step (or ``immgrad.layers``' survey) ``fn`` runs through
  :func:`step_chosen` with those leaves; outside, as it is. ``owned``, if
  given, narrows them: ``owned((args, kwargs), keyed, treedef, found)`` is,
  for each leaf, whether to step it (``found``: it is a parameter).
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    step = context.current() or auto.surveying()
    if step is None:
      return fn(*args, **kwargs)
    keyed, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    found = [step.find(leaf, adapter) is not None for _, leaf in keyed]
    if not any(found):
      raise ValueError(_NO_PARAMETERS.format(adapter=adapter, fn=name(fn)))
    if owned is not None:
      found = owned((args, kwargs), keyed, treedef, found)
    return step_chosen(fn, keyed, treedef, found, strict)

  return wrapped


def is_array(x) -> bool:
  """Whether ``x`` is an array argument (a JAX or NumPy array, a shape, or
  anything with ``__jax_array__``): abstract runs of ``fn`` trace these and
  keep every other leaf as it is, as ``jit`` does.
  """
  return (
    isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
    or hasattr(x, "__jax_array__")
    or type(x).__module__ == "numpy"
  )


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
