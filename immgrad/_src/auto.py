"""``immediate`` and ``layers``: immediate layers found in the traced program.

``immediate(fun)`` needs no adapter and no decorated layer: it traces
``fun`` to a jaxpr and runs each equation that combines parameter-only
values with activations as an ``immediate_layer``, where its parameter
leaves reach nothing else (``docs/auto.md``).
"""

import dataclasses
import functools
import threading
from typing import Any, Callable, Optional

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from immgrad._src import auto_classify as classify_lib
from immgrad._src import auto_interpret as interpret_lib
from immgrad._src import auto_program as program_lib
from immgrad._src import context
from immgrad._src import ordinary as ordinary_lib

_ARGUMENT_NOT_A_PARAMETER = (
  "immgrad.immediate: params{path} (argument {argnums}) is not a parameter "
  "leaf given to immgrad.value_and_grad. Pass the params tree the step "
  "hands the loss, unchanged; cast or transform it inside `fun`."
)


_CLOSED_OVER = (
  "immgrad.immediate: {fun} closes over the parameter params{path} instead of "
  "taking it in its params tree (argument {argnums}), so it would keep an "
  "ordinary gradient unnoticed. Pass it in the params tree."
)


def _is_array(x) -> bool:
  return isinstance(
    x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
  )


def _is_float(x) -> bool:
  return _is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _flatten(args: tuple, kwargs: dict, argnums: int, fun_name: str):
  """The leaves of ``(params, other args, kwargs)``, and how to call back."""
  if not isinstance(argnums, int) or not 0 <= argnums < len(args):
    raise ValueError(
      f"immgrad.immediate: {fun_name} was called with {len(args)} "
      f"positional argument(s), so argnums={argnums!r} names no parameter "
      f"tree. Pass the params tree positionally at argnums."
    )
  params, others = args[argnums], args[:argnums] + args[argnums + 1 :]
  keyed, _ = jax.tree_util.tree_flatten_with_path(params)
  paths = [jax.tree_util.keystr(k) for k, _ in keyed]
  leaves, treedef = jax.tree.flatten((params, others, kwargs))
  return leaves, treedef, paths


def _qualname(fun) -> str:
  return getattr(fun, "__qualname__", repr(fun))


def _analyse(fun, argnums, args, kwargs, only=None):
  """Traces ``fun`` and plans its layers: (program, plan, leaves, paths).

  With ``only`` (leaf positions), the other parameter leaves are arguments
  like the data, and ``fun`` is traced as outside a step: the immediate
  layers and adapters inside it are plain JAX, which this plan replaces.
  """
  leaves, treedef, paths = _flatten(args, kwargs, argnums, _qualname(fun))

  def call(params, others, kwargs):
    return fun(*others[:argnums], params, *others[argnums:], **kwargs)

  dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  if only is None:
    program = program_lib.trace(call, leaves, treedef, dynamic)
  else:
    with context.hidden(context.current()):
      program = program_lib.trace(call, leaves, treedef, dynamic)
  params = {
    program.inputs[i]: i
    for i in range(len(paths))
    if _is_float(leaves[i]) and (only is None or i in only)
  }
  return program, classify_lib.classify(program, params, paths), leaves, paths


def whole(fun: Callable[..., Any], only: frozenset) -> Callable[..., Any]:
  """The loss ``fun`` made immediate as one program, for ``value_and_grad``.

  Where a layer's weight is also used outside it (an L2 term the loss
  adds outside ``immgrad.haiku.immediate``'s forward function), the step
  runs the whole loss through this planner instead, stepping the leaves at
  positions ``only`` (those the layers claimed) where it can: the term
  then folds into their layers' steps.
  """

  def wrapped(params, *args):
    program, plan, leaves, _ = _analyse(fun, 0, (params, *args), {}, only)
    values = [leaves[i] for i, n in enumerate(program.inputs) if n is not None]
    return jax.tree.unflatten(
      program.out_tree, interpret_lib.run(program, plan, values)
    )

  return wrapped


