"""``shim``: the optax optimizer that commits what immediate layers computed.

The shim keeps one optimizer state per parameter leaf (``tx.init`` of that
leaf alone), because an immediate layer steps its own leaves during the
backward pass, long before the other gradients exist. ``update`` takes the
tree that ``immgrad.value_and_grad`` returns and commits the whole step at
once: a leaf that is an :class:`ImmediateGrad` is stepped again from the
same gradient, state and weights its layer stepped it with (so its new
weights are the ones the layer took ``dX`` at); a :class:`Stepped` leaf
already holds its new weights and state; any other leaf is an ordinary
gradient and gets ``tx``'s normal update.

Atomic steps: every layer checked its own step in the backward pass, and
the commit runs under one ``lax.cond`` on the step's finiteness, so a
rejected step writes nothing, and a clean one updates the weights and
state in place, as plain training does.

So ``tx`` must act on each parameter on its own. ``shim`` checks this once,
by running ``tx`` on a small probe tree whole and leaf by leaf, and rejects
a transformation that needs the whole tree (``clip_by_global_norm``,
``MultiSteps``, ``apply_if_finite``) with an error instead of letting it
silently do something else.
"""

import functools
from typing import Any, NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.extend.core import Literal

from immgrad._src import commit as commit_lib


class ShimState(NamedTuple):
  """State of :func:`shim`.

  Attributes:
    inner: the params tree with each leaf replaced by that leaf's own
      ``tx`` state (``tx.init(leaf)``).
    rejected: how many steps were rejected as non-finite (int32).
  """
  inner: Any
  rejected: chex.Array


class Stepped(NamedTuple):
  """A leaf of the tree from ``immgrad.value_and_grad`` that is already done.

  ``immgrad.value_and_grad`` gives one for a parameter the step did not use
  (its old values: kept bit for bit); the shim also accepts one with new
  values computed elsewhere.

  Attributes:
    params: the parameter's new value.
    state: the parameter's new ``tx`` state.
  """
  params: chex.Array
  state: Any


@jax.tree_util.register_pytree_node_class
class ImmediateGrad:
  """A leaf of the tree from ``immgrad.value_and_grad``: a stepped gradient.

  The immediate layer that used the parameter has already stepped it with
  this gradient in the backward pass (for ``dX``, and to check the step);
  the shim commits that step.

  Attributes:
    grad: the parameter's gradient, averaged over ``axis_name``.
    nonfinite: how many immediate layer calls of the step found a
      non-finite gradient, new weight or new state (the same scalar for
      every parameter of the step), or None if the step was not checked
      (a shim with ``atomic=False``).
    layer_axes: how many leading layer axes ``immgrad.scan`` split the
      parameter over (0 for an unstacked one): the step is taken per layer.
  """

  def __init__(self, grad, nonfinite=None, layer_axes: int = 0):
    self.grad = grad
    self.nonfinite = nonfinite
    self.layer_axes = layer_axes

  def tree_flatten(self):
    return (self.grad, self.nonfinite), self.layer_axes

  @classmethod
  def tree_unflatten(cls, layer_axes, children):
    return cls(*children, layer_axes)

  def __repr__(self):
    return (f"ImmediateGrad(grad={self.grad!r}, nonfinite={self.nonfinite!r}, "
            f"layer_axes={self.layer_axes})")


