"""Running a traced program's wanted outputs, or a program cut from its equations."""

from typing import Any, Sequence

from jax.extend import core as jex_core

from immgrad._src.jaxpr.equation import inner
from immgrad._src.jaxpr.equation import rebind
from immgrad._src.jaxpr.slicing import needed
from immgrad._src.jaxpr.slicing import varying_env


def evaluate(
  closed: jex_core.ClosedJaxpr, args: Sequence, wanted: Sequence[bool]
) -> list:
  """The ``wanted`` outputs of ``closed``, computed from ``args`` alone.

  Args:
    closed: the program.
    args: per input, its value, or None for one not known (the wanted
      outputs must not depend on it: :func:`~immgrad._src.jaxpr.varying`).
    wanted: per output, whether to compute it.

  Returns:
    Per output, its value if wanted, else None. Only the equations the
    wanted outputs need are run; calls are looked into, to run only the
    part of them that is needed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x, y: (x * 2.0 + 1.0, x * y))(1., 1.)
    >>> evaluate(closed, [jnp.float32(3.0), None], [True, False])
    [Array(7., dtype=float32), None]
  """
  return _evaluate(closed.jaxpr, closed.consts, list(args), list(wanted))


def _evaluate(jaxpr, consts, args: list, wanted: list) -> list:
  flags = varying_env(jaxpr, [a is None for a in args])
  unknown = {v for v, b in flags.items() if b}
  outs = [v for v, w in zip(jaxpr.outvars, wanted) if w]
  plan, _ = needed(jaxpr.eqns, outs, stop=unknown)
  env = dict(zip(jaxpr.constvars, consts))
  env.update((v, a) for v, a in zip(jaxpr.invars, args) if a is not None)

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val
    return None if v in unknown else env[v]

  for eqn, used in plan:
    ins = [read(v) for v in eqn.invars]
    program = inner(eqn)
    if program is not None:
      values = _evaluate(program.jaxpr, program.consts, ins, used)
    else:
      values = rebind(eqn, ins)
    env.update((v, x) for v, x in zip(eqn.outvars, values) if x is not None)
  return [read(v) if w else None for v, w in zip(jaxpr.outvars, wanted)]


def subprogram(
  closed: jex_core.ClosedJaxpr,
  eqns: list,
  ins: list | None = None,
  outs: list | None = None,
) -> jex_core.ClosedJaxpr:
  """``closed`` with only ``eqns``, from ``ins`` to ``outs`` (its own if None).

  Example:
    >>> import jax
    >>> closed = jax.make_jaxpr(lambda x, y: (x + 1.0, y * 3.0))(1., 1.)
    >>> jaxpr = closed.jaxpr
    >>> part = subprogram(closed, jaxpr.eqns[1:], jaxpr.invars[1:],
    ...                   jaxpr.outvars[1:])
    >>> jax.extend.core.jaxpr_as_fun(part)(2.0)
    [Array(6., dtype=float32, weak_type=True)]
  """
  jaxpr = closed.jaxpr
  changes = {}
  if ins is not None or outs is not None:
    ins = list(jaxpr.invars if ins is None else ins)
    outs = list(jaxpr.outvars if outs is None else outs)
    changes = dict(
      invars=ins, outvars=outs, debug_info=_debug_info(jaxpr, ins, outs)
    )
  jaxpr = jaxpr.replace(
    eqns=eqns, effects=frozenset().union(*(e.effects for e in eqns)), **changes
  )
  return jex_core.ClosedJaxpr(jaxpr, closed.consts)


def _debug_info(jaxpr, ins, outs) -> Any | None:
  info = jaxpr.debug_info
  if info is None or not hasattr(info, "_replace"):
    return info
  names = dict(zip(jaxpr.invars, info.arg_names or ()))
  return info._replace(
    arg_names=tuple(names.get(v, "") for v in ins),
    result_paths=tuple("" for _ in outs),
  )
