"""One equation of a traced program: the program it calls, and binding it again."""

from jax.extend import core as jex_core
from jax.extend import source_info_util

from immgrad._src import compat

# Primitives that run their inner program as it is (``jax.jit`` and plain
# calls): looked into rather than bound whole.
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


def inner(eqn, names: frozenset | None = CALLS) -> jex_core.ClosedJaxpr | None:
  """The program ``eqn`` runs, if its primitive is among ``names``.

  Args:
    eqn: an equation of a jaxpr.
    names: primitive names to look into; None for any equation with an
      inner program in its ``jaxpr`` or ``call_jaxpr`` parameter.

  Returns:
    That program as a ``ClosedJaxpr``, or None.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(jax.jit(jnp.sin))(1.0)
    >>> [e.primitive.name for e in inner(closed.eqns[0]).eqns]
    ['sin']
  """
  if names is not None and eqn.primitive.name not in names:
    return None
  program = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if program is None or isinstance(program, jex_core.ClosedJaxpr):
    return program
  return jex_core.ClosedJaxpr(program, ())


def has_program(params: dict) -> bool:
  """Whether an equation's params hold an inner program (a jaxpr)."""
  programs = (jex_core.Jaxpr, jex_core.ClosedJaxpr)
  return any(
    isinstance(v, programs)
    or (
      isinstance(v, (tuple, list)) and any(isinstance(e, programs) for e in v)
    )
    for v in params.values()
  )


def rebind(eqn, values: list) -> list:
  """``eqn``'s primitive bound again on ``values``: its outputs, a list.

  Binds under the equation's own source line and context, as JAX's
  ``eval_jaxpr`` does, so that errors and metadata point at the user's code.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x, y: x * y)(2.0, 3.0)
    >>> rebind(closed.eqns[0], [jnp.float32(4.0), jnp.float32(5.0)])
    [Array(20., dtype=float32)]
  """
  subfuns, params = compat.bind_params(eqn.primitive, eqn.params)
  with (
    source_info_util.user_context(eqn.source_info.traceback),
    eqn.ctx.manager,
  ):
    out = eqn.primitive.bind(*subfuns, *values, **params)
  return list(out) if eqn.primitive.multiple_results else [out]
