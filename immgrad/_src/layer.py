"""``immediate_layer``: a primitive layer whose backward rule steps its weights.

Inside ``immgrad.value_and_grad`` a decorated ``fun(x, params)`` is a
``jax.custom_vjp`` whose backward rule steps its weights with the layer's
own optimizer state and takes ``dX`` at the old, new or interpolated weights
(``docs/training-step.md``, ``docs/design.md``); outside, it is ``fun``.
"""

import functools
import inspect
from typing import Any, Callable

import jax
from jax import custom_batching
from jax import lax
import jax.numpy as jnp

from immgrad._src import axes
from immgrad._src import commit
from immgrad._src import context
from immgrad._src.compat import get_opaque_trace_state


def immediate_layer(
  fun: Callable[[Any, Any], Any] | None = None,
  *,
  name: str | None = None,
  compute_dtype: Any | None = None,
) -> Callable:
  """Makes a primitive layer ``fun(x, params) -> y`` update immediately.

  Decorate the smallest parametric primitive (an affine map, a convolution,
  a normalisation's scale and offset) and keep activations outside: in
  ``mode="updated"`` the backward rule re-linearises ``fun`` at the new
  weights, which costs nothing extra for a function linear in ``x`` but
  re-runs any nonlinearity inside it.

  Args:
    fun: the layer, called as ``fun(x, params)``; ``x`` is an array or a
      pytree of arrays, ``params`` a pytree of float arrays, each leaf a
      parameter passed unchanged from the params tree of the step.
    name: the layer's name in error messages (default: ``fun``'s name).
    compute_dtype: if set (e.g. ``jnp.bfloat16``), the floating leaves of
      ``x`` and ``params`` are cast to it inside the layer and ``fun``
      computes in it. The cast is part of the layer, so the weights stay in
      their own dtype (float32, say): the gradient comes back through the
      cast in float32 and the optimizer updates float32 weights, keeping
      updates smaller than a bfloat16 ulp.

  Returns:
    A function with ``fun``'s signature. Outside ``immgrad.value_and_grad``
    it is ``fun``: same values, ordinary gradients. Inside, its backward rule
    updates ``params`` in place of returning their gradient. Called under
    ``jax.vmap`` with unmapped parameters (closed over, ``in_axes=None``),
    it steps them once, on the gradient of the whole batch.

  Example:
    >>> import jax.numpy as jnp
    >>> import immgrad
    >>> @immgrad.immediate_layer
    ... def dense(x, params):
    ...   return x @ params["w"] + params["b"]
    >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    >>> dense(jnp.ones((1, 3)), params)  # Outside a step: plain ``fun``.
    Array([[3., 3.]], dtype=float32)

    With options: ``@immgrad.immediate_layer(name="dense")``, or
    ``@immgrad.immediate_layer(compute_dtype=jnp.bfloat16)`` for mixed
    precision.
  """
  if fun is None:
    return functools.partial(
      immediate_layer, name=name, compute_dtype=compute_dtype
    )
  if not callable(fun):
    raise TypeError(
      f"immgrad.immediate_layer expects a function fun(x, params), got {fun!r}."
    )
  layer_name = name or getattr(fun, "__qualname__", None) or repr(fun)
  _check_signature(fun, layer_name)
  compute = fun if compute_dtype is None else _in_dtype(fun, compute_dtype)

  @functools.wraps(fun)
  def layer(x, params):
    return _call(compute, layer_name, x, params)

  return layer


def _call(fun, layer_name: str, x, params):
  """``fun(x, params)``: immediate inside a step, under ``vmap`` batched."""
  step = context.current()
  if step is None and context.analysing() is not None:
    return _unit(fun)(x, params)  # One layer of the loss planned whole.
  if step is None:
    return fun(x, params)
  if get_opaque_trace_state() != step._trace and _batched_somewhere(
    (x, params)
  ):
    return _vmapped(fun, layer_name, x, params)
  # In another trace but not under vmap (a loop, a branch, an inner jit),
  # the claim raises and says why.
  slots = step.claim(layer_name, params)
  return _immediate(fun, step, slots, jax.tree.structure(params), x)


_BATCHED_PARAMS = (
  "immediate layer {layer!r} got parameters mapped by jax.vmap (hk.vmap, "
  "eqx.filter_vmap): per-example or stacked weights, which would need one "
  "step per example. A vmapped layer steps its weights once, on the "
  "whole batch's gradient: close over the parameters, or pass them with "
  "in_axes=None. For stacked layers use immgrad.scan."
)


