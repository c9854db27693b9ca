"""How an immediate layer finds its parameter's optimizer state.

``value_and_grad`` records each parameter leaf the loss sees in a
:class:`Registry`, with its hidden weight channel and optimizer state; a layer
looks its weights up there by object identity, only in the trace the registry
was opened in (``docs/design.md``, "How a layer finds its state").
"""

import dataclasses
import threading
from typing import Any, Callable, Optional

import jax
import jax.core
import jax.numpy as jnp

from immgrad._src import callsite
from immgrad._src.compat import get_opaque_trace_state

_NOT_A_PARAMETER = (
  "immediate layer {layer!r} got params{where} ({shape}), not a parameter "
  "leaf of the step but a value computed from one{hint}: its step would go "
  "through that computation. A tied weight (an "
  "embedding transposed for the logits) cannot be immediate: give each use "
  "its own parameter, or use it only undecorated. Cast with "
  "immediate_layer(compute_dtype=...); compute other weights (a slice, "
  "weight standardisation) inside the layer; for jax.checkpoint use "
  "immgrad.checkpoint."
)
_TRANSPOSED = " (the shape of {path} transposed)"

_NESTED = (
  "immediate layer {layer!r} was called on parameter {path} inside a "
  "transformation within the loss, {found}, which does not pass the "
  "parameter in. {why}"
)

# Per transformation found: why its layers cannot step there, and the fix.
_NESTED_FIX = {
  "lax.scan": (
    "A loop body would step the weights once per iteration. Pass stacked "
    "parameters as xs of immgrad.scan (Haiku: hk.layer_stack inside "
    "immgrad.haiku.immediate), or call the layer outside the loop."
  ),
  "lax.cond": (
    "A branch may not run, leaving the weights unstepped. Call the layer "
    "outside the branch, or leave its module out of `modules=` so that it "
    "trains ordinarily."
  ),
  "jax.jit": (
    "Call the layer outside the inner jit: one jit around the whole "
    "training step is enough."
  ),
  "jax.checkpoint": (
    "Use immgrad.checkpoint, which passes the parameters in (Haiku: "
    "hk.remat inside immgrad.haiku.immediate)."
  ),
  "jax.vmap": (
    "This vmap maps none of the layer's inputs (such as "
    "jax.vmap(self.position)(jnp.arange(n)) inside a vmapped model). "
    "Compute it outside the vmapped model, or read the weight directly "
    "(self.position.weight), which trains ordinarily."
  ),
  None: (
    "Its weight update must run exactly once per step. Call the layer at "
    "the top level of the loss; for stacked layers use immgrad.scan, for "
    "rematerialisation immgrad.checkpoint."
  ),
}
for _loop in ("lax.fori_loop", "lax.map", "lax.while_loop"):
  _NESTED_FIX[_loop] = _NESTED_FIX["lax.scan"]
_NESTED_FIX["lax.switch"] = _NESTED_FIX["lax.cond"]

_TWICE = (
  "parameter {path} reaches two immediate layer calls ({first!r} and "
  "{second!r}) in one step: it is tied (an embedding reused for the "
  "logits, say), and one layer's step would miss the other's part of its "
  "gradient. Give each use its own parameter, or use it only undecorated "
  "(the plain function in every place) so that it trains ordinarily, as "
  "immgrad.immediate does by itself."
)


def nested_error(layer: str, path: str) -> ValueError:
  """The error for a layer called inside a transformation within the loss."""
  found, where = callsite.enclosing_transformation()
  name = (
    "an unrecognised one"
    if found is None
    else (found if where is None else f"{found} called at {where}")
  )
  return ValueError(
    _NESTED.format(layer=layer, path=path, found=name, why=_NESTED_FIX[found])
  )


