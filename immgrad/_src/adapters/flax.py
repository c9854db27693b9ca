"""``immgrad.flax.immediate``: unmodified Flax models (NNX and Linen).

:func:`immgrad.immediate` over the step's parameter leaves among ``fn``'s
arguments; ``modules=`` keeps those whose innermost Flax module, found by
path in the model's graph through Flax's public API, is one of the given
classes.
"""

import functools
import inspect
from typing import Any, Callable, Iterator, Sequence

from flax import linen as nn
from flax import nnx
import jax

from immgrad._src.adapters import common

_NAME = "immgrad.flax.immediate"
_NO_GRAPH = (
  "immgrad.flax.immediate: modules= needs the NNX model to know which "
  "module holds parameter {leaf}, and {fn} neither takes the model (an "
  "nnx.Module) among its arguments nor closes over its nnx.GraphDef. Close "
  "over the graphdef in {fn} (as `nnx.merge(graphdef, params)` does), or "
  "pass the model to it; or leave modules= out to step every parameter."
)

NNX_MODULES = (
  nnx.Linear,
  nnx.LinearGeneral,
  nnx.Einsum,
  nnx.Conv,
  nnx.LayerNorm,
  nnx.RMSNorm,
  nnx.Embed,
)
LINEN_MODULES = (
  nn.Dense,
  nn.DenseGeneral,
  nn.Conv,
  nn.LayerNorm,
  nn.RMSNorm,
  nn.Embed,
)
DEFAULT_MODULES = NNX_MODULES + LINEN_MODULES

# Libraries whose functions the search for closed-over graphdefs skips.
_LIBRARIES = frozenset(
  {"flax", "jax", "jaxlib", "optax", "numpy", "immgrad", "chex", "haiku"}
)


def immediate(
  fn: Callable[..., Any],
  modules: Sequence[type] | None = None,
  *,
  strict: bool = False,
) -> Callable[..., Any]:
  """Makes the parameters of the Flax model in ``fn`` immediate.

  Args:
    fn: a loss (or forward) function that calls Flax modules, with their
      parameters among its arguments (anywhere, keyword arguments too): an
      NNX model (``nnx.merge(graphdef, params)(x)``, or the model itself)
      or a Linen ``model.apply``.
    modules: None (the default): every parameter leaf among ``fn``'s arguments,
      as :func:`immgrad.immediate` takes them; what still trains ordinarily (a
      tied weight, a recurrent cell's weights) is reported. A tuple of
      ``nnx.Module`` or ``nn.Module`` classes (subclasses included): only the
      parameters those modules hold themselves; it replaces the default, so
      ``DEFAULT_MODULES + (MyModule,)`` is Flax's weight-carrying modules and
      yours. For NNX it needs the model: among ``fn``'s arguments, or its
      ``nnx.GraphDef`` closed over by ``fn``.
    strict: raise ``ValueError`` where an :class:`immgrad.OrdinaryWarning`
      would be issued (a parameter this function was asked to step that
      trains ordinarily: tied, read outside its layer, reused by a loop).

  Returns:
    ``fn``, with those parameters updated during the backward pass inside
    ``immgrad.value_and_grad``. Outside it, ``fn`` itself.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import immgrad, immgrad.flax
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> graphdef, params = nnx.split(model, nnx.Param)
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)
    >>> tx = immgrad.shim(optax.adam(1e-3))
    >>> opt_state = tx.init(params)
    >>> step = jax.jit(immgrad.value_and_grad(immgrad.flax.immediate(loss_fn),
    ...                                       tx))
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> loss, grads = step(params, opt_state, x, y)
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["kernel"].shape
    (3, 1)

    Linen, through ``model.apply``, with a module of your own among
    Flax's (its ``scale`` would train ordinarily with
    ``modules=DEFAULT_MODULES``):

    >>> from flax import linen as nn
    >>> class Scaled(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(1)(x) * self.param("scale", nn.initializers.ones,
    ...                                        (1,))
    >>> model = Scaled()
    >>> params = model.init(jax.random.PRNGKey(0), x)["params"]
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((model.apply({"params": params}, x) - y) ** 2)
    >>> mine = immgrad.flax.immediate(
    ...     loss_fn, modules=immgrad.flax.DEFAULT_MODULES + (Scaled,))
    >>> step = immgrad.value_and_grad(mine, tx)
    >>> loss, grads = step(params, tx.init(params), x, y)
    >>> type(grads["scale"]).__name__, type(grads["Dense_0"]["kernel"]).__name__
    ('ImmediateGrad', 'ImmediateGrad')
  """
  common.check_callable(fn, _NAME, "a function that calls Flax modules")
  chosen = common.check_modules(
    modules,
    (nnx.Module, nn.Module),
    _NAME,
    "nnx.Module or nn.Module",
    "(nnx.Linear, nn.Dense)",
  )

  if chosen is None:
    return common.wrap(fn, _NAME, strict)

  def owned(tree, keyed, treedef, found):
    owners = _owners(fn, tree, keyed, treedef, found)
    return [
      i in owners and issubclass(owners[i], chosen) for i in range(len(found))
    ]

  return common.wrap(fn, _NAME, strict, owned)