class ShimTransformation(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that also knows its inner ``tx``."""

  @property
  def inner(self) -> optax.GradientTransformation:
    """The per-parameter rule that immediate layers apply."""
    return self._inner

  @property
  def atomic(self) -> bool:
    """Whether a step with any non-finite value is rejected whole."""
    return self._atomic


_NOT_SEPARABLE = (
    "immgrad.shim({name}): this transformation does not act on each "
    "parameter separately ({why}). Immediate layers step each layer as soon "
    "as its gradient exists, before the other gradients do, so a rule that "
    "needs the whole gradient tree (clip_by_global_norm, MultiSteps, "
    "apply_if_finite, ...) cannot run there. Use a per-parameter rule "
    "instead, e.g. optax.clip or optax.clip_by_block_rms for clipping.")

_WHOLE_TREE_STATES = (optax.MultiStepsState, optax.ApplyIfFiniteState)


_GENERIC = ("", "init_empty_state", "with_extra_args_support")


def _fn_name(fn) -> str:
  """The optax factory that made ``fn``, looking through generic wrappers."""
  name = getattr(fn, "__qualname__", "").split(".<locals>")[0]
  name = name.removesuffix(".init").removesuffix(".update")
  if name not in _GENERIC:
    return name
  for value in _closure(fn):
    if callable(value) and (inner := _fn_name(value)) not in _GENERIC:
      return inner
  return name


def _name(tx: optax.GradientTransformation) -> str:
  for fn in (tx.update, tx.init):
    if (name := _fn_name(fn)) not in _GENERIC:
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


def _why_not_separable(tx: optax.GradientTransformation) -> Optional[str]:
  """Why ``tx`` is not a per-parameter rule, or None if it is.

  Structural, not numerical: we trace ``tx.update`` on a two-leaf probe and
  follow the data flow. If the update of leaf ``a`` depends on any input
  that belongs to leaf ``b`` (its gradient, value or state), ``tx`` needs
  the whole tree. A numerical probe would miss a global-norm clip that
  happens not to trigger on it (after adam, say).
  """
  probe = {"a": jax.ShapeDtypeStruct((4, 3), jnp.float32),
           "b": jax.ShapeDtypeStruct((5,), jnp.float32)}
  try:
    for leaf in probe.values():
      jax.eval_shape(tx.update, leaf, jax.eval_shape(tx.init, leaf), leaf)
  except Exception as e:  # pylint: disable=broad-except
    return ("it fails on a single array; if it takes a tree shaped like "
            f"the params (a mask, labels), pass a callable instead: {e}")
  state = jax.eval_shape(tx.init, probe)
  for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(
      s, _WHOLE_TREE_STATES)):
    if isinstance(s, _WHOLE_TREE_STATES):
      return f"its state holds a {type(s).__name__}"
  closed, shapes = jax.make_jaxpr(tx.update, return_shape=True)(
      probe, state, probe)
  inputs = jax.tree_util.tree_flatten_with_path((probe, state, probe))[0]
  outputs = jax.tree_util.tree_flatten_with_path(tuple(shapes))[0]
  owner = lambda path: next((k.key for k in path if k in _PROBE_KEYS), None)
  from_a, from_b = (_tainted(closed.jaxpr, [owner(p) == k for p, _ in inputs])
                    for k in ("a", "b"))
  for (path, _), a, b in zip(outputs, from_a, from_b):
    role = "update" if path[0].idx == 0 else "state"
    if owner(path) == "a" and b or owner(path) == "b" and a:
      return (f"the {role} of one parameter depends on the gradients or "
              "state of another")
    if owner(path) is None and (a or b):
      return ("its state keeps a value computed from the parameters' "
              "gradients or state that is not per parameter (a global "
              "estimate or statistic), which a per-parameter step would "
              "compute from one parameter alone")
  return None


_PROBE_KEYS = (jax.tree_util.DictKey("a"), jax.tree_util.DictKey("b"))


def _tainted(jaxpr, tainted_inputs: list) -> list:
  """Which outputs of ``jaxpr`` depend on the tainted inputs (conservative)."""
  env = dict(zip(jaxpr.invars, tainted_inputs))
  read = lambda v: False if isinstance(v, Literal) else env.get(v, False)
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    inner = getattr(inner, "jaxpr", inner)
    if eqn.primitive.name == "cond":  # Either branch may run.
      index, operands = ins[0], ins[1:]
      branches = [_tainted(b.jaxpr, operands)
                  for b in eqn.params["branches"]]
      outs = [index or any(o) for o in zip(*branches)]
    elif inner is not None and len(inner.invars) == len(ins):
      outs = _tainted(inner, ins)
    else:  # Control flow and the rest: every output depends on every input.
      outs = [any(ins)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _parts(tx: optax.GradientTransformation) -> list:
  """The transformations ``tx`` is built from, as far as its closures say.

  Only used to name the culprit in an error; ``optax.chain`` keeps its
  parts' init and update functions in two tuples, wrappers keep the inner
  transformation itself.
  """
  found = [v for v in _closure(tx.init) + _closure(tx.update)
           if isinstance(v, optax.GradientTransformation) and v is not tx]
  tuples = [v for v in _closure(tx.init) + _closure(tx.update)
            if type(v) is tuple and v and all(map(callable, v))]  # pylint: disable=unidiomatic-typecheck
  if len(tuples) == 2 and len(tuples[0]) == len(tuples[1]):
    found += [optax.GradientTransformation(i, u) for i, u in zip(*tuples)]
  return found


def _check_separable(tx: optax.GradientTransformation) -> None:
  """Raises, naming the innermost culprit, unless ``tx`` is separable."""
  why = _why_not_separable(tx)
  if why is None:
    return
  name = culprit = _name(tx)
  parts = _parts(tx)
  while parts:
    for part in parts:
      part_why = _why_not_separable(part)
      if part_why is not None:
        culprit, why, parts = _name(part), part_why, _parts(part)
        break
    else:
      break
  if culprit != name:
    name = f"{name}: {culprit}"
  raise ValueError(_NOT_SEPARABLE.format(name=name, why=why))


def _init_leaf(tx, path, leaf):
  dtype = jnp.result_type(leaf)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"immgrad.shim: parameter {jax.tree_util.keystr(path)} has dtype "
        f"{dtype}; parameters must be real floating point arrays (keep "
        "integer or complex values out of the params tree).")
  return tx.init(leaf)


def shim(tx: optax.GradientTransformation, *,
         atomic: bool = True) -> ShimTransformation:
  """The optimizer to use with immediate layers, in place of ``tx``.

  ``init(params)`` gives every parameter its own ``tx`` state.
  ``update(grads, state, params)`` takes the tree from
  ``immgrad.value_and_grad`` and commits the step: a parameter an
  immediate layer stepped (:class:`ImmediateGrad`) gets the new weights and
  state its layer computed, a :class:`Stepped` leaf the values it holds,
  and every other leaf ``tx``'s own update. Plain gradients (from
  ``jax.grad``) train exactly as ``tx`` would.

  Atomic steps: by the time the backward pass meets a non-finite gradient,
  the layers after it have already computed their new weights. With
  ``atomic=True`` (the default) every gradient, new weight and new
  optimizer state of the step is checked (an immediate layer's in its
  backward rule, an ordinary parameter's here); if any is NaN or infinite
  the whole step is rejected: every update is ``-0.0`` (so every weight,
  ``-0.0`` included, stays bit for bit as it was), every state keeps its
  old value, and ``state.rejected`` counts the step. The commit is one
  ``lax.cond`` on that check, so a clean step updates the weights and
  state in place; what the check keeps alive is the step's gradients (as
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
      ``optax.inject_hyperparams``, chains of these).
    atomic: reject a step with any non-finite value, whole (see above).

  Returns:
    An ``optax.GradientTransformation``; pass it to
    ``immgrad.value_and_grad`` too.

  Raises:
    ValueError: if ``tx`` needs the whole gradient tree.

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
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
        f"immgrad.shim expects an optax.GradientTransformation, got {tx!r}.")
  _check_separable(tx)

  def init_fn(params):
    return ShimState(
        inner=jax.tree_util.tree_map_with_path(
            lambda path, leaf: _init_leaf(tx, path, leaf), params),
        rejected=jnp.zeros((), jnp.int32))

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError(
          "immgrad.shim: update needs params: call "
          "tx.update(grads, opt_state, params).")
    keyed, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(path) for path, _ in keyed]
    leaves = [leaf for _, leaf in keyed]
    grads = flatten_like(treedef, grads, "grads")
    old_states = flatten_like(treedef, state_of(state), "opt_state")
    for path, g, p in zip(paths, grads, leaves):
      _check_like(path, _value_of(g), p)

    def commit(path, g, s, p):
      if isinstance(g, ImmediateGrad):
        new, s = commit_lib.step_layers(tx, g.grad, s, p, g.layer_axes, path)
        return commit_lib.landing(new, p), s
      if isinstance(g, Stepped):
        return commit_lib.landing(g.params, p), g.state
      return tx.update(g, s, p)

    def keep(g, s, p):
      del g
      return jnp.full_like(p, -0.0), s

    def commit_if(ok, path, g, s, p):
      if isinstance(g, ImmediateGrad) and g.layer_axes:
        return commit_lib.commit_layers(tx, g.grad, s, p, ok, g.layer_axes,
                                        path)
      # One cond per parameter: each update's buffer lives only until it is
      # applied, where one cond for all would hold every update at once.
      return lax.cond(ok, functools.partial(commit, path), keep, g, s, p)

    rejected = state.rejected
    if atomic:
      ok = _finite(tx, paths, grads, old_states, leaves)
      committed = [commit_if(ok, *args) for args in
                   zip(paths, grads, old_states, leaves)]
      rejected = rejected + jnp.where(ok, 0, 1).astype(rejected.dtype)
    else:
      committed = [commit(*args) for args in zip(paths, grads, old_states,
                                                 leaves)]
    updates, states = zip(*committed) if committed else ((), ())
    return (treedef.unflatten(list(updates)),
            ShimState(inner=treedef.unflatten(list(states)),
                      rejected=rejected))

  result = ShimTransformation(init_fn, update_fn)
  result._inner = tx  # pylint: disable=protected-access
  result._atomic = atomic  # pylint: disable=protected-access
  return result


