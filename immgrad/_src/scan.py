"""``immgrad.scan``: ``jax.lax.scan`` over stacked immediate layers.

A plain ``lax.scan`` hides which parameter a slice came from. This one scans
each parameter's hidden weight and optimizer-state channels along with it,
so that each layer steps its own slice once (``docs/design.md``,
``docs/stacked.md``).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from immgrad._src import context
from immgrad._src import plan as plan_lib
from immgrad._src import scan_vjp
from immgrad._src import stacked as stacked_lib


def scan(
  f: Callable,
  init: Any,
  xs: Any = None,
  length=None,
  reverse: bool = False,
  unroll=1,
):
  """``jax.lax.scan`` for bodies that call immediate layers on slices of xs.

  Pass stacked parameters (leading axis: the layer) in ``xs``, unchanged
  from the params tree, and call immediate layers on the slices the body
  gets. Outside ``immgrad.value_and_grad``, or with no parameter in ``xs``,
  this is ``jax.lax.scan``. Arguments and results are ``jax.lax.scan``'s.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> @immgrad.immediate_layer
    ... def dense(x, p):
    ...   return x @ p["w"]
    >>> def loss_fn(params, x):
    ...   def block(h, p):
    ...     return jnp.tanh(dense(h, p)), None
    ...   h, _ = immgrad.scan(block, x, params["blocks"])
    ...   return jnp.mean(h ** 2)
    >>> params = {"blocks": {"w": jnp.stack([jnp.eye(3)] * 4)}}  # 4 layers.
    >>> tx = immgrad.shim(optax.sgd(0.1))
    >>> opt_state = tx.init(params)
    >>> step = immgrad.value_and_grad(loss_fn, tx)
    >>> loss, grads = step(params, opt_state, jnp.ones((2, 3)))
    >>> updates, opt_state = tx.update(grads, opt_state, params)
    >>> params = optax.apply_updates(params, updates)
    >>> params["blocks"]["w"].shape
    (4, 3, 3)
  """

  def plain():
    return jax.lax.scan(
      f,
      init,
      xs,
      length=length,
      reverse=reverse,
      unroll=unroll,
    )

  step = context.current()
  if step is None:
    return plain()
  leaves, treedef = jax.tree.flatten(xs)
  stacked = step.find_all(leaves, "immgrad.scan")
  if not stacked:
    return plain()

  origin = object()  # Tells a retrace of this call's body from another use.
  for i, slot in stacked:
    if not jnp.ndim(leaves[i]):
      raise ValueError(
        f"immgrad.scan: parameter {slot.path} in xs is a scalar; stacked "
        "parameters need a leading layer axis."
      )
  settings = step.settings
  one_layer = plan_lib.sliced(
    settings.tx,
    settings.params,
    {slot.index: slot.depth + 1 for _, slot in stacked},
  )
  channels, programs = [], []  # Per stacked parameter: scanned, one layer's.
  for i, slot in stacked:
    layer = one_layer.leaves[slot.index]
    split = stacked_lib.state_axes(
      slot.program, layer, slot.state, settings.shared, slot.path
    )
    layers = jnp.shape(leaves[i])[0]
    # A shared leaf is repeated per layer: closed over instead, a value
    # that is not differentiated would stay in the body's closure, outside
    # any trace that rematerialisation replays. No state goes through the
    # loop when no backward rule reads it.
    state = [
      a if axis == 0 else jnp.broadcast_to(a, (layers,) + a.shape)
      for a, axis in zip(slot.state, split)
      if settings.steps_in_backward
    ]
    probe = [slot.probe] if settings.measure_dx else []
    channels.append([slot.weight] + probe + state)
    programs.append(layer)
  # The loop scans the leaves of xs, then each stacked parameter's channels.
  starts = np.cumsum([len(leaves)] + [len(c) for c in channels]).tolist()
  inner_slots = []  # One per stacked parameter, made when the body is traced.

  def body(carry, scanned):
    x = scanned[: len(leaves)]
    inner = step.nested()
    inner_slots.clear()
    for (i, slot), start, c, program in zip(
      stacked, starts, channels, programs
    ):
      weight, *state = scanned[start : start + len(c)]
      probe = state.pop(0) if settings.measure_dx else None
      inner_slot = context.Slot(
        path=f"{slot.path} (one layer of immgrad.scan)",
        view=None,
        weight=weight,
        state=list(state),
        probe=probe,
        program=program,
        index=slot.index,
        depth=slot.depth + 1,
        parent=slot,
        origin=origin,
        sliced=True,
      )
      x[i] = inner_slot.watch(x[i])
      inner.add(inner_slot)
      inner_slots.append(inner_slot)
    with context.opened(inner):
      return f(carry, treedef.unflatten(x))

  views = {i: n for n, (i, _) in enumerate(stacked)}
  weights = {start: n for n, start in enumerate(starts[:-1])}
  if settings.measure_dx:  # A probe channel follows each weight channel.
    weights.update({start + 1: n for n, start in enumerate(starts[:-1])})

  def needs_cotangent(j):
    if j in views:  # A stacked parameter used by something but a layer.
      return inner_slots[views[j]].ordinary
    if j in weights:  # A weight (or probe) channel carries its layers'.
      return inner_slots[weights[j]].layer is not None
    return j < len(leaves)  # The user's xs; state is not differentiated.

  def in_place():
    """The channels whose cotangent is their new value (``in_place``): a
    claimed weight channel, and after it the state its program writes.
    """
    if not settings.in_place:
      return {}
    out = {}
    for inner_slot, start, program in zip(inner_slots, starts, programs):
      if inner_slot.layer is None:
        continue
      out[start] = start
      first_state = start + 1 + settings.measure_dx
      for r, k in enumerate(program.reads):
        if k in program.writes:
          out[first_state + r] = start
    return out

  return scan_vjp.scan_with_vjp(
    body,
    init,
    leaves + sum(channels, []),
    length=length,
    reverse=reverse,
    unroll=unroll,
    needs_cotangent=needs_cotangent,
    in_place=in_place,
    # The in-place step holds no more than it must: no bfloat16 copy of the
    # weight stacks (the TPU's cast hoisted out of the forward loop) either.
    slices_in_loop=settings.in_place,
  )
