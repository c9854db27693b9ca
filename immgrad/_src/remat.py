"""``immgrad.checkpoint``: ``jax.checkpoint`` around immediate layers.

``jax.checkpoint`` hands its function fresh tracers, in which a layer cannot
find its parameters; this passes each parameter's hidden channels in with it
and registers the tracers as the step's (``docs/design.md``).
"""

import functools
from typing import Any, Callable

import jax

from immgrad._src import compat
from immgrad._src import context


def checkpoint(
  fun: Callable,
  *,
  prevent_cse=True,
  policy=None,
  static_argnums=(),
  static_argnames=(),
  **kwargs,
) -> Callable:
  """``jax.checkpoint`` for functions that call immediate layers.

  Pass the parameters the function's immediate layers use as arguments
  (unchanged from the params tree), not by closure. Outside
  ``immgrad.value_and_grad`` this is ``jax.checkpoint``; arguments are
  ``jax.checkpoint``'s.

  Rematerialisation re-runs the forward pass only: a layer's forward rule
  saves what its backward rule needs, and the backward rule, where the update
  happens, runs once per step.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> @immgrad.immediate_layer
    ... def dense(x, p):
    ...   return x @ p["w"]
    >>> @immgrad.checkpoint
    ... def block(x, p):
    ...   return jnp.tanh(dense(x, p))
    >>> def loss_fn(params, x):
    ...   return jnp.mean(block(x, params["block"]) ** 2)
    >>> params = {"block": {"w": jnp.eye(3)}}
    >>> tx = immgrad.shim(optax.sgd(0.1))
    >>> loss, grads = immgrad.value_and_grad(loss_fn, tx)(
    ...     params, tx.init(params), jnp.ones((2, 3)))
    >>> isinstance(grads["block"]["w"], immgrad.ImmediateGrad)
    True
  """
  options: dict[str, Any] = dict(
    prevent_cse=prevent_cse, policy=policy, **kwargs
  )
  names = compat.checkpoint_options(static_argnames)
  if isinstance(static_argnums, int):
    static_argnums = (static_argnums,)
  if isinstance(static_argnames, str):
    static_argnames = (static_argnames,)

  @functools.wraps(fun)
  def wrapped(*args, **call_kwargs):
    def plain():
      return jax.checkpoint(
        fun, static_argnums=static_argnums, **names, **options
      )(*args, **call_kwargs)

    step = context.current()
    if step is None:
      return plain()
    # Static keyword arguments are closed over: ``inner`` takes **kwargs,
    # which jax.checkpoint cannot match names against.
    static = {k: v for k, v in call_kwargs.items() if k in static_argnames}
    call_kwargs = {k: v for k, v in call_kwargs.items() if k not in static}
    leaves = jax.tree.leaves((args, call_kwargs))
    found = step.find_all(leaves, "immgrad.checkpoint")
    if not found:
      return plain()
    origin = object()

    def inner(channels, flag, *args, **call_kwargs):
      nested = step.nested(flag)
      views = jax.tree.leaves((args, call_kwargs))
      for (i, slot), (weight, state, probe) in zip(found, channels):
        nested.add(
          context.Slot(
            path=slot.path,
            view=views[i],
            weight=weight,
            state=state,
            probe=probe,
            program=slot.program,
            index=slot.index,
            depth=slot.depth,
            parent=slot,
            origin=origin,
          )
        )
      with context.opened(nested):
        return fun(*args, **call_kwargs, **static)

    # The channels and the flag come first: static positions move up by two.
    shifted = tuple((i % len(args)) + 2 for i in static_argnums)
    channels = [(slot.weight, slot.state, slot.probe) for _, slot in found]
    return jax.checkpoint(inner, static_argnums=shifted, **options)(
      channels, step.flag, *args, **call_kwargs
    )

  return wrapped