def _finite(tx, paths, grads, states, leaves) -> chex.Array:
  """Whether every gradient, new weight and new state of the step is finite.

  An immediate parameter's layer checked its own step in the backward pass;
  the rest are checked here.
  """
  nonfinite, checks = [], []
  for path, g, s, p in zip(paths, grads, states, leaves):
    if isinstance(g, ImmediateGrad) and g.nonfinite is not None:
      nonfinite.append(g.nonfinite)
    elif isinstance(g, ImmediateGrad):
      checks.append((g.grad, commit_lib.step_layers(tx, g.grad, s, p,
                                                    g.layer_axes, path)))
    elif isinstance(g, Stepped):
      checks.append(g)
    else:
      checks.append((g, tx.update(g, s, p)))
  ok = commit_lib.all_finite(checks)
  # One step's layers all report through the same scalar: count it once.
  for count in {id(n): n for n in nonfinite}.values():
    ok = ok & (count == 0)
  return ok


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
        "shape between value_and_grad and update?")


def state_of(state: Any) -> Any:
  """``state.inner``, or a clear error if ``state`` is not a ShimState."""
  if not isinstance(state, ShimState):
    raise TypeError(
        f"immgrad: expected the optimizer state from immgrad.shim(tx).init, "
        f"got {type(state).__name__}. Initialise it with the shim, not with "
        "the inner optax transformation.")
  return state.inner


def flatten_like(treedef, tree: Any, what: str) -> list:
  """Flattens ``tree`` up to the params structure, or a clear error."""
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"immgrad: {what} does not match the params tree ({e}). Was it made "
        "for these params (same model, same immgrad.shim)?") from e