def immediate(
  fun: Callable[..., Any], *, argnums: int = 0, strict: bool = False
) -> Callable[..., Any]:
  """Makes every layer JAX traces in ``fun`` an immediate layer.

  Args:
    fun: any JAX function taking the parameter tree as positional argument
      ``argnums``: a loss, a Haiku or Linen ``apply``, an NNX
      ``merge``-and-call, raw JAX. Non-array arguments are static, as
      under ``jax.jit``.
    argnums: the position of the parameter tree among ``fun``'s arguments.
    strict: raise ``ValueError`` where an :class:`OrdinaryWarning` would be
      issued.

  Returns:
    ``fun``, except inside ``immgrad.value_and_grad``: there each equation
    that combines parameter-only values with activations, and whose
    parameter leaves reach nothing else, is an immediate layer stepped in
    the backward pass; every other parameter keeps an ordinary gradient
    (see :func:`layers` for which and why). If a floating-point leaf of the
    parameter tree that ``fun`` uses is left ordinary, each trace of the
    step warns (:class:`OrdinaryWarning`) with the leaves, the reasons and
    their fixes; with ``strict`` it raises.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> def model(params, x):
    ...   h = jax.nn.relu(x @ params["w1"] + params["b1"])
    ...   return h @ params["w2"]
    >>> params = {"w1": jnp.full((2, 3), 0.5), "b1": jnp.zeros(3),
    ...           "w2": jnp.full((3, 1), 0.5)}
    >>> net = immgrad.immediate(model)
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((net(params, x) - y) ** 2)
    >>> tx = immgrad.shim(optax.sgd(0.1))
    >>> step = jax.jit(immgrad.value_and_grad(loss_fn, tx))
    >>> loss, grads = step(params, tx.init(params), jnp.ones((4, 2)),
    ...                    jnp.zeros((4, 1)))
    >>> sorted(k for k, g in grads.items()
    ...        if isinstance(g, immgrad.ImmediateGrad))
    ['b1', 'w1', 'w2']
  """
  if not callable(fun):
    raise TypeError(f"immgrad.immediate expects a function, got {fun!r}.")

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    step = context.current()
    if step is None:
      survey = surveying()
      if survey is None:
        return fun(*args, **kwargs)
      # immgrad.layers is asking: report; run as traced.
      program, plan, leaves, paths = _analyse(fun, argnums, args, kwargs)
      survey.record(plan, leaves, paths)
      values = [
        leaves[i] for i, n in enumerate(program.inputs) if n is not None
      ]
      outs = interpret_lib.run(
        program, dataclasses.replace(plan, immediate={}), values
      )
      return jax.tree.unflatten(program.out_tree, outs)
    program, plan, leaves, paths = _analyse(fun, argnums, args, kwargs)
    for i in plan.params.values():
      if step.find(leaves[i], "immgrad.immediate") is None:
        raise ValueError(
          _ARGUMENT_NOT_A_PARAMETER.format(path=paths[i], argnums=argnums)
        )
    for const in program.consts.values():
      slot = step.find(const, "immgrad.immediate")
      if slot is not None:
        raise ValueError(
          _CLOSED_OVER.format(
            fun=_qualname(fun), path=slot.path, argnums=argnums
          )
        )
    ordinary_lib.report(plan.ordinary, len(plan.params), paths, strict)
    values = [leaves[i] for i, n in enumerate(program.inputs) if n is not None]
    outs = interpret_lib.run(program, plan, values)
    return jax.tree.unflatten(program.out_tree, outs)

  # Read back by immgrad.layers; pyright does not model function attributes.
  wrapped.immediate_fun = (fun, argnums)  # pyright: ignore[reportAttributeAccessIssue]
  return wrapped


@dataclasses.dataclass(frozen=True)
class Row:
  """One parameter leaf: the layer that steps it, or why none does."""

  path: str
  shape: str  # e.g. "f32[3,4]".
  layer: str | None  # e.g. "dot_general -> f32[8,4]", None if ordinary.
  source: str | None  # The user's line that made the layer.
  why: str | None  # Why the leaf keeps an ordinary gradient.


class Layers(tuple):
  """:func:`layers`'s answer: a tuple of :class:`Row`, printable as a table.

  ``table[path]`` (a string such as ``"['w']"``) is that leaf's row.
  """

  def __getitem__(self, key):
    if isinstance(key, str):
      for row in self:
        if row.path == key:
          return row
      raise KeyError(key)
    return super().__getitem__(key)

  def __str__(self) -> str:
    cells = [
      (r.path, r.shape, r.layer or "ordinary", r.source if r.layer else r.why)
      for r in self
    ]
    cells.insert(0, ("parameter", "shape", "layer", "source / why ordinary"))
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join(
      "  ".join(c.ljust(w) for c, w in zip(cell[:3], widths)) + "  " + cell[3]
      for cell in cells
    )