def _owners(fn, tree, keyed: list, treedef, candidates: list) -> dict:
  """Leaf index -> the class of the innermost Flax module holding it.

  A leaf is held by the module whose parameter path (in the NNX graph, or
  a Linen call's scope path and parameter name) is the longest run of the
  leaf's own path. Linen's calls are seen in an abstract run of ``fn``,
  made only if a candidate is not found in an NNX graph.

  The NNX graphs are those of the NNX modules among ``fn``'s arguments and of
  the graphdefs (``nnx.GraphDef``) ``fn`` closes over (``nnx.merge`` of a
  placeholder state, ``nnx.iter_graph``); Linen's scope paths come from a run
  under ``nn.intercept_methods``. Public API only; since a leaf matches the
  longest module path inside its own path, casts and transformations between
  the step and the module do not hide it.
  """
  table = {}
  for graph in _nnx_graphs(fn, tree):
    table.update(_nnx_table(graph))
  paths = [_keys(path) for path, _ in keyed]
  owners = _match(table, paths, candidates)
  if len(owners) < sum(candidates):
    table.update(_linen_table(fn, [leaf for _, leaf in keyed], treedef))
    owners = _match(table, paths, candidates)
  in_state = _in_nnx_state(tree)
  for i, c in enumerate(candidates):
    if c and i not in owners and in_state[i]:
      leaf = common.place(keyed[i][0])
      raise ValueError(_NO_GRAPH.format(leaf=leaf, fn=common.name(fn)))
  return owners


def _keys(path) -> tuple:
  """A leaf's path as keys (``('layers', 0, 'kernel', 'value')``)."""
  return tuple(
    getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
    for k in path[1:]
  )


def _match(table: dict, paths: list, candidates: list) -> dict:
  """Leaf index -> class, for the candidates a path of ``table`` is in."""
  owners = {}
  for i, (path, c) in enumerate(zip(paths, candidates)):
    best = ()
    for start in range(len(path)):
      for end in range(len(path), start + len(best), -1):
        if path[start:end] in table:
          best = path[start:end]
          break
    if c and best:
      owners[i] = table[best]
  return owners


def _nnx_graphs(fn, tree) -> Iterator[Any]:
  """The NNX modules among ``tree``, and those of the graphdefs ``fn``
  reaches (closes over, or names as globals; through the functions and
  ``functools.partial`` objects it reaches in turn, not into libraries).
  """
  is_module = lambda x: isinstance(x, nnx.Module)
  for node in jax.tree.leaves(tree, is_leaf=is_module):
    if is_module(node):
      yield node
  seen, todo = set(), [fn]
  while todo:
    obj = todo.pop()
    if id(obj) in seen:
      continue
    seen.add(id(obj))
    if isinstance(obj, nnx.GraphDef):
      placeholder = jax.ShapeDtypeStruct((), jax.numpy.float32)
      yield nnx.merge(obj, [placeholder] * obj.num_leaves)
    elif isinstance(obj, nnx.Module):
      yield obj
    elif isinstance(obj, functools.partial):
      todo += [obj.func, *obj.args, *obj.keywords.values()]
    elif inspect.ismethod(obj):
      todo += [obj.__func__, *getattr(obj.__self__, "__dict__", {}).values()]
    elif inspect.isfunction(obj) and not _in_library(obj):
      found = inspect.getclosurevars(obj)
      todo += [*found.nonlocals.values(), *found.globals.values()]
      todo += [getattr(obj, "__wrapped__", None)]
    elif callable(obj) and hasattr(obj, "__wrapped__"):  # jax.jit's.
      todo.append(obj.__wrapped__)


def _in_library(fn) -> bool:
  return (getattr(fn, "__module__", None) or "").split(".")[0] in _LIBRARIES


def _nnx_table(graph) -> dict:
  """Path of each Variable in an NNX graph -> the class of the nearest
  ``nnx.Module`` above it.
  """
  nodes = dict(nnx.iter_graph(graph))
  table = {}
  for path, node in nodes.items():
    if not isinstance(node, nnx.Variable):
      continue
    for end in range(len(path) - 1, -1, -1):
      if isinstance(nodes.get(path[:end]), nnx.Module):
        table[path] = type(nodes[path[:end]])
        break
  return table


def _linen_table(fn, leaves: list, treedef) -> dict:
  """Scope path + name of each Linen parameter ``fn`` uses -> the class of
  the module holding it, from an abstract run under ``nn.intercept_methods``.
  """
  table = {}

  def interceptor(next_fun, args, kwargs, ctx):
    module = ctx.module
    if module.scope is not None:
      scope = tuple(module.scope.path)
      for name, value in module.variables.get("params", {}).items():
        if not hasattr(value, "items"):  # Its own, not a child's.
          table[scope + (name,)] = type(module)
    return next_fun(*args, **kwargs)

  dynamic = [i for i, leaf in enumerate(leaves) if common.is_array(leaf)]

  def probe(values):
    full = list(leaves)
    for i, value in zip(dynamic, values):
      full[i] = value
    args, kwargs = treedef.unflatten(full)
    with nn.intercept_methods(interceptor):
      fn(*args, **kwargs)

  jax.eval_shape(probe, [leaves[i] for i in dynamic])
  return table


def _in_nnx_state(tree) -> list[bool]:
  """For each leaf of ``tree``: whether it is inside an ``nnx.State``."""
  is_state = lambda x: isinstance(x, nnx.State)
  flags = []
  for node in jax.tree.leaves(tree, is_leaf=is_state):
    flags += [True] * len(jax.tree.leaves(node)) if is_state(node) else [False]
  return flags
