"""Values a loop body makes that are the same in every iteration.

``immgrad.scan``'s forward loop would stack such a residual once per layer
(an attention mask broadcast to the batch and heads); as JAX's own
``lax.scan`` differentiation does, :func:`varying` finds them and
:func:`evaluate` computes them once, outside the loop.
"""

from typing import Sequence

from jax.extend import core as jex_core
from jax.extend import source_info_util

from immgrad._src import compat

_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def varying(jaxpr: jex_core.Jaxpr, varying_in: Sequence[bool]) -> list[bool]:
  """Per output of ``jaxpr``: whether it may change with the inputs flagged.

  Calls (``jax.jit`` inside the body, as in ``jnp.where`` and ``jnp.var``) are
  looked into, since one call often returns both kinds. Any other equation is
  fixed only if all its inputs are, and one with effects (a callback, a print)
  never is, so that nothing the body does is repeated outside the loop.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, k: (x * k, jnp.ones(3) * k)
    >>> jaxpr = jax.make_jaxpr(f)(jnp.ones(3), 2.0).jaxpr
    >>> varying(jaxpr, [True, False])
    [True, False]
  """
  flagged = _varying_vars(jaxpr, varying_in)
  return [_is_in(v, flagged) for v in jaxpr.outvars]


def evaluate(
  closed: jex_core.ClosedJaxpr, args: Sequence, wanted: Sequence[bool]
) -> list:
  """The ``wanted`` outputs of ``closed``, computed from ``args`` alone.

  Args:
    closed: the program.
    args: per input, its value, or None for one that varies (the wanted
      outputs must not depend on it: :func:`varying`).
    wanted: per output, whether to compute it.

  Returns:
    Per output, its value if wanted, else None. Only the equations the
    wanted outputs need are run.
  """
  return _evaluate_needed(closed.jaxpr, closed.consts, list(args), list(wanted))


def _is_in(v, flagged: set) -> bool:
  return not isinstance(v, jex_core.Literal) and v in flagged


def _inner(eqn) -> jex_core.ClosedJaxpr | None:
  """The program a call equation runs; None for any other equation."""
  if eqn.primitive.name not in _CALLS:
    return None
  inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if isinstance(inner, jex_core.ClosedJaxpr):
    return inner
  return jex_core.ClosedJaxpr(inner, ())


def _varying_vars(jaxpr: jex_core.Jaxpr, varying_in: Sequence[bool]) -> set:
  flagged = {v for v, b in zip(jaxpr.invars, varying_in) if b}
  for eqn in jaxpr.eqns:
    ins = [_is_in(v, flagged) for v in eqn.invars]
    inner = _inner(eqn)
    if eqn.effects:
      outs = [True] * len(eqn.outvars)
    elif inner is not None:
      outs = varying(inner.jaxpr, ins)
    else:
      outs = [any(ins)] * len(eqn.outvars)
    flagged.update(v for v, b in zip(eqn.outvars, outs) if b)
  return flagged


def _evaluate_needed(jaxpr, consts, args: list, wanted: list) -> list:
  flagged = _varying_vars(jaxpr, [a is None for a in args])
  # Backwards: the equations the wanted outputs need, and which of each
  # equation's outputs are needed.
  needed = {
    v
    for v, w in zip(jaxpr.outvars, wanted)
    if w and not isinstance(v, jex_core.Literal)
  }
  plan = []
  for eqn in reversed(jaxpr.eqns):
    outs = [v in needed for v in eqn.outvars]
    if any(outs):
      plan.append((eqn, outs))
      needed.update(
        v
        for v in eqn.invars
        if not isinstance(v, jex_core.Literal) and v not in flagged
      )
  env = dict(zip(jaxpr.constvars, consts))
  env.update((v, a) for v, a in zip(jaxpr.invars, args) if a is not None)

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val
    return None if v in flagged else env[v]

  for eqn, outs in reversed(plan):
    ins = [read(v) for v in eqn.invars]
    inner = _inner(eqn)
    if inner is not None:
      values = _evaluate_needed(inner.jaxpr, inner.consts, ins, outs)
    else:
      values = _bind(eqn, ins)
    env.update((v, x) for v, x in zip(eqn.outvars, values) if x is not None)
  return [read(v) if w else None for v, w in zip(jaxpr.outvars, wanted)]


def _bind(eqn, values: list) -> list:
  subfuns, params = compat.bind_params(eqn.primitive, eqn.params)
  with (
    source_info_util.user_context(eqn.source_info.traceback),
    eqn.ctx.manager,
  ):
    out = eqn.primitive.bind(*subfuns, *values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]
