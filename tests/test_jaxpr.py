"""The program-analysis package (``immgrad._src.jaxpr``) on small programs.

Each program is ``jax.make_jaxpr`` of a tiny function; numbers are checked
against the function itself (exact: the same primitives on the same
inputs), equation sets against what the function plainly computes.
"""

import jax
from jax import lax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np

from immgrad._src import jaxpr as jaxpr_lib


def _names(eqns) -> list:
  return [e.primitive.name for e in eqns]


def test_rebind_reruns_every_equation_to_the_function_s_value():
  def f(x, y):
    return jnp.sin(x) * y + 1.0

  x, y = jnp.float32(0.3), jnp.float32(2.0)
  closed = jax.make_jaxpr(f)(x, y)
  env = dict(zip(closed.jaxpr.invars, [x, y]))
  read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
  for eqn in closed.jaxpr.eqns:
    out = jaxpr_lib.rebind(eqn, [read(v) for v in eqn.invars])
    env.update(zip(eqn.outvars, out))
  assert read(closed.jaxpr.outvars[0]) == f(x, y)


def test_rebind_returns_a_list_for_a_primitive_with_several_results():
  keys, values = jnp.array([3.0, 1.0, 2.0]), jnp.array([30.0, 10.0, 20.0])
  closed = jax.make_jaxpr(lambda k, v: lax.sort((k, v), num_keys=1))(
    keys, values
  )
  (eqn,) = closed.jaxpr.eqns
  out = jaxpr_lib.rebind(eqn, [keys, values])
  np.testing.assert_array_equal(out[0], [1.0, 2.0, 3.0])
  np.testing.assert_array_equal(out[1], [10.0, 20.0, 30.0])


def test_inner_finds_a_jit_call_s_program_and_only_calls_by_default():
  closed = jax.make_jaxpr(lambda x: jax.jit(jnp.cos)(x) * 2.0)(1.0)
  call, mul = closed.jaxpr.eqns
  assert _names(jaxpr_lib.inner(call).eqns) == ["cos"]
  assert jaxpr_lib.inner(mul) is None
  remat = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).jaxpr.eqns[0]
  assert jaxpr_lib.inner(remat) is None  # Not a plain call.
  assert _names(jaxpr_lib.inner(remat, names=None).eqns) == ["sin"]
  assert jaxpr_lib.has_program(remat.params)
  assert not jaxpr_lib.has_program(mul.params)


def test_reach_joins_the_inputs_bit_sets_and_takes_a_rule():
  def f(a, b, c):
    return a * b, jnp.sin(c), a + 1.0

  jaxpr = jax.make_jaxpr(f)(1.0, 2.0, 3.0).jaxpr
  env = jaxpr_lib.reach(jaxpr, [1, 2, 4], bottom=0)
  assert [jaxpr_lib.label(env, v, 0) for v in jaxpr.outvars] == [3, 4, 1]

  def no_sin(eqn, ins):  # A rule: `sin` forgets where its input came from.
    return [0] if eqn.primitive.name == "sin" else None

  env = jaxpr_lib.reach(jaxpr, [1, 2, 4], no_sin, bottom=0)
  assert [jaxpr_lib.label(env, v, 0) for v in jaxpr.outvars] == [3, 0, 1]


def test_varying_looks_into_calls_and_flags_effects():
  @jax.jit
  def both(x, k):  # One call returning a varying and a fixed value.
    return x * k, k + 1.0

  def f(x, k):
    fixed = io_callback(
      lambda: np.float32(1.0), jax.ShapeDtypeStruct((), jnp.float32)
    )
    return (*both(x, k), fixed)

  jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
  assert jaxpr_lib.varying(jaxpr, [True, False]) == [True, False, True]
  assert jaxpr_lib.varying(jaxpr, [False, False]) == [False, False, True]


