"""What differs between the JAX releases immgrad supports (jax >= 0.7.0).

Each difference is here, once, with the release that changed it; no other
module looks at JAX's version.
"""

from typing import Any

import jax
from jax import lax

JAX_VERSION = tuple(jax.__version_info__[:3])

# jax 0.10.0 added it to jax.extend.core (and deprecated jax.core's).
if JAX_VERSION >= (0, 10, 0):
  from jax.extend.core import get_opaque_trace_state
else:
  from jax.core import get_opaque_trace_state  # noqa: F401


def varying_axes(x: Any) -> frozenset:
  """The mesh axes ``x`` varies over, inside ``shard_map(check_vma=True)``.

  jax 0.10.0 replaced the aval's ``vma`` set by ``manual_axis_type``.
  """
  aval = jax.typeof(x)
  if JAX_VERSION >= (0, 10, 0):
    return aval.manual_axis_type.varying
  return aval.vma


def to_varying(x: jax.Array, axis_names: tuple) -> jax.Array:
  """``x``, cast to vary over ``axis_names`` (its gradient stays local).

  jax 0.8.2 added ``lax.pcast`` and deprecated ``lax.pvary`` (removed in
  0.10.0).
  """
  if JAX_VERSION >= (0, 8, 2):
    return lax.pcast(x, axis_names, to="varying")
  # Removed in jax 0.10.0, so the installed jax's stubs may lack it.
  return lax.pvary(x, axis_names)  # pyright: ignore[reportAttributeAccessIssue]


def checkpoint_options(static_argnames) -> dict:
  """``jax.checkpoint``'s ``static_argnames``, where JAX has it (0.10.2)."""
  if not static_argnames:
    return {}
  if JAX_VERSION < (0, 10, 2):
    raise TypeError(
      "immgrad.checkpoint(static_argnames=...) needs jax >= 0.10.2 (jax "
      f"{jax.__version__} is installed); pass those arguments by position "
      "with static_argnums instead."
    )
  return {"static_argnames": static_argnames}


def dce_rules() -> dict:
  """JAX's dead-code rules for equations with inner programs (by primitive).

  Private in every release we support (``partial_eval.dce_rules``, each
  ``rule(used_outputs, eqn) -> (used_inputs, eqn or None)``);
  ``jaxpr.needed`` uses them for ``plan.py``, to cut a ``cond`` over the
  whole tree down to one parameter's outputs.
  """
  from jax._src.interpreters import partial_eval

  return partial_eval.dce_rules


def bind_params(primitive, params: dict) -> tuple:
  """``(subfuns, params)`` to bind an equation's primitive again.

  Newer releases (0.10) return the params alone from ``get_bind_params``;
  older ones a pair with the subfunctions of call primitives.
  """
  out = primitive.get_bind_params(params)
  return out if isinstance(out, tuple) else ((), out)
