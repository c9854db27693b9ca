"""``immgrad.scan``: ``jax.lax.scan`` over stacked immediate layers.

A plain ``lax.scan`` hands its body fresh tracers: an immediate layer inside
cannot tell which parameter a slice came from, and a parameter closed over
by the body would be stepped once per iteration and the new weights summed
(both are refused, see ``context.py``). ``immgrad.scan`` has
``jax.lax.scan``'s signature and does what the layer needs: for every leaf
of ``xs`` that is a parameter of the current step, it scans the leaf's
hidden weight and optimizer-state channels along with it, and inside the
body registers the slices as that step's parameters. Each iteration's layer
then steps its own slice exactly once, and the scan's own backward loop
(``scan_vjp.py``) writes the new slices into the new stacked weights (a
fresh buffer, as plain training's gradients would be) and into the stacked
state's own buffer, in place.

Optimizer state is sliced the way the weights are: a state leaf of shape
``(n, *s)`` whose per-layer counterpart (what ``tx.init`` makes for one
slice) has shape ``s`` is scanned; an integer leaf equal in shape to its
per-layer counterpart (optax's step ``count``) is shared: every layer reads
it and, as every layer steps once, they all write back the same next value.
Per-tensor rules (``clip_by_layer_norm``, Adafactor's factored moments) thus
see one layer's slice, as they would for unstacked layers.
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from immgrad._src import context
from immgrad._src import scan_vjp

_UNSPLITTABLE = (
    "immgrad.scan: the optimizer state of stacked parameter {path} has a "
    "leaf of shape {big} (dtype {dtype}) where one layer's state has shape "
    "{small}. Only state with a leading layer axis, or an integer step "
    "count shared by all layers, can be split per layer. Use a per-element "
    "optimizer (sgd, adam, lion, ...) for stacked layers, or unroll them.")


def scan(f: Callable, init: Any, xs: Any = None, length=None,
         reverse: bool = False, unroll=1, _split_transpose: bool = False):
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
    return jax.lax.scan(f, init, xs, length=length, reverse=reverse,
                        unroll=unroll, _split_transpose=_split_transpose)

  step = context.current()
  if step is None:
    return plain()
  leaves, treedef = jax.tree.flatten(xs)
  stacked = step.find_all(leaves, "immgrad.scan")
  if not stacked:
    return plain()

  origin = object()  # Tells a retrace of this call's body from another use.
  channels, per_layer = [], []
  for i, slot in stacked:
    split, like = _split_state(step.tx, leaves[i], slot)
    channels.append([slot.weight] + split)
    per_layer.append(like)
  # The loop scans the leaves of xs, then each stacked parameter's channels.
  starts = np.cumsum([len(leaves)] + [len(c) for c in channels]).tolist()
  inner_slots = []  # One per stacked parameter, made when the body is traced.

  def body(carry, scanned):
    x = scanned[:len(leaves)]
    inner = step.nested()
    inner_slots.clear()
    for (i, slot), start, c, like in zip(stacked, starts, channels,
                                         per_layer):
      weight, *split = scanned[start:start + len(c)]
      inner_slot = context.Slot(
          path=f"{slot.path} (one layer of immgrad.scan)", view=None,
          weight=weight, state=_join_state(split, like), state_like=like,
          parent=slot, origin=origin)
      x[i] = inner_slot.watch(x[i])
      inner.add(inner_slot)
      inner_slots.append(inner_slot)
    with context.opened(inner):
      return f(carry, treedef.unflatten(x))

  def written():
    """Where the new values of claimed stacked parameters are written.

    The new state goes into the old state's own buffer: nothing reads the
    old state after the step. The new weights go into a fresh buffer (the
    size of plain training's gradient stack): the shim still reads the
    old weights, to turn the new ones into optax updates.
    """
    claimed = [(start, c) for s, start, c in zip(inner_slots, starts,
                                                 channels)
               if s.layer is not None]
    state = [j for start, c in claimed for j in range(start + 1,
                                                      start + len(c))]
    return state, [start for start, _ in claimed]

  views = {i: n for n, (i, _) in enumerate(stacked)}

  def needs_cotangent(j):
    if j in views:  # A stacked parameter used by something but a layer.
      return inner_slots[views[j]].ordinary
    return j < len(leaves)  # A channel no layer claimed carries nothing.

  return scan_vjp.scan(body, init, leaves + sum(channels, []), length=length,
                       reverse=reverse, unroll=unroll, written=written,
                       needs_cotangent=needs_cotangent)


def _split_state(tx, leaf, slot):
  """The state channel of ``slot`` as leaves to scan, and one layer's like."""
  layers = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
  if layers is None:
    raise ValueError(
        f"immgrad.scan: parameter {slot.path} in xs is a scalar; stacked "
        "parameters need a leading layer axis.")
  like = jax.eval_shape(
      tx.init, jax.ShapeDtypeStruct(jnp.shape(leaf)[1:], leaf.dtype))
  bigs, treedef = jax.tree.flatten(slot.state_like)
  smalls = jax.tree.leaves(like)
  if jax.tree.structure(like) != treedef:
    raise ValueError(
        f"immgrad.scan: the optimizer state of stacked parameter "
        f"{slot.path} is not built like one layer's state "
        f"({treedef} vs {jax.tree.structure(like)}).")
  split = []
  for carried, big, small in zip(jax.tree.leaves(slot.state), bigs,
                                 smalls):
    big_shape, small_shape = jnp.shape(big), jnp.shape(small)
    integer = not jnp.issubdtype(jnp.result_type(big), jnp.floating)
    if big_shape == (layers,) + small_shape:
      # An integer leaf travels as (2, *shape) halves: put layers first.
      split.append(jnp.moveaxis(carried, 1, 0) if integer else carried)
    elif integer and big_shape == small_shape:
      split.append(_shared(carried, layers))
    else:
      raise ValueError(_UNSPLITTABLE.format(
          path=slot.path, big=big_shape, small=small_shape,
          dtype=jnp.result_type(big)))
  return split, like


def _join_state(split, like):
  """One layer's encoded state, from its scanned slices."""
  return jax.tree.unflatten(jax.tree.structure(like), list(split))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _shared(carried, layers):
  """``carried`` repeated per layer; its cotangent is one layer's, not a sum.

  Every layer steps the shared count once, so all write back the same next
  value; summing them (the transpose of a broadcast) would multiply it.
  """
  return jnp.broadcast_to(carried, (layers,) + jnp.shape(carried))


def _shared_fwd(carried, layers):
  return _shared(carried, layers), None


def _shared_bwd(layers, _, ct):
  del layers
  return (ct[0],)


_shared.defvjp(_shared_fwd, _shared_bwd)
