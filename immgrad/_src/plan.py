"""One parameter's step, cut out of ``tx.update`` on the whole params tree.

An immediate layer steps its parameters before the other gradients exist,
so the shim traces ``tx.update`` once on the whole params tree and cuts it
into one program per parameter and one for the shared state
(``docs/design.md``, "Each parameter's step").
"""

import dataclasses
import functools
import operator
from typing import Any, Sequence

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp

from immgrad._src import jaxpr as jaxpr_lib
from immgrad._src import refusal

_SHARED = -1  # Owner of a state leaf that belongs to no parameter.


class NotSeparable(ValueError):
  """``tx`` has no per-parameter cut; the message says why."""


@dataclasses.dataclass(frozen=True)
class LeafProgram:
  """One parameter's step: ``(grad, param, *state) -> (update, *state)``,
  the program ``jaxpr``.

  ``reads`` are the positions (in the flattened optax state) of the state
  leaves it takes, in order; ``writes`` those it returns new values for,
  all owned by this parameter. ``read_avals`` and ``write_avals`` are their
  shapes and dtypes; ``param_aval`` the parameter's (and its gradient's).
  """

  jaxpr: jax_core.ClosedJaxpr
  reads: tuple
  writes: tuple
  read_avals: tuple
  write_avals: tuple
  param_aval: jax.ShapeDtypeStruct

  def __call__(self, grad, param, state: Sequence[jax.Array]):
    update, *new = jax_core.jaxpr_as_fun(self.jaxpr)(grad, param, *state)
    return update, new


@dataclasses.dataclass(frozen=True)
class Plan:
  """The cut of ``tx.update`` for one params tree (shapes and dtypes)."""

  leaves: tuple  # One LeafProgram per parameter leaf.
  shared: Any  # (*shared old state) -> shared new state.
  shared_positions: tuple  # Where the shared state leaves are.
  state_def: Any  # The treedef of the optax state.
  state_avals: tuple  # Its leaves' shapes and dtypes.


def _aval(x) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def make(tx, params: Any) -> Plan:
  """The cut of ``tx`` for ``params`` (arrays or shapes), or NotSeparable.

  The state is the one ``tx.init`` makes for ``params``, in optax's layout.
  """
  params = jax.tree.map(_aval, params)
  return _make(tx, jax.tree.structure(params), tuple(jax.tree.leaves(params)))


def cut(tx, params: Any) -> Plan:
  """:func:`make`, or a ``ValueError`` that names the part of ``tx`` at
  fault and the fix (worded by ``refusal.py``).
  """
  try:
    return make(tx, params)
  except NotSeparable as e:
    raise refusal.not_separable(tx, params, e, _why_not, runs_on) from e
  except Exception as e:
    raise refusal.fails_on(tx, params, e, runs_on) from e


_PROBE = {
  "a": jax.ShapeDtypeStruct((4, 3), jnp.float32),
  "b": jax.ShapeDtypeStruct((5,), jnp.float32),
}


def check(tx) -> None:
  """Refuses ``tx`` early, on a probe tree, if it shows ``tx`` mixes leaves.

  A ``tx`` that needs the params' own tree (a mask shaped like them) does
  not run on the probe: it is checked at ``init``, on the real params.
  """
  if runs_on(tx, _PROBE):
    cut(tx, _PROBE)


def runs_on(tx, params: Any) -> bool:
  """Whether ``tx`` runs at all on a tree shaped like ``params``."""
  try:
    state = jax.eval_shape(tx.init, params)
    jax.eval_shape(tx.update, params, state, params)
  except Exception:
    return False
  return True


def _why_not(tx, params: Any) -> str | None:
  """Why ``tx`` has no per-parameter cut for ``params``, or None.

  Structural, not numerical (the cut follows the data flow): a numerical
  probe would miss a global-norm clip that happens not to trigger on it
  (after adam, say).
  """
  try:
    make(tx, params)
  except NotSeparable as e:
    return str(e)
  return None


def sliced(tx, params: Any, layer_axes: dict[int, int]) -> Plan:
  """The cut of ``tx`` for ``params`` with stacked leaves sliced.

  Leaf ``k`` of ``layer_axes`` is one layer's slice, ``layer_axes[k]``
  axes in (``immgrad.scan``): its program is the step that layer takes,
  as if unrolled (``stacked.state_axes`` refuses it where that is not the
  stack's step). All the stacked leaves of a scan share one cut, which
  traces ``tx`` once for them all.
  """
  leaves, treedef = jax.tree.flatten(jax.tree.map(_aval, params))
  for k, axes in layer_axes.items():
    leaves[k] = jax.ShapeDtypeStruct(leaves[k].shape[axes:], leaves[k].dtype)
  return make(tx, treedef.unflatten(leaves))


