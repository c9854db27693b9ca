"""``immgrad.flax.immediate``: unmodified Flax models (NNX and Linen).

``immediate(fn, modules)`` is :func:`immgrad.immediate` (``auto.py``) with
one piece of Flax knowledge: which parameter leaves it may step. Inside
``immgrad.value_and_grad`` it finds, among all of ``fn``'s arguments, the
parameter leaves of the step whose innermost Flax module is one of
``modules`` (by default NNX's ``Linear``, ``LinearGeneral``, ``Einsum``,
``Conv``, ``LayerNorm``, ``RMSNorm``, ``Embed`` and Linen's ``Dense``,
``DenseGeneral``, ``Conv``, ``LayerNorm``, ``RMSNorm``, ``Embed``, inside
attention or your own modules too), and hands those to
:func:`immgrad.immediate` as the parameter tree. Every other leaf is an
argument like the data: it keeps an ordinary gradient, which the shim
applies. Flax's own code runs unchanged; the program it traces says where
the layers are, so subclasses, ``nn.remat``, ``nnx.jit``, wrappers that
compute the weight (``nn.WeightNorm``) and vmapped weights need nothing
here.

The params tree (``nnx.split``'s ``State``, Linen's ``params`` dict) does
not name module classes: the graph (NNX's ``GraphDef``, Linen's module)
does, and ``fn`` usually closes over it. So a first, abstract trace of
``fn`` (``jax.eval_shape``: trace time only, no FLOP) finds each leaf's
module by identity, the leaf being the very object Flax stores:

* NNX: the graphs ``fn`` builds with ``nnx.merge`` (``graphlib.unflatten``
  returning, seen through this thread's profile hook, ``sys.setprofile``:
  nothing is patched), and NNX modules among ``fn``'s arguments (a module
  is a pytree); a leaf's module is the nearest ``nnx.Module`` above its
  ``Variable`` in that graph.
* Linen: ``nn.intercept_methods`` (Linen's public, thread-local seam); a
  leaf's module is the innermost module called whose ``variables`` hold it.
"""

import functools
import sys
from typing import Any, Callable, Sequence

from flax import linen as nn
from flax import nnx
from flax.nnx import graphlib
import jax

from immgrad._src import auto
from immgrad._src import context

