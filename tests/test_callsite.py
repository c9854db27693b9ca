"""``callsite.py`` directly: the user's line, past the frames of JAX, the
model libraries, optax and immgrad.

Each expected line is found by a marker comment in this file, so the tests
do not depend on where they sit in it.
"""

import os

import jax
from jax import lax
import jax.numpy as jnp
import optax

from immgrad._src import callsite

_THIS = os.path.basename(__file__)


def _line_of(marker: str) -> int:
  with open(__file__) as f:
    lines = f.read().split("\n")
  (number,) = [i + 1 for i, line in enumerate(lines) if line.endswith(marker)]
  return number


def _through_optax(x):
  return optax.l2_loss(x)  # <- calls optax.


def _where(user_line: str) -> str:
  """``"file:line"`` of ``"/path/file:line:column (function)"``."""
  path, line = user_line.split(" (")[0].split(":")[:2]
  return f"{os.path.basename(path)}:{line}"


def test_an_equation_traced_inside_optax_names_the_line_that_called_optax():
  (eqn,) = [
    e
    for e in jax.make_jaxpr(_through_optax)(jnp.ones(3)).jaxpr.eqns
    if e.primitive.name == "integer_pow"  # optax's 0.5 * x ** 2.
  ]
  line = callsite.user_line(eqn.source_info)
  expected = _line_of("# <- calls optax.")
  assert _where(line) == f"{_THIS}:{expected}"
  assert line.endswith("(_through_optax)")


def test_an_equation_of_the_user_s_own_names_the_innermost_user_line():
  def inner(x):
    return jnp.sin(x)  # <- sin.

  def f(x):
    return inner(x)

  (eqn,) = jax.make_jaxpr(f)(1.0).jaxpr.eqns
  line = callsite.user_line(eqn.source_info)
  assert _where(line) == f"{_THIS}:{_line_of('# <- sin.')}"
  assert line.endswith("inner)")  # "(inner)" or "(test_...<locals>.inner)".


def test_only_the_libraries_files_are_library_files():
  assert callsite.in_library(optax.__file__)
  assert callsite.in_library(jax.__file__)
  assert callsite.in_library(os.__file__)  # Python's own.
  assert callsite.in_library(callsite.__file__)
  assert not callsite.in_library(__file__)


def test_inside_a_scan_body_the_transformation_is_named_with_its_call():
  found = []

  def body(carry, x):
    found.append(callsite.enclosing_transformation())
    return carry, x

  lax.scan(body, 0.0, jnp.arange(2.0))  # <- scan.
  assert found == [("lax.scan", f"{_THIS}:{_line_of('# <- scan.')}")]
  assert callsite.enclosing_transformation() == (None, None)
