"""``train_step``: the whole training step, new weights written over the old.

With a shim of ``atomic=False`` each immediate layer's backward rule returns
its new weights and state, written over the old ones inside
``immgrad.scan``'s backward loop: no gradient tree is ever whole
(``docs/memory.md``).
"""

from typing import Any, Callable

import jax
import optax

from immgrad._src import base
from immgrad._src import grad


def train_step(
  fun: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  mode: str | float = "updated",
  axis_name=None,
  reduce_dtype=None,
  has_aux: bool = False,
) -> Callable[..., Any]:
  """Makes the whole training step: loss, new parameters, new state.

  ``immgrad.value_and_grad`` followed by ``tx.update`` and
  ``optax.apply_updates``, in one function that returns the new
  parameters itself. With ``tx = immgrad.shim(..., atomic=False)`` that
  lets each immediate layer's backward rule return its new weights and
  optimizer state in place of its gradient: under a scan over layers
  (``immgrad.scan``, ``hk.layer_stack``, a ``lax.scan`` found by
  ``immgrad.immediate``) each layer's slice is written over the old one in
  the backward loop, so neither a gradient stack nor a stack of updates
  exists, and the step holds about the parameters, the optimizer state,
  the activations and one layer's gradient (``jax.jit`` with the
  parameters and state donated). An optax step cannot do that: it ends
  with ``apply_updates(params, updates)``, which needs the old weights and
  a whole tree of updates at once. A non-finite value is then written as
  it is (check the loss; docs/memory.md says how to recover).

  With an atomic shim (the default) the step is the same as
  ``value_and_grad`` + ``tx.update`` + ``optax.apply_updates``: all or
  nothing, holding every gradient until the step is known to be finite.
  ``mode="current"`` is plain training either way.

  Args:
    fun: the loss, ``fun(params, *args)``, as for ``value_and_grad``.
    tx: the optimizer from :func:`immgrad.shim`.
    mode: ``"updated"``, ``"current"`` or a number ``a``, as for
      ``value_and_grad``.
    axis_name: as for ``value_and_grad``.
    reduce_dtype: as for ``value_and_grad``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    ``step(params, opt_state, *args) -> (loss, params, opt_state)`` (the
    loss ``(loss, aux)`` with ``has_aux``). Jit it with
    ``donate_argnums=(0, 1)`` so the new weights and state can be written
    over the old ones.

  Raises:
    ValueError: in place, where ``tx`` keeps per-parameter state that its
      step writes without reading, or that is not floating point
      (``optax.zero_nans``): the error names the parameter and the state.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> @immgrad.immediate_layer
    ... def dense(x, p):
    ...   return x @ p["w"]
    >>> def loss_fn(params, x):
    ...   h, _ = immgrad.scan(
    ...       lambda h, p: (jnp.tanh(dense(h, p)), None), x, params["blocks"])
    ...   return jnp.mean((h - 1.0) ** 2)
    >>> params = {"blocks": {"w": jnp.stack([jnp.eye(3) * 0.5] * 4)}}
    >>> tx = immgrad.shim(optax.adam(1e-2), atomic=False)
    >>> opt_state = tx.init(params)
    >>> step = jax.jit(immgrad.train_step(loss_fn, tx), donate_argnums=(0, 1))
    >>> for _ in range(3):
    ...   loss, params, opt_state = step(params, opt_state, jnp.ones((2, 3)))
    ...   print(f"{loss:.4f}")
    0.8903
    0.8646
    0.8354
  """
  in_place = isinstance(tx, base.ShimTransformation) and not tx.atomic
  grads_of = grad.make(
    fun,
    tx,
    mode=mode,
    axis_name=axis_name,
    reduce_dtype=reduce_dtype,
    has_aux=has_aux,
    in_place=in_place,
    name="immgrad.train_step",
  )

  def step(params, opt_state, *args):
    value, grads = grads_of(params, opt_state, *args)
    updates, opt_state = tx.update(grads, opt_state, params)
    treedef = jax.tree.structure(params)
    new = [
      # In place, a stepped parameter's new weights come whole (no
      # ``p + (new - p)``, which need not round back to ``new``).
      g.params
      if in_place and isinstance(g, base.Stepped)
      else optax.apply_updates(p, u)
      for g, p, u in zip(
        treedef.flatten_up_to(grads),
        treedef.flatten_up_to(params),
        treedef.flatten_up_to(updates),
      )
    ]
    return value, treedef.unflatten(new), opt_state

  return step