def _vmapped(fun, layer_name: str, x, params):
  """The layer under ``jax.vmap``: one immediate layer on the whole batch.

  A ``custom_vmap`` whose rule JAX runs in the enclosing trace: there the
  rule calls the layer again, on ``vmap(fun)``, the batched ``x`` and the
  unbatched parameters, the very objects the loss passed in, so the claim
  finds them. Nested vmaps recurse, one level per rule, down to the trace
  of the step, where one backward rule sees the whole batch's ``dy``.
  """

  @custom_batching.custom_vmap
  def call(x, params):
    return fun(x, params)  # Traced for its shapes only; the rule replaces it.

  @call.def_vmap
  def rule(axis_size, in_batched, x, params):
    x_batched, params_batched = in_batched
    if any(jax.tree.leaves(params_batched)):
      raise ValueError(_BATCHED_PARAMS.format(layer=layer_name))
    x_axes = jax.tree.map(lambda b: 0 if b else None, x_batched)
    batched = jax.vmap(fun, in_axes=(x_axes, None), axis_size=axis_size)
    y = _call(batched, layer_name, x, params)
    return y, jax.tree.map(lambda _: True, y)

  return call(x, params)


def _unit(fun: Callable) -> Callable:
  """``fun`` as one ``custom_vjp`` whose rule is its own ``jax.vjp``.

  ``immgrad.immediate`` takes such a call for one layer, so a decorated
  layer stays one layer when the whole loss is planned as one program.
  """
  unit = jax.custom_vjp(fun)
  unit.defvjp(
    lambda x, params: jax.vjp(fun, x, params), lambda vjp, dy: vjp(dy)
  )
  return unit


def _batched_somewhere(x) -> bool:
  """Whether a leaf of ``x`` is mapped by a ``vmap`` around this call.

  A ``custom_vmap`` probe on ``stop_gradient(x)`` whose rule only records
  that it ran: JAX runs it if, and only if, some enclosing vmap maps a leaf
  of ``x`` (here the layer's input and parameters: mapped parameters are
  refused by the layer's rule). (Unmapped, it is bound to the enclosing trace; ``stop_gradient``
  keeps it out of the differentiation, which ``custom_vmap`` cannot do.)
  The record is local to this call, so threads never see each other's.
  """
  ran = []

  @custom_batching.custom_vmap
  def probe(x):
    del x
    return jnp.zeros((), jnp.int32)

  @probe.def_vmap
  def rule(axis_size, in_batched, x):
    del axis_size, in_batched, x
    ran.append(True)
    return jnp.zeros((), jnp.int32), False

  probe(jax.lax.stop_gradient(x))
  return bool(ran)


def _in_dtype(fun: Callable, dtype: Any) -> Callable:
  """``fun`` with the floating leaves of its arguments cast to ``dtype``."""

  def cast(tree):
    return jax.tree.map(
      lambda a: (
        a.astype(dtype)
        if jnp.issubdtype(jnp.result_type(a), jnp.floating)
        else a
      ),
      tree,
    )

  return lambda x, params: fun(cast(x), cast(params))


def _check_signature(fun: Callable, layer_name: str) -> None:
  try:
    signature = inspect.signature(fun)
  except (TypeError, ValueError):  # Some builtins have none; JAX will tell.
    return
  try:
    signature.bind(None, None)
  except TypeError as e:
    raise TypeError(
      f"immgrad.immediate_layer: {layer_name!r} must be callable as "
      f"fun(x, params) with two positional arguments; its signature is "
      f"{signature}. Bind other arguments first (functools.partial) or "
      f"pack them into x."
    ) from e