@functools.lru_cache(maxsize=64)
def _make(tx, params_def, param_avals) -> Plan:
  """:func:`make`, once per ``tx`` and params shapes (a step asks again for
  each stacked parameter).
  """
  params = params_def.unflatten(param_avals)
  state = jax.eval_shape(tx.init, params)
  state_def, state_avals = (
    jax.tree.structure(state),
    tuple(jax.tree.leaves(state)),
  )
  with jax.disable_jit():
    closed, out_shape = jax.make_jaxpr(tx.update, return_shape=True)(
      params, state, params
    )
  jaxpr = closed.jaxpr
  n, m = len(param_avals), len(state_avals)
  updates, new_state = out_shape
  if (
    jax.tree.structure(updates) != params_def
    or jax.tree.structure(new_state) != state_def
  ):
    raise NotSeparable(
      "its update returns a tree not shaped like the params, or a state "
      "not shaped like its init"
    )
  grad_in, state_in = jaxpr.invars[:n], jaxpr.invars[n : n + m]
  param_in = jaxpr.invars[n + m :]
  update_out, state_out = jaxpr.outvars[:n], jaxpr.outvars[n:]

  # Which parameters' gradients and values each new state leaf depends on.
  bits = [1 << i for i in range(n)]
  first = _taint(jaxpr, bits + [0] * m + bits)
  owner = []
  for b in first[n:]:
    if b and b & (b - 1):
      raise NotSeparable(
        "its state keeps a value computed from the gradients or values of "
        "several parameters (a global estimate or statistic), which a "
        "per-parameter step would compute from one parameter alone"
      )
    owner.append(b.bit_length() - 1 if b else _SHARED)
  # Now with each state leaf tainted by its owner: nothing may cross.
  owned = [0 if o == _SHARED else 1 << o for o in owner]
  second = _taint(jaxpr, bits + owned + bits)
  for i, b in enumerate(second[:n]):
    if b & ~bits[i]:
      raise NotSeparable(
        "the update of one parameter depends on the "
        "gradients, values or state of another"
      )
  for k, b in enumerate(second[n:]):
    if b & ~owned[k]:
      raise NotSeparable(
        "the new state of one parameter (or the state shared by all) "
        "depends on the gradients, values or state of another"
      )

  leaves = []
  for i in range(n):
    writes = tuple(k for k in range(m) if owner[k] == i)
    outs = [update_out[i]] + [state_out[k] for k in writes]
    kept, used = _slice(closed, outs)
    reads = tuple(k for k in range(m) if state_in[k] in used)
    ins = [grad_in[i], param_in[i]] + [state_in[k] for k in reads]
    leaves.append(
      LeafProgram(
        jaxpr_lib.subprogram(closed, kept, ins, outs),
        reads,
        writes,
        tuple(state_avals[k] for k in reads),
        tuple(state_avals[k] for k in writes),
        param_avals[i],
      )
    )
  shared_positions = tuple(k for k in range(m) if owner[k] == _SHARED)
  shared_outs = [state_out[k] for k in shared_positions]
  kept, _ = _slice(closed, shared_outs)
  shared_in = [state_in[k] for k in shared_positions]
  shared = jax_core.jaxpr_as_fun(
    jaxpr_lib.subprogram(closed, kept, shared_in, shared_outs)
  )
  return Plan(tuple(leaves), shared, shared_positions, state_def, state_avals)


def _taint(jaxpr, inputs: list) -> list:
  """Per output of ``jaxpr``, the OR of the bit sets of inputs it uses.

  Exact through calls and per branch of a ``cond``; any other equation
  with an inner program (loops) is taken to mix all its inputs.
  """
  env = jaxpr_lib.reach(jaxpr, inputs, _taint_rule, bottom=0)
  return [jaxpr_lib.label(env, v, 0) for v in jaxpr.outvars]


def _taint_rule(eqn, ins: list) -> list | None:
  """:func:`_taint` of a ``cond`` or a call; None: mixes all its inputs."""
  if eqn.primitive.name == "cond":  # Either branch may run.
    index, operands = ins[0], ins[1:]
    branches = [_taint(b.jaxpr, operands) for b in eqn.params["branches"]]
    return [functools.reduce(operator.or_, o, index) for o in zip(*branches)]
  inner = jaxpr_lib.inner(eqn, names=None)
  if inner is not None and len(inner.jaxpr.invars) == len(ins):
    return _taint(inner.jaxpr, ins)
  return None


def _slice(closed, outs: list) -> tuple[list, set]:
  """The equations of ``closed`` that ``outs`` need, and the vars they read.

  An equation with an inner program (a ``cond`` over the whole tree, say)
  is cut down to the outputs needed, by JAX's own dead-code rules; one
  with effects is kept.
  """
  kept, needed = jaxpr_lib.needed(
    closed.jaxpr.eqns, outs, effects=True, prune=True
  )
  return [eqn for eqn, _ in kept], needed
