"""Clipping that needs one parameter at a time, for use inside the shim.

``optax.clip_by_global_norm`` needs every gradient before any step, which an
immediate layer cannot wait for; the shim refuses it, and
:func:`clip_by_layer_norm` clips each tensor by its own norm instead.
"""

import jax
import jax.numpy as jnp
import optax


def clip_by_layer_norm(max_norm: float) -> optax.GradientTransformation:
  """Clips each parameter tensor's gradient to an L2 norm of ``max_norm``.

  The per-tensor counterpart of ``optax.clip_by_global_norm``: each leaf ``g``
  becomes ``g / max(1, ||g|| / max_norm)``, using only that leaf, so it can
  run inside an immediate layer's backward rule. Chain it before the
  optimizer, as you would the global version. A stacked parameter
  (``immgrad.scan``) is one tensor to it, as to plain optax, whose norm
  no single layer has: there it is refused.

  To clip the update instead (AdaLomo-style), place
  ``optax.clip_by_block_rms(threshold)`` after the scaling rule:
  ``optax.chain(optax.scale_by_adam(), optax.clip_by_block_rms(1.0),
  optax.scale_by_learning_rate(1e-3))``.

  Args:
    max_norm: the largest L2 norm a parameter tensor's gradient may have.

  Returns:
    An ``optax.GradientTransformation`` (stateless).

  Example:
    >>> import jax.numpy as jnp, optax
    >>> import immgrad
    >>> clip = immgrad.clip_by_layer_norm(1.0)
    >>> grads = {"w": jnp.array([3.0, 4.0]), "b": jnp.array([0.1])}
    >>> clipped, _ = clip.update(grads, clip.init(grads))
    >>> clipped["w"], clipped["b"]
    (Array([0.6, 0.8], dtype=float32), Array([0.1], dtype=float32))
    >>> tx = immgrad.shim(optax.chain(immgrad.clip_by_layer_norm(1.0),
    ...                               optax.adam(1e-3)))
  """
  if not max_norm > 0:
    raise ValueError(
      f"immgrad.clip_by_layer_norm: max_norm must be positive, got "
      f"{max_norm!r}."
    )

  def update_fn(updates, state, params=None):
    del params

    def clip(g):
      norm = jnp.sqrt(jnp.sum(jnp.square(g.astype(jnp.float32))))
      return (g / jnp.maximum(1.0, norm / max_norm)).astype(g.dtype)

    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