def _immediate(fun, step: context.Registry, slots, treedef, x):
  """Calls ``fun`` through a custom_vjp that steps ``slots`` in its bwd."""
  settings = step.settings
  axis_name = settings.axis_name
  at = settings.dx_at  # dX at W + at * (W_new - W): 0 "current", 1 "updated".
  wrt_x = at == 0 or settings.measure_dx  # dX at the old weights is needed.
  in_loop = any(slot.depth for slot in slots)  # Sliced by immgrad.scan.

  def bound(weights):
    return axes.local(treedef.unflatten(weights), axis_name)

  @jax.custom_vjp
  def core(x, weights, states, flag, probes):
    del states, flag, probes
    return fun(x, treedef.unflatten(weights))

  def fwd(x, weights, states, flag, probes):
    del flag, probes
    if wrt_x:
      y, vjp = jax.vjp(fun, x, bound(weights))
    else:
      y, vjp = jax.vjp(lambda w: fun(x, w), bound(weights))
    # Only what the backward rule reads: under a loop every residual is
    # stacked over the iterations, and XLA need not see through it.
    x_again = at != 0 or settings.measure_dx  # dx_from, at other weights.
    return y, (
      vjp,
      x if x_again else None,
      weights if settings.steps_in_backward else None,
      states,
    )

  def dx_from(x, weights, dy):
    _, vjp_x = jax.vjp(lambda x: fun(x, treedef.unflatten(weights)), x)
    return vjp_x(dy)[0]

  def bwd(residuals, dy):
    vjp, x, weights, states = residuals
    if wrt_x:
      dx_current, dw = vjp(dy)
    else:
      (dw,) = vjp(dy)
    dw = axes.mean(jax.tree.leaves(dw), axis_name, settings.reduce_dtype)
    nonfinite = jnp.zeros((), jnp.float32)
    dx, probes = dx_current if at == 0 else None, None
    if settings.steps_in_backward:
      if not in_loop:
        # The gradient is computed whole before it is stepped on. Without
        # this XLA TPU fuses the optimizer's update into the dW matmul's
        # output, and the 12-block unrolled transformer's step ran 12%
        # slower than plain training on a v5e; with it, 3% faster. In a
        # loop's body the barrier costs instead (the scan MLP's step 1.12x
        # plain's against 1.06x, hk.layer_stack's 1.050x against 1.040x):
        # there the fused update is the cheaper program (docs/devlog.md).
        dw = lax.optimization_barrier(dw)
      stepped = [
        commit.step_parameter(slot.program, g, s, w)
        for slot, g, s, w in zip(slots, dw, states, weights)
      ]
      new = [w for w, _ in stepped]
      if settings.atomic:
        nonfinite = jnp.where(commit.all_finite((dw, stepped)), 0.0, 1.0)
      if at == 1 or settings.measure_dx:
        dx_updated = dx_from(x, new, dy)
      if at == 1:
        dx = dx_updated
      elif at != 0:
        dx = dx_from(
          x,
          [
            w + jnp.asarray(at, w.dtype) * (n - w) for w, n in zip(weights, new)
          ],
          dy,
        )
      if settings.measure_dx:
        change = _relative_change(dx_updated, dx_current, axis_name)
        probes = [
          _at_first(jnp.zeros_like(w, jnp.float32), change) for w in weights
        ]
    for slot in slots:
      slot.mark_stepped()
    if settings.in_place:  # The step itself, through the cotangent slots.
      written = [
        _in_read_order(slot.program, state)
        for slot, (_, state) in zip(slots, stepped)
      ]
      return dx, new, written, nonfinite, probes
    return dx, dw, None, nonfinite, probes

  core.defvjp(fwd, bwd)
  return core(
    x,
    [s.weight for s in slots],
    [s.state if settings.steps_in_backward else [] for s in slots],
    step.flag,
    [s.probe for s in slots] if settings.measure_dx else None,
  )


def _in_read_order(program, written: list) -> list:
  """New state values in the places of the state ``program`` reads.

  The cotangent of a layer's state input (``settings.in_place``): each
  leaf the program writes gets its new value, every other a zero (None).
  ``immgrad.train_step`` refuses a rule that writes a leaf it does not read.
  """
  out: list = [None] * len(program.reads)
  for k, value in zip(program.writes, written):
    out[program.reads.index(k)] = value
  return out


def _relative_change(dx_updated, dx_current, axis_name) -> jax.Array:
  """``|dx_updated - dx_current| / |dx_current|`` over all leaves and replicas.

  Squared norms are averaged over ``axis_name``: the ratio is the one of the
  whole batch's dX, not of one replica's share. Integer inputs (an
  embedding's token ids) have no dX: 0 if the layer has no other input.
  """
  pairs = [
    (u.astype(jnp.float32), c.astype(jnp.float32))
    for u, c in zip(jax.tree.leaves(dx_updated), jax.tree.leaves(dx_current))
    if jnp.issubdtype(c.dtype, jnp.inexact)
  ]
  if not pairs:  # An integer input (token ids): there is no dX to change.
    return jnp.zeros((), jnp.float32)
  num = sum(jnp.sum(jnp.square(u - c)) for u, c in pairs)
  den = sum(jnp.sum(jnp.square(c)) for _, c in pairs)
  num, den = axes.mean([num, den], axis_name)
  return jnp.sqrt(num / den)


def _at_first(zeros: jax.Array, value: jax.Array) -> jax.Array:
  """``zeros`` with ``value`` in its first element: a layer's probe cotangent."""
  return zeros.at[(0,) * zeros.ndim].set(value)
