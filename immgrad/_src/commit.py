"""Stepping a parameter, and writing the whole step in place.

A parameter is stepped twice from the same values, in its layer's backward
rule and by the shim once the step is known to be finite:
:func:`step_parameter` is that one computation, :class:`Commit` the shim's
commit (``docs/design.md``, "Committing a step").
"""

import math
from typing import Any

import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from immgrad._src import plan as plan_lib
from immgrad._src import stacked
from immgrad._src.base import ImmediateGrad
from immgrad._src.base import Stepped


def step_parameter(program: plan_lib.LeafProgram, grad, state, weights):
  """One parameter's new weights and owned state, by its ``program``.

  ``state`` holds the state leaves the program reads; the new state those
  it writes (``plan.LeafProgram``).
  """
  update, state = program(grad, weights, state)
  return optax.apply_updates(weights, update), state


def layer_programs(
  tx, params, plan, index: int, stacks: dict[int, int], state, path: str
) -> list:
  """Per layer axis of stacked parameter ``index``: program, state split.

  ``[(program, split), ...]`` from the whole stack inwards: ``program`` is
  the parameter's at that depth, ``split`` how the state it reads splits
  for the next depth in (``stacked.state_axes``); the innermost has no
  split. ``plan`` is ``tx``'s cut for ``params`` (the programs of the
  whole stacks). ``stacks`` holds the layer axes of every immediate
  parameter (0: not stacked); the stacked ones are sliced alike at each
  depth (``plan.sliced``).
  """
  programs = [plan.leaves[index]] + [
    plan_lib.sliced(
      tx, params, {k: depth for k, axes in stacks.items() if axes >= depth}
    ).leaves[index]
    for depth in range(1, stacks[index] + 1)
  ]
  out, avals = (
    [],
    [jax.ShapeDtypeStruct(jnp.shape(s), jnp.result_type(s)) for s in state],
  )
  for outer, inner in zip(programs, programs[1:]):
    split = stacked.state_axes(outer, inner, avals, plan.shared_positions, path)
    out.append((outer, split))
    avals = [
      a if axis is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
      for a, axis in zip(avals, split)
    ]
  return out + [(programs[-1], None)]


def step_layers(levels: list, grad, state, weights):
  """:func:`step_parameter` one layer at a time, over ``levels`` (above).

  Each layer of a stacked parameter is stepped by the program its
  backward rule ran (which ``stacked.state_axes`` checked is the stack's
  step on that layer).
  """
  (program, split), rest = levels[0], levels[1:]
  if not rest:
    return step_parameter(program, grad, state, weights)
  return jax.vmap(
    lambda g, s, w: step_layers(rest, g, s, w),
    in_axes=(0, split, 0),
    out_axes=0,
  )(grad, state, weights)


def landing(new: chex.Array, param: jax.Array) -> jax.Array:
  """The update that ``optax.apply_updates`` turns ``param`` into ``new`` by.

  ``-0.0`` where they are equal, so that ``param + update`` is ``param``
  bit for bit (``-0.0`` and infinities included).
  """
  return jnp.where(new == param, jnp.asarray(-0.0, param.dtype), new - param)


def commit_layers(levels: list, grad, state, old_writes, weights, ok):
  """The update and new owned state of a stacked parameter, or none.

  A loop over the layers, each layer's step under its own ``lax.cond``:
  layer ``i``'s update is written over its gradient slice and its new state
  over its old state slice (``state`` holds what the program reads,
  ``old_writes`` the old values of what it writes), so no second buffer
  the size of the stack is made. Returns what :func:`landing` and
  :func:`step_layers` would, or ``-0.0`` updates and ``old_writes`` where
  ``ok`` is false.
  """
  (program, split), rest = levels[0], levels[1:]
  # One loop-carried buffer per sliced state leaf, read or written: a leaf
  # both read and written must be one buffer, or XLA copies it.
  buffers = {
    k: s for k, s, axis in zip(program.reads, state, split) if axis == 0
  }
  for k, old in zip(program.writes, old_writes):
    buffers.setdefault(k, old)
  shared = {
    k: s for k, s, axis in zip(program.reads, state, split) if axis is None
  }

  def step(grad, reads, weights, _):
    new, written = step_layers(rest, grad, reads, weights)
    return landing(new, weights), list(written)

  def keep(grad, reads, weights, old):
    del grad, reads
    return jnp.full_like(weights, -0.0), old

  def body(i, carry):
    grad, buffers = carry
    # A shared leaf is read whole: every layer steps from the same value.
    reads = [
      buffers[k][i] if k in buffers else shared[k] for k in program.reads
    ]
    old = [buffers[k][i] for k in program.writes]
    update, new = lax.cond(ok, step, keep, grad[i], reads, weights[i], old)
    buffers = dict(buffers)
    for k, value in zip(program.writes, new):
      buffers[k] = buffers[k].at[i].set(value)
    return grad.at[i].set(update), buffers

  updates, buffers = lax.fori_loop(
    0, jnp.shape(weights)[0], body, (grad, buffers)
  )
  return updates, [buffers[k] for k in program.writes]


