"""Which values a program's inputs reach, and which equations its outputs need."""

from collections.abc import Callable, Container, Sequence
import functools
import operator

from jax.extend import core as jex_core

from immgrad._src import compat
from immgrad._src.jaxpr.equation import inner


def label(env: dict, v, bottom: bool | int = False):
  """The label :func:`reach` gave ``v`` (``bottom`` for literals, constants)."""
  if isinstance(v, jex_core.Literal):
    return bottom
  return env.get(v, bottom)


def reach(
  jaxpr: jex_core.Jaxpr,
  labels: Sequence,
  rule: Callable | None = None,
  bottom: bool | int = False,
) -> dict:
  """Labels every value of ``jaxpr`` with the inputs it depends on.

  Args:
    jaxpr: the program.
    labels: per input, its label: a bool or an int bit set, joined by ``|``.
    rule: ``rule(eqn, input labels)`` -> the labels of its outputs, or None
      for the default: each output gets the join of the inputs' labels.
    bottom: the label of literals, constants and the join of nothing.

  Returns:
    The labels, by variable; read them with :func:`label`.

  Example:
    >>> import jax
    >>> f = lambda a, b, c: (a * b, c + 1.0, a)
    >>> jaxpr = jax.make_jaxpr(f)(1.0, 2.0, 3.0).jaxpr
    >>> env = reach(jaxpr, [1, 2, 4], bottom=0)
    >>> [label(env, v, 0) for v in jaxpr.outvars]
    [3, 4, 1]
  """
  env = dict(zip(jaxpr.invars, labels))
  for eqn in jaxpr.eqns:
    ins = [label(env, v, bottom) for v in eqn.invars]
    outs = rule(eqn, ins) if rule is not None else None
    if outs is None:
      outs = [functools.reduce(operator.or_, ins, bottom)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return env


def varying(jaxpr: jex_core.Jaxpr, varying_in: Sequence[bool]) -> list[bool]:
  """Per output of ``jaxpr``: whether it may change with the inputs flagged.

  Calls (``jax.jit`` inside, as in ``jnp.where``) are looked into, since one
  call often returns both kinds; an equation with effects (a callback) is
  always flagged, so that nothing it does is taken as fixed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, k: (x * k, jnp.ones(3) * k)
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones(3), 2.0).jaxpr
    >>> varying(jaxpr, [True, False])
    [True, False]
  """
  env = varying_env(jaxpr, varying_in)
  return [label(env, v) for v in jaxpr.outvars]


def varying_env(jaxpr: jex_core.Jaxpr, varying_in: Sequence[bool]) -> dict:
  """:func:`varying` for every value of ``jaxpr``, by variable."""
  return reach(jaxpr, list(varying_in), _varying_rule)


def _varying_rule(eqn, ins: list) -> list | None:
  if eqn.effects:
    return [True] * len(eqn.outvars)
  program = inner(eqn)
  return None if program is None else varying(program.jaxpr, ins)


def needed(
  eqns: Sequence,
  outs: Sequence,
  *,
  stop: Container = frozenset(),
  effects: bool = False,
  prune: bool = False,
) -> tuple[list, set]:
  """The equations of ``eqns`` that the variables ``outs`` need.

  Args:
    eqns: equations in program order.
    outs: the variables wanted (literals are skipped).
    stop: variables not followed back (their values come from elsewhere).
    effects: keep the equations with effects even where nothing uses them.
    prune: cut an equation with an inner program (a ``cond``) down to the
      outputs used, by JAX's own dead-code rules.

  Returns:
    ``[(eqn, used)]`` in program order, ``used`` saying which of the
    equation's outputs are needed; and every variable needed (``outs`` and
    the inputs of the equations kept, less ``stop``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> jaxpr = jax.make_jaxpr(lambda x, y: (jnp.sin(x), y * 2.0))(1., 2.).jaxpr
    >>> kept, _ = needed(jaxpr.eqns, jaxpr.outvars[1:])
    >>> [(e.primitive.name, used) for e, used in kept]
    [('mul', [True])]
  """
  wanted = {v for v in outs if not isinstance(v, jex_core.Literal)}
  kept = []
  for eqn in reversed(eqns):
    used = [v in wanted for v in eqn.outvars]
    if not any(used) and not (effects and eqn.effects):
      continue
    rule = compat.dce_rules().get(eqn.primitive) if prune else None
    if rule is not None and not all(used):
      _, eqn = rule(used, eqn)
      if eqn is None:
        continue
    kept.append((eqn, used))
    wanted.update(
      v
      for v in eqn.invars
      if not isinstance(v, jex_core.Literal) and v not in stop
    )
  return kept[::-1], wanted