_NAME = "immgrad.flax.immediate"
_NO_PARAMETERS = (
  "immgrad.flax.immediate: {fn} was called in a step with none of the "
  "step's parameters among its arguments. Parameters it closes over would "
  "train ordinarily: pass them to it (as the loss gets them)."
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
_LOST = (
  "immgrad.flax.immediate: {fn} builds a Flax module from copies of its "
  "parameters, so the module of parameter {leaf} is not found and it would "
  "train ordinarily. This happens when the params are passed into a JAX "
  "transformation (jax.jit, jax.vmap, jax.checkpoint) and the module is "
  "merged or applied inside it. Merge or apply outside, closing over the "
  "module in the transformed function, or use nnx.jit / nnx.remat / "
  "nn.remat, which take the module; or call immgrad.immediate on the "
  "parameters you want stepped."
)


def immediate(
  fn: Callable[..., Any], modules: Sequence[type] = DEFAULT_MODULES
) -> Callable[..., Any]:
  """Makes the weights of the chosen Flax modules in ``fn`` immediate.

  Args:
    fn: a loss (or forward) function that calls Flax modules, with their
      parameters among its arguments (anywhere, keyword arguments too): an
      NNX model (``nnx.merge(graphdef, params)(x)``) or a Linen
      ``model.apply``.
    modules: the ``nnx.Module`` or ``nn.Module`` classes (subclasses
      included) whose own parameters are stepped in the backward pass,
      where the traced program allows it (see :func:`immgrad.layers`).
      Default: :data:`DEFAULT_MODULES`. ``(nnx.Module, nn.Module)`` chooses
      every module's parameters.

  Returns:
    ``fn``, with those weights updated during the backward pass inside
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

    Linen, through ``model.apply``:

    >>> from flax import linen as nn
    >>> model = nn.Dense(1)
    >>> params = model.init(jax.random.PRNGKey(0), x)["params"]
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((model.apply({"params": params}, x) - y) ** 2)
    >>> step = immgrad.value_and_grad(immgrad.flax.immediate(loss_fn), tx)
    >>> loss, grads = step(params, tx.init(params), x, y)
    >>> type(grads["kernel"]).__name__
    'ImmediateGrad'
  """
  if not callable(fn):
    raise TypeError(
      f"immgrad.flax.immediate expects a function that calls Flax "
      f"modules, got {fn!r}."
    )
  chosen = _check_modules(modules)

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    step = context.current()
    if step is None:
      return fn(*args, **kwargs)
    keyed, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [leaf for _, leaf in keyed]
    found = [step.find(leaf, _NAME) is not None for leaf in leaves]
    if not any(found):
      raise ValueError(_NO_PARAMETERS.format(fn=_name(fn)))
    owners, unseen = _owners(fn, treedef, leaves, found)
    lost = [i for i, f in enumerate(found) if f and i not in owners]
    if lost and unseen:
      raise ValueError(
        _LOST.format(fn=_name(fn), leaf=_place(keyed[lost[0]][0]))
      )
    # Named by their place in fn's arguments, for immgrad.immediate's errors.
    names = [
      _place(path) if issubclass(owners.get(i, type), chosen) else None
      for i, (path, _) in enumerate(keyed)
    ]
    params = {n: leaf for n, leaf in zip(names, leaves) if n}
    others = [leaf for n, leaf in zip(names, leaves) if not n]

    def call(params, others):
      others = iter(others)
      full = [params[n] if n else next(others) for n in names]
      args, kwargs = treedef.unflatten(full)
      return fn(*args, **kwargs)

    return auto.immediate(call)(params, others)

  return wrapped


def _owners(fn, treedef, leaves: list, candidates: list) -> tuple[dict, bool]:
  """Leaf index -> the class of the Flax module that owns it; and whether
  a module held traced parameters that are none of the ``candidates``.

  Traces ``fn`` abstractly (``jax.eval_shape``) and finds the ``candidates``
  by identity in the graphs ``nnx.merge`` builds and in the ``variables``
  of the Linen modules called. A module holding other traced parameters
  holds a transformation's copies (``jax.jit``, ``jax.vmap``, a lifted
  Linen transformation): a candidate found nowhere may be among them.
  """
  dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
  owners, unseen = {}, []

  def probe(values):
    full = list(leaves)
    for i, value in zip(dynamic, values):
      full[i] = value
    index = {id(full[i]): i for i in dynamic if candidates[i]}
    calls = []
    args, kwargs = treedef.unflatten(full)
    is_module = lambda x: isinstance(x, nnx.Module)
    for node in jax.tree.leaves((args, kwargs), is_leaf=is_module):
      if is_module(node):  # An NNX model passed as it is (a pytree).
        owners.update(_nnx_owners(node, index))
    with _linen_calls(calls), _merged(index, owners, unseen):
      fn(*args, **kwargs)
    owners.update(_linen_owners(calls, index))
    unseen.extend(_linen_copies(calls, index))

  jax.eval_shape(probe, [leaves[i] for i in dynamic])
  return owners, any(unseen)


class _linen_calls:  # pylint: disable=invalid-name
  """Context manager: records the Linen module calls on this thread.

  Each as ``[module, scope path, params, calls made inside it]``, through
  ``nn.intercept_methods``.
  """

  def __init__(self, calls: list):
    self._calls = calls
    self._intercept = None

  def __enter__(self):
    stack = [self._calls]

    def interceptor(next_fun, args, kwargs, ctx):
      module = ctx.module
      inner = []
      params = module.variables.get("params", {}) if module.scope else {}
      path = tuple(module.scope.path) if module.scope else ()
      stack[-1].append((type(module), path, params, inner))
      stack.append(inner)
      try:
        return next_fun(*args, **kwargs)
      finally:
        stack.pop()

    self._intercept = nn.intercept_methods(interceptor)
    self._intercept.__enter__()

  def __exit__(self, *exc):
    self._intercept.__exit__(*exc)


def _linen_owners(calls: list, index: dict, found=None) -> dict:
  """Leaf index -> the class of the innermost Linen module holding it.

  A module holds a leaf found by identity in its ``variables["params"]``;
  inside a lifted transformation (``nn.remat``, ``nn.scan``) the module
  sees copies, so below the innermost module holding it by identity, a
  module called inside it holds a leaf by its scope path.
  """
  owners = {}
  for cls, path, params, inner in calls:
    here = dict(found or {})
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      i = index.get(id(leaf))
      if i is not None:
        keys = tuple(k.key for k in key_path if hasattr(k, "key"))
        here[i] = path + keys
    held = [
      (i, (len(path), cls))
      for i, leaf_path in here.items()
      if leaf_path[: len(path)] == path and len(leaf_path) > len(path)
    ]
    for i, owner in held + list(_linen_owners(inner, index, here).items()):
      if owner[0] >= owners.get(i, (-1,))[0]:
        owners[i] = owner
  if found is None:
    return {i: cls for i, (_, cls) in owners.items()}
  return owners


def _linen_copies(calls: list, index: dict):
  """Per Linen call: whether its params hold a traced leaf not in ``index``."""
  for _, _, params, inner in calls:
    yield any(_is_copy(leaf, index) for leaf in jax.tree.leaves(params))
    yield from _linen_copies(inner, index)


def _is_copy(value, index: dict) -> bool:
  return isinstance(value, jax.core.Tracer) and id(value) not in index


def _nnx_owners(graph, index: dict):
  """(leaf index, class of the ``nnx.Module`` right above its ``Variable``)."""
  nodes = dict(nnx.iter_graph(graph))
  for path, node in nodes.items():
    if not isinstance(node, nnx.Variable):
      continue
    i = index.get(id(node.get_raw_value()))
    if i is None:
      continue
    for end in range(len(path) - 1, -1, -1):
      if isinstance(nodes.get(path[:end]), nnx.Module):
        yield i, type(nodes[path[:end]])
        break


class _merged:  # pylint: disable=invalid-name
  """Context manager: the owners of leaves in graphs ``nnx.merge`` builds,
  and whether each holds parameters that are copies (``_is_copy``).

  Through this thread's profile hook (``sys.setprofile``, chained to one
  already set): each ``graphlib.unflatten`` call's return value, read at
  once (an NNX transformation later writes new values into it).
  """

  _CODE = graphlib.unflatten.__code__

  def __init__(self, index: dict, owners: dict, unseen: list):
    self._index, self._owners, self._unseen = index, owners, unseen
    self._outer = None

  def __enter__(self):
    self._outer = outer = sys.getprofile()
    index, owners, unseen = self._index, self._owners, self._unseen
    code = self._CODE

    def hook(frame, event, arg):
      if event == "return" and frame.f_code is code:
        owners.update(_nnx_owners(arg, index))
        unseen.append(
          any(
            isinstance(node, nnx.Param)
            and _is_copy(node.get_raw_value(), index)
            for _, node in nnx.iter_graph(arg)
          )
        )
      if outer is not None:
        outer(frame, event, arg)

    sys.setprofile(hook)

  def __exit__(self, *exc):
    sys.setprofile(self._outer)


def _place(path) -> str:
  """``args[0]['layers'][1]['kernel']``: a leaf's place in fn's arguments."""
  return ("args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:])


def _name(fn) -> str:
  return getattr(fn, "__qualname__", repr(fn))


def _check_modules(modules) -> tuple[type, ...]:
  if isinstance(modules, type):
    modules = (modules,)
  for cls in modules:
    if not (isinstance(cls, type) and issubclass(cls, (nnx.Module, nn.Module))):
      raise TypeError(
        "immgrad.flax.immediate: modules= takes nnx.Module or nn.Module "
        "classes (such as nnx.Linear or nn.Dense, or nnx.Module and "
        f"nn.Module for all), got {cls!r}."
      )
  return tuple(modules)