def test_needed_slices_backward_and_stops_where_told():
  def f(x, y):
    a = jnp.sin(x)
    b = jnp.cos(y)
    return a, b * 2.0

  jaxpr = jax.make_jaxpr(f)(1.0, 2.0).jaxpr
  sin, cos, mul = jaxpr.eqns
  kept, used = jaxpr_lib.needed(jaxpr.eqns, jaxpr.outvars[1:])
  assert [e for e, _ in kept] == [cos, mul]
  assert used == {jaxpr.outvars[1], cos.outvars[0], jaxpr.invars[1]}
  # A stopped value comes from elsewhere: the equation making it is not run.
  kept, used = jaxpr_lib.needed(
    jaxpr.eqns, jaxpr.outvars[1:], stop={cos.outvars[0]}
  )
  assert [e for e, _ in kept] == [mul]
  assert jaxpr.invars[1] not in used
  kept, _ = jaxpr_lib.needed(jaxpr.eqns, jaxpr.outvars[:1])
  assert [e for e, _ in kept] == [sin]


def test_needed_keeps_effects_if_asked_and_prunes_calls():
  def f(x, p):
    jax.debug.print("{}", x)
    return lax.cond(p, lambda x: (x + 1.0, x * 5.0), lambda x: (x, x), x)

  jaxpr = jax.make_jaxpr(f)(1.0, True).jaxpr
  first = jaxpr.outvars[:1]
  printed = lambda kept: any(e.effects for e, _ in kept)  # The print.
  assert not printed(jaxpr_lib.needed(jaxpr.eqns, first)[0])
  assert printed(jaxpr_lib.needed(jaxpr.eqns, first, effects=True)[0])
  (cond,) = [
    e
    for e, _ in jaxpr_lib.needed(jaxpr.eqns, first)[0]
    if e.primitive.name == "cond"
  ]
  kept, _ = jaxpr_lib.needed(jaxpr.eqns, first, prune=True)
  (pruned,) = [e for e, _ in kept if e.primitive.name == "cond"]
  assert len(cond.outvars) == 2 and len(pruned.outvars) == 1
  branches = [_names(b.jaxpr.eqns) for b in pruned.params["branches"]]
  assert branches == [[], ["add"]]  # The `mul` that made output 2 is gone.


def test_evaluate_runs_only_what_the_wanted_outputs_need():
  @jax.jit
  def call(x, y):
    return x * 2.0 + 1.0, x * y

  def f(x, y):
    u, v = call(x, y)
    return u, v, jnp.exp(x)

  x = jnp.float32(3.0)
  closed = jax.make_jaxpr(f)(x, 1.0)
  # y unknown: only what does not need it runs (x * y would fail on None),
  # inside the call too.
  out = jaxpr_lib.evaluate(closed, [x, None], [True, False, True])
  assert out[0] == f(x, 0.0)[0] and out[1] is None and out[2] == jnp.exp(x)
  out = jaxpr_lib.evaluate(closed, [x, jnp.float32(4.0)], [False, True, False])
  assert out == [None, f(x, 4.0)[1], None]


def test_subprogram_runs_the_equations_kept():
  def f(x, y):
    return jnp.sin(x), y * 3.0 + x

  closed = jax.make_jaxpr(f)(1.0, 2.0)
  jaxpr = closed.jaxpr
  kept, _ = jaxpr_lib.needed(jaxpr.eqns, jaxpr.outvars[1:])
  part = jaxpr_lib.subprogram(
    closed, [e for e, _ in kept], jaxpr.invars, jaxpr.outvars[1:]
  )
  assert _names(part.jaxpr.eqns) == ["mul", "add"]
  (out,) = jax.extend.core.jaxpr_as_fun(part)(0.5, 2.0)
  assert out == f(0.5, 2.0)[1]
  same = jaxpr_lib.subprogram(closed, jaxpr.eqns[:1])  # Its own ins, outs.
  assert same.jaxpr.invars == jaxpr.invars
  assert same.jaxpr.outvars == jaxpr.outvars