@dataclasses.dataclass(eq=False)
class Slot:
  """One parameter leaf of one step, and what happened to it."""

  path: str
  # What the loss sees (set by ``watch``); kept alive so its id stays unique.
  view: jax.Array | None
  weight: jax.Array  # The channel whose cotangent carries the gradient.
  state: Any  # The optimizer state leaves its program reads.
  # The leaf's step (``plan.LeafProgram``), its position in the params, and
  # how many ``immgrad.scan`` slicings deep this slot is.
  program: Any = None
  index: int = 0
  depth: int = 0
  # Measuring dX's change (``measure_dx``): a float32 zero shaped like the
  # weight, whose cotangent carries its layer's measurement; else None.
  probe: jax.Array | None = None
  layer: str | None = None  # The immediate layer call that claimed it.
  stepped: bool = False  # That layer's backward rule ran.
  ordinary: bool = False  # An ordinary use sent back a nonzero cotangent.
  # For a slice made by ``immgrad.scan`` (or an argument of a nested trace):
  # the outer slot it came from, and the call that made it.
  parent: Optional["Slot"] = None
  origin: Any = None
  sliced: bool = False  # A slice along the layer axis of ``parent``.
  # On a claimed slot: how many ``immgrad.scan`` slicings stand between it
  # and the layer that claimed it (its leading layer axes).
  layer_axes: int = 0
  _claims: Any = None  # On a parent: the origin and layer that claimed it.

  def claim(self, layer: str) -> None:
    """Marks this slot, and the slots it was sliced from, as ``layer``'s."""
    if self.layer is not None:
      raise ValueError(
        _TWICE.format(path=self.path, first=self.layer, second=layer)
      )
    self.layer = layer
    child, slot, layer_axes = self, self.parent, 0
    while slot is not None:
      layer_axes += child.sliced
      # A body JAX traces twice (scan retraces on a weak-typed carry) claims
      # again from the same call: that is not a second use.
      if slot.layer is not None and slot._claims != (child.origin, layer):
        raise ValueError(
          _TWICE.format(path=slot.path, first=slot.layer, second=layer)
        )
      slot.layer, slot._claims = layer, (child.origin, layer)
      slot.layer_axes = layer_axes
      child, slot = slot, slot.parent

  def watch(self, leaf: jax.Array) -> jax.Array:
    """Makes this slot's view ``leaf`` through :func:`watched`; returns it."""
    self.view = watched(leaf, self.mark_ordinary)
    return self.view

  def mark_ordinary(self) -> None:
    """Records that an ordinary use sent back a nonzero cotangent."""
    self.ordinary = True

  def mark_stepped(self) -> None:
    """Records that the claiming layer's backward rule produced new values."""
    slot = self
    while slot is not None:
      slot.stepped = True
      slot = slot.parent


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one ``value_and_grad`` step fixes for every layer in it."""

  tx: Any  # The shim's inner optimizer.
  params: Any  # The params' shapes, for per-layer programs.
  shared: tuple  # Positions of the state no parameter owns.
  dx_at: float  # dX at W + dx_at * (W_new - W).
  axis_name: Any = None  # Gradients are averaged over it.
  atomic: bool = False  # Layers report whether their step was finite.
  measure_dx: bool = False  # Layers report |dX_new - dX| / |dX|.
  reduce_dtype: Any = None  # Of the average over axis_name.
  # Layers return their new weights and owned state through the cotangent
  # slots of the weight channel and the state (``immgrad.train_step``),
  # not their gradient: written in place, no gradient tree is kept.
  in_place: bool = False

  @property
  def steps_in_backward(self) -> bool:
    """Whether a layer's backward rule steps its parameters: it then
    reads their optimizer state, which otherwise no layer needs (and which
    ``immgrad.scan``'s loops then need not carry).
    """
    return self.dx_at != 0 or self.atomic or self.measure_dx or self.in_place


class Registry:
  """The parameter slots of one trace of a step, by object identity.

  ``settings`` are the step's, shared by the registries of its nested
  traces; ``flag`` is this trace's: a zero scalar whose (summed) cotangent
  counts the layers whose step was not finite (atomic steps).
  """

  def __init__(
    self, settings: Settings, flag: jax.Array, parent: Optional["Registry"]
  ):
    self.settings = settings
    self.flag = flag
    self.parent = parent  # The registry of the enclosing trace, if nested.
    self.slots: list[Slot] = []
    self._by_id: dict[int, Slot] = {}
    self._trace: Any = None  # Set by `opened`, in the trace of the loss.

  def add(self, slot: Slot) -> None:
    self.slots.append(slot)
    self._by_id[id(slot.view)] = slot

  def find(self, leaf: Any, user: str) -> Slot | None:
    """The slot whose view ``leaf`` is, or None; ``user`` names the caller.

    Raises if ``leaf`` is a view of this trace or an enclosing one but we
    are not in the trace it was made in.
    """
    registry = self
    while registry is not None:
      slot = registry._by_id.get(id(leaf))
      if slot is not None:
        if registry is not self or get_opaque_trace_state() != self._trace:
          raise nested_error(user, slot.path)
        return slot
      registry = registry.parent
    return None

  def find_all(self, leaves: list, user: str) -> list[tuple[int, Slot]]:
    """``(position, slot)`` of each of ``leaves`` that is a view, in order."""
    found = [(i, self.find(leaf, user)) for i, leaf in enumerate(leaves)]
    return [(i, slot) for i, slot in found if slot is not None]

  def nested(self, flag: jax.Array | None = None) -> "Registry":
    """A registry for the body of a transformation traced inside this
    trace, with its own ``flag`` if the body takes it in (else this one's).
    """
    return Registry(self.settings, self.flag if flag is None else flag, self)

  def claim(self, layer: str, params: Any) -> list[Slot]:
    """Returns the slots of ``params``'s leaves, now owned by ``layer``."""
    found = []
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
      slot = self.find(leaf, layer)
      if slot is None:
        raise self._not_a_parameter(layer, keypath, leaf)
      if slot in found:
        raise ValueError(
          _TWICE.format(path=slot.path, first=layer, second=layer)
        )
      found.append(slot)
    for slot in found:
      slot.claim(layer)
    return found

  def _not_a_parameter(self, layer: str, keypath, leaf) -> ValueError:
    """The error for a layer given a value computed from a parameter."""
    shape = jax.core.ShapedArray(jnp.shape(leaf), jnp.result_type(leaf))
    transposed = [
      jax.tree_util.keystr(path)
      for path, p in jax.tree_util.tree_flatten_with_path(self.settings.params)[
        0
      ]
      if len(p.shape) > 1 and p.shape == shape.shape[::-1] != p.shape[::-1]
    ]
    hint = _TRANSPOSED.format(path=transposed[0]) if transposed else ""
    return ValueError(
      _NOT_A_PARAMETER.format(
        layer=layer,
        where=jax.tree_util.keystr(keypath),
        shape=shape.str_short(),
        hint=hint,
      )
    )


def watched(leaf: jax.Array, on_use: Callable[[], None]) -> jax.Array:
  """``leaf``, through an identity that reports ordinary uses.

  Its backward rule calls ``on_use()`` (at trace time) when a cotangent
  that is not a symbolic zero comes back, that is when something other
  than an immediate layer used the value: an immediate layer reads the
  hidden weight channel, never the value itself.
  """

  @jax.custom_vjp
  def sentinel(x):
    return x

  def fwd(x):
    return x.value, None

  def bwd(_, ct):
    if isinstance(ct, jax.custom_derivatives.SymbolicZero):
      # SymbolicZero forwards .dtype to its aval by __getattr__, which
      # JAX's annotations type as the aval's attribute or a method.
      return (jnp.zeros(ct.shape, ct.dtype),)  # pyright: ignore[reportArgumentType]
    on_use()
    return (ct,)

  sentinel.defvjp(fwd, bwd, symbolic_zeros=True)
  return sentinel(leaf)


_steps = threading.local()


def current() -> Registry | None:
  """The innermost open registry, or None outside ``immgrad.value_and_grad``."""
  stack = getattr(_steps, "stack", [])
  return stack[-1] if stack else None


def analysing() -> Registry | None:
  """The registry hidden by :class:`hidden` while its loss is traced whole."""
  stack = getattr(_steps, "stack", [])
  if stack and stack[-1] is None:
    return _steps.hidden[-1]
  return None


class hidden:
  """Context manager: no step is current inside, :func:`analysing` says
  which is hidden. ``immgrad.immediate`` traces a whole loss so, to plan
  it as one program: immediate layers and adapters inside are plain JAX,
  each decorated layer one unit.
  """

  def __init__(self, step: Registry | None):
    self._step = step

  def __enter__(self) -> None:
    if not hasattr(_steps, "stack"):
      _steps.stack, _steps.hidden = [], []
    _steps.stack.append(None)
    _steps.hidden = getattr(_steps, "hidden", []) + [self._step]

  def __exit__(self, *exc) -> None:
    _steps.stack.pop()
    _steps.hidden = _steps.hidden[:-1]


class opened:
  """Context manager: makes ``step`` current while the loss is traced.

  Enter it inside the function being differentiated: the trace it is entered
  in is the only one in which ``step`` answers.
  """

  def __init__(self, step: Registry):
    self._step = step

  def __enter__(self) -> Registry:
    if not hasattr(_steps, "stack"):
      _steps.stack = []
    self._step._trace = get_opaque_trace_state()
    _steps.stack.append(self._step)
    return self._step

  def __exit__(self, *exc) -> None:
    _steps.stack.pop()
