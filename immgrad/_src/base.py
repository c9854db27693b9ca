"""The types the shim and the training step share (as ``optax/_src/base.py``).

No logic here: the shim's state, the two kinds of leaf that
``immgrad.value_and_grad`` hands the shim besides plain gradients, and the
transformation type that knows its inner ``tx``.
"""

from typing import Any, NamedTuple

import chex
import jax
import optax


class ShimState(NamedTuple):
  """State of :func:`shim`.

  Attributes:
    inner: ``tx``'s state, exactly as plain optax keeps it
      (``tx.init(params)``).
    rejected: how many steps were rejected as non-finite (int32).
  """

  inner: Any
  rejected: chex.Array


class Stepped(NamedTuple):
  """A leaf of the tree from ``immgrad.value_and_grad`` that is already done.

  ``immgrad.value_and_grad`` gives one for a parameter the step did not use
  (its old value and state: kept bit for bit); the shim also accepts one
  with a new value computed elsewhere.

  Attributes:
    params: the parameter's new value.
    state: None (the state this parameter owns is kept), or its new values,
      in the order ``tx``'s program for it writes them.
  """

  params: chex.Array
  state: Any = None


@jax.tree_util.register_pytree_node_class
class ImmediateGrad:
  """A leaf of the tree from ``immgrad.value_and_grad``: a stepped gradient.

  The immediate layer that used the parameter has already stepped it with
  this gradient in the backward pass (for ``dX``, and to check the step);
  the shim commits that step.

  Attributes:
    grad: the parameter's gradient, averaged over ``axis_name``.
    nonfinite: how many immediate layer calls of the step found a
      non-finite gradient, new weight or new state (the same scalar for
      every parameter of the step), or None if the step was not checked
      (a shim with ``atomic=False``).
    layer_axes: how many leading layer axes ``immgrad.scan`` split the
      parameter over (0 for an unstacked one): the step is taken per layer.
  """

  def __init__(self, grad, nonfinite=None, layer_axes: int = 0):
    self.grad = grad
    self.nonfinite = nonfinite
    self.layer_axes = layer_axes

  def tree_flatten(self):
    return (self.grad, self.nonfinite), self.layer_axes

  @classmethod
  def tree_unflatten(cls, layer_axes, children):
    grad, nonfinite = children
    return cls(grad, nonfinite, layer_axes)

  def __repr__(self):
    return (
      f"ImmediateGrad(grad={self.grad!r}, nonfinite={self.nonfinite!r}, "
      f"layer_axes={self.layer_axes})"
    )


class ShimTransformation(optax.GradientTransformation):
  """An ``optax.GradientTransformation`` that also knows its inner ``tx``.

  Still the ``(init, update)`` pair optax takes it for; ``inner`` and
  ``atomic`` are set once, by the constructor, and kept by ``copy`` and
  JAX's tree functions.

  Attributes:
    inner: the per-parameter rule that immediate layers apply.
    atomic: whether a step with any non-finite value is rejected whole.
  """

  inner: optax.GradientTransformation
  atomic: bool

  def __new__(
    cls,
    init: optax.TransformInitFn,
    update: optax.TransformUpdateFn,
    *,
    inner: optax.GradientTransformation,
    atomic: bool,
  ):
    # A NamedTuple's subclass cannot add fields to the tuple (optax's
    # GradientTransformationExtraArgs adds none); these two live beside it.
    self = super().__new__(cls, init, update)
    self.inner = inner
    self.atomic = atomic
    return self

  def __getnewargs_ex__(self):
    return (self.init, self.update), {
      "inner": self.inner,
      "atomic": self.atomic,
    }


jax.tree_util.register_pytree_node(
  ShimTransformation,
  lambda t: ((t.init, t.update), (t.inner, t.atomic)),
  lambda fields, fns: ShimTransformation(
    *fns, inner=fields[0], atomic=fields[1]
  ),
)