def layers(fun: Callable[..., Any], params: Any, *args, **kwargs) -> Layers:
  """What :func:`immediate` makes of ``fun(params, *args, **kwargs)``.

  Args:
    fun: a function as for :func:`immediate`, or one it returned (then its
      ``argnums`` places ``params`` among ``args``), or a function that
      calls such functions (a loss calling an adapter's ``immediate``:
      then each leaf is reported as the function it was given to steps
      it, ``modules=`` included).
    params: the parameter tree.
    *args: ``fun``'s other arguments (arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments.

  Returns:
    A :class:`Layers`: for each parameter leaf, the layer that steps it
    (primitive, output shape, the user's source line), or why it keeps an
    ordinary gradient. ``print`` it for a table.

  Example:
    >>> import jax.numpy as jnp
    >>> import immgrad
    >>> def model(params, tokens):
    ...   h = params["embed"][tokens]  # Tied: also the output projection.
    ...   return (h * params["scale"]) @ params["embed"].T
    >>> params = {"embed": jnp.ones((10, 4)), "scale": jnp.ones(4)}
    >>> table = immgrad.layers(model, params, jnp.zeros(3, jnp.int32))
    >>> table["['scale']"].layer
    'mul -> float32[3,4]'
    >>> table["['embed']"].why.startswith("read by 2 layers")
    True
  """
  fun, argnums = getattr(fun, "immediate_fun", (fun, 0))
  args = args[:argnums] + (params,) + args[argnums:]
  leaves, treedef, paths = _flatten(args, kwargs, argnums, _qualname(fun))
  rows = _surveyed(fun, argnums, leaves, treedef, paths)
  if rows is None:  # fun calls no immediate function: it is one.
    _, plan, leaves, paths = _analyse(fun, argnums, args, kwargs)
    rows = [_row(plan, i, path, leaves[i]) for i, path in enumerate(paths)]
  return Layers(rows)


def _row(plan: program_lib.Plan, i: int, path: str, leaf) -> Row:
  """Leaf ``i`` of ``plan``'s parameters, shown as ``path``."""
  shape = jax.core.ShapedArray(jnp.shape(leaf), jnp.result_type(leaf))
  shape = shape.str_short()
  node, inner, scanned = plan.immediate.get(i), plan, ""
  while node is not None and id(node) in inner.scans:  # Per layer.
    inner = inner.scans[id(node)][1]
    node, scanned = inner.immediate[i], scanned + " in `scan`"
  if node is not None:
    out = node.eqn.outvars[0].aval.str_short()
    layer = f"{node.eqn.primitive.name} -> {out}{scanned}"
    return Row(path, shape, layer, node.where, None)
  return Row(path, shape, None, None, str(plan.ordinary.get(i, _NOT_FLOAT)))


_NOT_FLOAT = "not floating point: no gradient"


_NOT_GIVEN = (
  "not among the parameters of the immediate functions `fun` calls: the "
  "adapter's `modules=` does not choose its module, or it is used outside "
  "the wrapped function"
)


_survey = threading.local()


def surveying() -> Optional["_Survey"]:
  """The :func:`layers` survey under way on this thread, or None."""
  return getattr(_survey, "current", None)


class _Survey:
  """What :func:`layers` learns from the immediate functions ``fun`` calls.

  Outside a step, an adapter asks it (as it asks a step) which leaves are
  the parameters (``find``), and each :func:`immediate` call records the
  rows of the leaves it was given: the layers of ``mode="current"`` (at
  other dX, Haiku's adapter binds each module call as one layer).
  """

  def __init__(self, index: dict):
    self.index = index  # id(traced parameter leaf) -> its row.
    self.rows = {}
    self.called = False  # Whether an immediate function ran.
    self._outer = None

  def find(self, leaf, user: str):
    del user
    return self.index.get(id(leaf))

  def record(self, plan: program_lib.Plan, leaves: list, paths: list) -> None:
    self.called = True
    for j in range(len(paths)):
      i = self.index.get(id(leaves[j]))
      if i is not None and i not in self.rows:
        self.rows[i] = _row(plan, j, "", leaves[j])

  def __enter__(self):
    self._outer, _survey.current = surveying(), self
    return self

  def __exit__(self, *exc):
    _survey.current = self._outer


def _surveyed(fun, argnums, leaves, treedef, paths) -> list | None:
  """The rows of ``fun``'s parameters, from the immediate functions it
  calls (traced abstractly), or None if it calls none.
  """
  dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  rows, called = {}, []

  def probe(*values):
    full = list(leaves)
    for i, v in zip(dynamic, values):
      full[i] = v
    index = {id(full[i]): i for i in dynamic if i < len(paths)}
    params, others, kwargs = treedef.unflatten(full)
    with _Survey(index) as survey:
      fun(*others[:argnums], params, *others[argnums:], **kwargs)
    rows.update(survey.rows)
    called.append(survey.called)

  jax.eval_shape(probe, *[leaves[i] for i in dynamic])
  if not any(called):
    return None
  out = []
  for i, path in enumerate(paths):
    if i in rows:
      out.append(dataclasses.replace(rows[i], path=path))
    else:
      shape = jax.core.ShapedArray(
        jnp.shape(leaves[i]), jnp.result_type(leaves[i])
      ).str_short()
      why = _NOT_GIVEN if _is_float(leaves[i]) else _NOT_FLOAT
      out.append(Row(path, shape, None, None, why))
  return out