class Commit:
  """The shim's commit of one step: each parameter's update and new state.

  ``tx`` on ``params``, cut into per-parameter programs by ``plan``
  (``plan.py``), for the flat ``grads``; ``paths`` name the params' leaves
  in errors.
  """

  def __init__(self, tx, params, plan: plan_lib.Plan, paths: list, grads):
    self.tx, self.params, self.plan, self.paths = tx, params, plan, paths
    self.grads = grads
    self.stacks = {  # The layer axes of each immediate parameter (or 0).
      i: g.layer_axes
      for i, g in enumerate(grads)
      if isinstance(g, ImmediateGrad)
    }

  def commit(self, old: list, atomic: bool):
    """``(updates, new state leaves, ok)``.

    ``old`` holds ``tx``'s state leaves. With ``atomic``, ``ok`` is whether
    the whole step is finite, and a step that is not writes ``-0.0``
    updates and the old state; else ``ok`` is None.
    """
    plan, leaves, grads = self.plan, jax.tree.leaves(self.params), self.grads
    parts = [[old[k] for k in leaf.reads] for leaf in plan.leaves]
    shared_old = [old[k] for k in plan.shared_positions]
    shared = list(plan.shared(*shared_old))
    args = list(enumerate(zip(grads, parts, leaves)))
    ok = None
    if atomic:
      ok = self._finite(grads, parts, leaves, shared)
      committed = [self._commit_if(ok, i, *a, old) for i, a in args]
      shared = select(ok, shared, shared_old)
    else:
      committed = [self._step(i, *a, old) for i, a in args]
    new = list(old)
    for program, (_, writes) in zip(plan.leaves, committed):
      for k, value in zip(program.writes, writes):
        new[k] = value
    for k, value in zip(plan.shared_positions, shared):
      new[k] = value
    return [update for update, _ in committed], new, ok

  def _levels(self, i: int, s: list) -> list:
    return layer_programs(
      self.tx, self.params, self.plan, i, self.stacks, s, self.paths[i]
    )

  def _step(self, i, g, s, p, old):
    """Parameter ``i``'s update and the state leaves its program writes."""
    program = self.plan.leaves[i]
    if isinstance(g, ImmediateGrad):
      new, s = step_layers(self._levels(i, s), g.grad, s, p)
      return landing(new, p), list(s)
    if isinstance(g, Stepped):
      kept = [old[k] for k in program.writes]
      return landing(g.params, p), kept if g.state is None else list(g.state)
    update, s = program(g, p, s)
    return update, list(s)

  def _keep(self, i, p, old):
    writes = self.plan.leaves[i].writes
    return jnp.full_like(p, -0.0), [old[k] for k in writes]

  def _commit_if(self, ok, i, g, s, p, old):
    """:meth:`_step` if ``ok``, else :meth:`_keep`, by backend."""
    if by_select():
      return select(ok, self._step(i, g, s, p, old), self._keep(i, p, old))
    if isinstance(g, ImmediateGrad) and g.layer_axes:
      writes = [old[k] for k in self.plan.leaves[i].writes]
      return commit_layers(self._levels(i, s), g.grad, s, writes, p, ok)
    # One cond per parameter: each update's buffer lives only until it is
    # applied, where one cond for all would hold every update at once.
    return lax.cond(
      ok,
      lambda g, s, p: self._step(i, g, s, p, old),
      lambda g, s, p: self._keep(i, p, old),
      g,
      s,
      p,
    )

  def _finite(self, grads, parts, leaves, shared) -> jax.Array:
    """Whether every gradient, new weight and new state is finite.

    An immediate parameter's layer checked its own step in the backward
    pass; the rest are checked here, and ``shared``, the new state shared
    by all.
    """
    nonfinite, checks = [], [shared]
    for i, (g, s, p) in enumerate(zip(grads, parts, leaves)):
      if isinstance(g, ImmediateGrad) and g.nonfinite is not None:
        nonfinite.append(g.nonfinite)
      elif isinstance(g, ImmediateGrad):
        checks.append((g.grad, step_layers(self._levels(i, s), g.grad, s, p)))
      elif isinstance(g, Stepped):
        checks.append(g)
      else:
        checks.append((g, self.plan.leaves[i](g, p, s)))
    ok = all_finite(checks)
    # One step's layers all report through the same scalar: count it once.
    for count in {id(n): n for n in nonfinite}.values():
      ok = ok & (count == 0)
    return ok


