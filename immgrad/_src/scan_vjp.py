"""The backward loop of ``immgrad.scan``: residuals without weight copies.

``lax.scan``'s own VJP would copy the stacked weights and optimizer state
into its residual stacks; :func:`scan` stacks only the residuals the body
makes from the carry and ``xs``, and reads the others again where they came
from (``docs/design.md``).
"""

from typing import Any, Callable

import jax
from jax import lax
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np

from immgrad._src import jaxpr as jaxpr_lib


def scan_with_vjp(
  body: Callable,
  init: Any,
  xs: list,
  *,
  length,
  reverse: bool,
  unroll,
  needs_cotangent: Callable[[int], bool],
  in_place: Callable[[], dict[int, int]] = dict,
  slices_in_loop: bool = False,
):
  """``lax.scan(body, init, xs)``, differentiable with less memory.

  Args:
    body: ``body(carry, x) -> (carry, y)``, ``x`` a list of slices of
      ``xs``.
    init: the initial carry.
    xs: a list of arrays with a leading axis of ``length``.
    length: as in ``lax.scan``.
    reverse: as in ``lax.scan``.
    unroll: as in ``lax.scan``.
    needs_cotangent: called once the backward body has been traced, for
      each position of ``xs``: whether its cotangent may be nonzero (False:
      a symbolic zero is returned).
    in_place: called once the forward body has been traced: the positions
      of ``xs`` whose cotangent is their new value (an immediate layer's
      new weights and state, ``immgrad.train_step``), each mapped to the
      position whose new slice is written before its own (itself: none).
      The backward loop carries each such stack, reads its slice from the
      carry and writes the new one over it, so the stack of cotangents is
      the stack itself, updated in place.
    slices_in_loop: make each forward iteration's float slices of ``xs``
      depend (``+ -0.0``) on the carry, so that XLA cannot hoist a cast of
      a whole stack out of the loop: on a TPU at the default matmul
      precision it casts every stacked weight to bfloat16 before the
      forward loop, a copy of 2 bytes a parameter alive through it.

  Returns:
    ``(carry, ys)``, as ``lax.scan``.
  """
  if length is None:
    length = jnp.shape(xs[0])[0]
  example = [lax.index_in_dim(a, 0, keepdims=False) for a in xs]
  # A custom_vjp must see every value it differentiates as an argument.
  closed, consts = jax.closure_convert(body, init, example)
  traced = {}  # What the forward body's trace tells the backward one.

  def run(consts, init, xs):
    return lax.scan(
      lambda c, x: closed(c, x, *consts),
      init,
      xs,
      length=length,
      reverse=reverse,
      unroll=unroll,
    )

  def fwd(consts, init, xs):
    perturbed = [p.perturbed for p in consts]
    consts, init, xs = jax.tree.map(
      lambda p: p.value, (consts, init, xs), is_leaf=_is_primal
    )

    def linearized(carry, x, consts):
      out, vjp = jax.vjp(lambda c, x, k: closed(c, x, *k), carry, x, consts)
      leaves, treedef = jax.tree.flatten(vjp)
      traced.update(treedef=treedef, out=jax.tree.map(jax.typeof, out))
      return out, leaves

    # The body and its residuals as one program, traced once: the loop runs
    # it, and it tells which residuals are the same in every iteration.
    program = jax.make_jaxpr(linearized)(init, example, consts)
    n_carry = len(jax.tree.leaves(init))
    n_out = len(jax.tree.leaves(traced["out"]))
    inputs = {v: k - n_carry for k, v in enumerate(program.jaxpr.invars)}
    fixed = [None] * (n_carry + len(xs)) + list(consts)
    loose = jaxpr_lib.varying(program.jaxpr, [a is None for a in fixed])
    spec, sources, saved, once = [], {}, [], []  # once: made before the loop.
    for k, v in enumerate(program.jaxpr.outvars[n_out:], n_out):
      key = ("literal", k) if isinstance(v, jex_core.Literal) else v
      j = inputs.get(key, -1)
      if key in sources:
        pass
      elif 0 <= j < len(xs):  # A slice of xs: read again from xs.
        sources[key] = ("x", j)
      elif j >= len(xs):  # A value the body closes over.
        sources[key] = ("const", j - len(xs))
      elif not loose[k]:  # The same in every iteration: made once.
        sources[key] = ("once", len(once))
        once.append(k)
      else:  # Made in the body: stacked.
        sources[key] = ("saved", len(saved))
        saved.append(k)
      spec.append(sources[key])
    traced["spec"] = spec
    wanted = [k in once for k in range(len(loose))]
    made = jaxpr_lib.evaluate(program, fixed, wanted)
    made = [made[k] for k in once]
    run_program = jex_core.jaxpr_as_fun(program)
    out_tree = jax.tree.structure(traced["out"])

    def forward(carry, x):
      if slices_in_loop:
        c = [a for a in jax.tree.leaves(carry) if _is_float(a) and a.size]
        x = [_after(a, c[:1]) if _is_float(a) else a for a in x]
      flat = run_program(*jax.tree.leaves(carry), *x, *consts)
      out = jax.tree.unflatten(out_tree, flat[:n_out])
      return out[0], (out[1], [flat[k] for k in saved])

    carry, (ys, saved) = lax.scan(
      forward, init, xs, length=length, reverse=reverse, unroll=unroll
    )
    return (carry, ys), (consts, xs, saved, made, perturbed)

  def bwd(residuals, cts):
    consts, xs, saved, made, perturbed = residuals
    spec, treedef = traced["spec"], traced["treedef"]
    out_avals, out_tree = jax.tree.flatten(traced["out"])
    cts = jax.tree.leaves(cts, is_leaf=_is_zero)
    n_carry = len(jax.tree.leaves(traced["out"][0]))
    # Only float outputs with a nonzero cotangent enter the loop; the carry's
    # cotangent is dense from the first iteration on.
    live_ys = [
      k
      for k in range(n_carry, len(cts))
      if _is_float(out_avals[k]) and not _is_zero(cts[k])
    ]
    floats = [k for k in range(n_carry) if _is_float(out_avals[k])]
    summed = [
      i for i, (k, p) in enumerate(zip(consts, perturbed)) if p and _is_float(k)
    ]
    stacked = []  # Positions of xs whose cotangents the loop stacks.
    before = in_place()  # Carried: position -> the one written before it.
    carried = sorted(before, key=lambda j: (before[j] != j, j))

    def backward(carry, scanned_in):
      ct_carry, ct_consts, stacks = carry
      x, saved_i, ct_ys, i = scanned_in
      x = list(x)
      for j, stack in zip(carried, stacks):  # Read before it is written.
        x[j] = lax.dynamic_index_in_dim(stack, i, keepdims=False)
      where = {"x": x, "const": consts, "saved": saved_i, "once": made}
      vjp = jax.tree.unflatten(
        treedef,
        [where[kind][j] for kind, j in spec],
      )
      ct_out = [_zeros(a) for a in out_avals]
      for k, c in zip(floats + live_ys, ct_carry + ct_ys):
        ct_out[k] = c
      d_carry, d_x, d_consts = vjp(jax.tree.unflatten(out_tree, ct_out))
      d_carry = jax.tree.leaves(d_carry)
      ct_consts = [a + d_consts[j] for a, j in zip(ct_consts, summed)]
      stacked[:] = [
        j
        for j in range(len(xs))
        if _is_float(xs[j]) and needs_cotangent(j) and j not in before
      ]
      d_carry = [d_carry[k] for k in floats]
      return (
        (d_carry, ct_consts, _written(stacks, d_x, d_carry, i)),
        [d_x[j] for j in stacked],
      )

    def _written(stacks, d_x, d_carry, i):
      """Each carried stack with this iteration's new slice written over
      its old one, in ``carried``'s order, after what the iteration sends
      back (``d_carry``, which reads the old weights in ``current``
      mode) and each slice after the one it follows (a weight before its
      state). The order is a data dependence, ``+ -0.0`` (``+ 0.0`` where
      the value depended on is NaN): else XLA's CPU backend fuses a write
      with the reads of the old slice it overwrites, and copies the whole
      stack in every iteration.
      """
      out, done = [], {}
      for j, stack in zip(carried, stacks):
        if before[j] != j:
          after = [lax.dynamic_index_in_dim(done[before[j]], i, False)]
        else:
          after = d_carry
        stack = lax.dynamic_update_index_in_dim(
          stack, _after(d_x[j], after), i, 0
        )
        out.append(stack)
        done[j] = stack
      return out

    start = (
      [
        cts[k] if not _is_zero(cts[k]) else _zeros(out_avals[k]) for k in floats
      ],
      [jnp.zeros_like(consts[i]) for i in summed],
      [xs[j] for j in carried],
    )
    (d_carry, d_consts, news), d_xs = lax.scan(
      backward,
      start,
      (
        [None if j in before else a for j, a in enumerate(xs)],
        saved,
        [cts[k] for k in live_ys],
        jnp.arange(length) if carried else None,  # The write index.
      ),
      length=length,
      reverse=not reverse,
      unroll=unroll,
    )

    out_consts: list[Any] = [None] * len(consts)
    for i, d in zip(summed, d_consts):
      out_consts[i] = d
    out_init: list[Any] = [None] * n_carry
    for k, d in zip(floats, d_carry):
      out_init[k] = d
    out_xs: list[Any] = [None] * len(xs)
    for j, d in zip(stacked, d_xs):
      out_xs[j] = d
    for j, d in zip(carried, news):
      out_xs[j] = d
    init_tree = jax.tree.structure(traced["out"][0])
    return out_consts, jax.tree.unflatten(init_tree, out_init), out_xs

  loop = jax.custom_vjp(run)
  loop.defvjp(fwd, bwd, symbolic_zeros=True)
  return loop(consts, init, xs)


def _after(value, others: list):
  """``value``, computed only once each of ``others`` is (``+ -0.0``; an
  empty one has nothing to wait for).
  """
  for other in others:
    if not other.size:
      continue
    seen = other[(0,) * other.ndim]
    value = value + jnp.where(jnp.isnan(seen), 0.0, -0.0).astype(value.dtype)
  return value


def _is_float(a) -> bool:
  return jnp.issubdtype(a.dtype, jnp.inexact)


def _is_zero(c) -> bool:
  return isinstance(c, jax.custom_derivatives.SymbolicZero)


def _is_primal(p) -> bool:
  return isinstance(p, jax.custom_derivatives.CustomVJPPrimal)


def _zeros(aval):
  """A zero cotangent for an output of type ``aval`` (float0 if integer)."""
  if not _is_float(aval):
    return np.zeros(aval.shape, jax.dtypes.float0)
  return jnp.zeros(aval.shape, aval.dtype)