def by_select() -> bool:
  """Whether atomic commits select (an accelerator) or branch (the CPU).

  On a TPU or GPU a commit is elementwise, ``where(ok, new, old)``, which
  XLA fuses with the step and ``optax.apply_updates`` into one pass over
  the weights and state, written in place; a ``lax.cond`` per leaf there
  blocks that fusion and moves about twice the bytes (docs/devlog.md). On the
  CPU the conds keep the peak memory low (``docs/design.md``): XLA's CPU
  scheduler computes the selected values before it frees the old ones. The
  choice follows ``jax.default_backend()``, where a step runs unless it is
  placed elsewhere.
  """
  return jax.default_backend() != "cpu"


def select(ok, new, old):
  """``new`` where ``ok``, else ``old``, leaf by leaf (``ok`` a bool)."""
  return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def all_finite(tree: Any) -> jax.Array:
  """Whether every float value in ``tree`` is finite, as one bool.

  With as few reductions as the shapes allow: arrays of one shape and
  sharding (a weight, its gradient, its moments) are checked together, and
  so are those that broadcast to a larger one without a sharding conflict
  (a bias to its weight). XLA compiles each reduction on its own, and a
  reduction per array made the check most of an atomic step's compile
  time. Under a mesh with ``Explicit`` axes, arrays sharded differently
  are never combined elementwise, which JAX would refuse.
  """
  groups = {}  # (shape, sharding) -> the elementwise "is finite".
  for x in jax.tree.leaves(tree):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      key = (jnp.shape(x), _spec(x))
      finite = jnp.isfinite(x)
      groups[key] = finite if key not in groups else groups[key] & finite
  checks = []
  for key in sorted(groups, key=lambda k: math.prod(k[0]), reverse=True):
    if key not in groups:  # Merged into a larger array's check already.
      continue
    finite = groups.pop(key)
    for small in [k for k in groups if _broadcasts(k, key)]:
      finite = finite & groups.pop(small)
    checks.append(jnp.all(finite))
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _spec(x) -> tuple:
  """``x``'s explicit sharding, one entry per axis (None: not sharded).

  Only axes of an ``Explicit`` mesh appear in an array's type; under an
  ``Auto`` mesh, or none, every entry is None.
  """
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  spec = tuple(spec or ())
  return spec + (None,) * (jnp.ndim(x) - len(spec))


def _broadcasts(small: tuple, big: tuple) -> bool:
  """Whether array ``small`` ANDs into ``big``, both ``(shape, spec)``.

  The result must have ``big``'s shape and sharding: each of ``small``'s
  axes is unsharded or sharded as ``big``'s axis it lines up with.
  """
  (small_shape, small_spec), (big_shape, big_spec) = small, big
  try:
    if np.broadcast_shapes(small_shape, big_shape) != big_shape:
      return False
  except ValueError:
    return False
  aligned = big_spec[len(big_spec) - len(small_spec) :]
  return all(s is None or s == b for s, b in zip(small_spec, aligned))
