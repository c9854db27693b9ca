"""``value_and_grad``: one training step's loss and what the shim consumes.

The loss is differentiated with respect to the views it sees, a hidden
weight channel per leaf (whose cotangent is an immediate layer's ``dW``) and
the step's finiteness flag (``docs/design.md``, "Two channels per
parameter leaf").
"""

import math
import numbers
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from immgrad._src import auto
from immgrad._src import axes
from immgrad._src import base
from immgrad._src import context
from immgrad._src import plan as plan_lib
from immgrad._src import shim as shim_lib

_MODES = {"current": 0.0, "updated": 1.0}

_MIXED = (
  "{name}: parameter {path} is stepped by immediate layer "
  "{layer!r} and also used outside it in a way that cannot fold into its "
  "step: tied (an embedding's transpose for the logits), or in a term "
  "joining it with other parameters before reducing it to a number "
  "(sum(w ** 2) folds). The layer's step would miss that part of the "
  "gradient. For weight decay use optax.adamw; give a tied parameter its "
  "own parameter per use, or leave it undecorated everywhere."
)

_NO_LAYER = (
  "{name}: mode={mode!r} takes each immediate layer's dX "
  "at its stepped weights, but no immediate layer used any parameter of "
  "{fun!r}, so every parameter would train ordinarily. Wrap the model or "
  "the loss with immgrad.immediate(...) or an adapter "
  "(immgrad.haiku.immediate, immgrad.flax.immediate, "
  "immgrad.equinox.immediate), or decorate its layers with "
  "@immgrad.immediate_layer; if it is wrapped, immgrad.layers(...) says "
  'why each parameter stays ordinary. For plain training, use mode="current".'
)


def value_and_grad(
  fun: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  mode: str | float = "updated",
  axis_name=None,
  reduce_dtype=None,
  has_aux: bool = False,
  measure_dx: bool = False,
) -> Callable[..., Any]:
  """Makes a training step in which immediate layers update during backprop.

  Args:
    fun: the loss, ``fun(params, *args)``, returning a scalar (or
      ``(scalar, aux)`` with ``has_aux``).
    tx: the optimizer from :func:`immgrad.shim`; its inner rule steps the
      immediate layers, its ``update`` the rest.
    mode: ``"updated"`` computes each immediate layer's input gradient from
      its new weights; ``"current"`` from the old ones, which reproduces
      ordinary training. A number ``a`` computes it at
      ``W + a * (W_new - W)``: ``0`` is ``"current"``, ``1`` is
      ``"updated"`` (bit for bit), and any other real number, negative or
      above 1, interpolates or extrapolates. Any mode but ``"current"``
      needs an immediate layer in ``fun``: without one it raises
      ``ValueError``.
    axis_name: a ``pmap``/``shard_map`` axis (or tuple of axes) to average
      every gradient over before it is used, immediate or ordinary. Leave it
      None under plain ``jit`` over a sharded batch: XLA reduces there.
    reduce_dtype: the dtype gradients are averaged over ``axis_name`` in
      (as PyTorch FSDP's ``MixedPrecision(reduce_dtype=...)``), e.g.
      ``jnp.bfloat16`` to halve the bytes each all-reduce moves: each
      gradient is cast to it for the collective and back to its own dtype
      after, before any optimizer sees it. Default None: the gradients'
      own dtype. Needs ``axis_name``.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    measure_dx: also measure, in each immediate layer's backward rule, how
      much the update changes the gradient it sends on:
      ``|dX_updated - dX_current| / |dX_current|`` (norms over the whole
      input and batch, replicas included), whatever ``mode`` uses. Costs
      one more input-gradient product per layer, only when asked.

  Returns:
    ``step(params, opt_state, *args) -> (loss, grads)`` (or
    ``((loss, aux), grads)``), where ``grads`` is what ``tx.update``
    consumes: for each immediate layer's parameters an
    :class:`ImmediateGrad` (its gradient, which the layer already stepped
    with in the backward pass), for every other used parameter its
    gradient, and for an unused one a :class:`Stepped` that keeps it.
    With ``measure_dx``, ``step`` returns ``(loss, grads, dx_change)``:
    ``dx_change`` is shaped like ``params``, each leaf of an immediate
    layer holding that layer's measurement (a float32 scalar; for a
    stacked parameter of ``immgrad.scan`` one per layer, shape
    ``leaf.shape[:1]``) and every other leaf None.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> @immgrad.immediate_layer
    ... def dense(x, p):
    ...   return x @ p["w"]
    >>> def loss_fn(params, x, y):
    ...   h = jax.nn.relu(dense(x, params["l1"]))
    ...   return jnp.mean((dense(h, params["l2"]) - y) ** 2)
    >>> params = {"l1": {"w": jnp.full((2, 3), 0.5)},
    ...           "l2": {"w": jnp.full((3, 1), 0.5)}}
    >>> tx = immgrad.shim(optax.adam(1e-2))
    >>> opt_state = tx.init(params)
    >>> step = jax.jit(immgrad.value_and_grad(loss_fn, tx))
    >>> x, y = jnp.ones((4, 2)), jnp.zeros((4, 1))
    >>> for _ in range(3):
    ...   loss, grads = step(params, opt_state, x, y)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   params = optax.apply_updates(params, updates)
    ...   print(f"{loss:.4f}")
    2.2500
    2.0753
    1.9114

    Data parallel, one replica per local device, each gradient averaged
    over the replicas in bfloat16:

    >>> n = jax.local_device_count()
    >>> dp_step = jax.pmap(
    ...     immgrad.value_and_grad(
    ...         loss_fn, tx, axis_name="d", reduce_dtype=jnp.bfloat16),
    ...     axis_name="d")
    >>> copies = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * n), tree)
    >>> loss, grads = dp_step(copies(params), copies(opt_state),
    ...                       copies(x), copies(y))
    >>> loss.shape == (n,)
    True
  """
  return make(
    fun,
    tx,
    mode=mode,
    axis_name=axis_name,
    reduce_dtype=reduce_dtype,
    has_aux=has_aux,
    measure_dx=measure_dx,
  )


def make(
  fun: Callable[..., Any],
  tx: optax.GradientTransformation,
  *,
  mode: str | float,
  axis_name=None,
  reduce_dtype=None,
  has_aux: bool = False,
  measure_dx: bool = False,
  in_place: bool = False,
  name: str = "immgrad.value_and_grad",
) -> Callable[..., Any]:
  """:func:`value_and_grad`; with ``in_place``, each immediate parameter's
  leaf of ``grads`` is a :class:`Stepped` holding its new weights and
  owned state, which its layer's backward rule returned in place of its
  gradient (``immgrad.train_step``). ``name`` is the front in errors.
  """
  dx_at = _dx_at(mode, name)
  reduce_dtype = axes.reduce_dtype_of(reduce_dtype, axis_name, name)
  if not isinstance(tx, base.ShimTransformation):
    raise TypeError(
      f"{name}: tx must be the optimizer from "
      f"immgrad.shim(...), got {tx!r}. Wrap your optax optimizer: "
      "tx = immgrad.shim(optax.adam(1e-3))."
    )
  if not callable(fun):
    raise TypeError(f"{name}: fun must be callable, got {fun!r}.")

  def run_step(params, opt_state, args, whole_loss):
    axes.check_bound(axis_name, name)
    keyed, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [jax.tree_util.keystr(path) for path, _ in keyed]
    leaves = [leaf for _, leaf in keyed]
    plan = plan_lib.cut(tx.inner, params)
    state = shim_lib.state_leaves(plan, opt_state)
    states = [[state[k] for k in leaf.reads] for leaf in plan.leaves]
    if in_place:
      _check_in_place(plan, paths, name)
    shapes = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), params
    )
    settings = context.Settings(
      tx=tx.inner,
      params=shapes,
      shared=plan.shared_positions,
      dx_at=dx_at,
      axis_name=axis_name,
      atomic=tx.atomic,
      measure_dx=measure_dx,
      reduce_dtype=reduce_dtype,
      in_place=in_place,
    )
    run: context.Registry | None = None

    # In place, the state is differentiated too: its cotangent carries the
    # new state of each parameter a layer stepped.
    def loss(views, weights, flag, probes, owned):
      nonlocal run
      run = context.Registry(settings, flag, parent=None)
      for i, view in enumerate(views):
        slot = context.Slot(
          path=paths[i],
          view=None,
          weight=weights[i],
          state=states[i] if owned is None else owned[i],
          probe=probes[i] if measure_dx else None,
          program=plan.leaves[i],
          index=i,
        )
        views[i] = slot.watch(view)
        run.add(slot)
      with context.opened(run):
        out = (whole_loss or (fun,))[0](treedef.unflatten(views), *args)
      _check_loss(fun, out, has_aux, name)
      return out

    probes = (
      [jnp.zeros(jnp.shape(leaf), jnp.float32) for leaf in leaves]
      if measure_dx
      else None
    )
    value, backward, *aux = jax.vjp(
      loss,
      leaves,
      leaves,
      jnp.zeros((), jnp.float32),
      probes,
      states if in_place else None,
      has_aux=has_aux,
    )
    assert run is not None  # Set by loss, which jax.vjp has just traced.
    if dx_at != 0 and all(slot.layer is None for slot in run.slots):
      raise ValueError(
        _NO_LAYER.format(
          name=name, mode=mode, fun=getattr(fun, "__qualname__", fun)
        )
      )
    cts, dws, nonfinite, changes, written = backward(jnp.ones_like(value))
    grads = []
    claimed = {i: s.layer for i, s in enumerate(run.slots) if s.layer}
    for i, slot in enumerate(run.slots):
      if whole_loss is None and slot.layer is not None and slot.ordinary:
        # The whole loss planned as one program may fold that other use
        # (an L2 term) into the layers' steps; if not, this refusal.
        mixed = ValueError(
          _MIXED.format(name=name, path=slot.path, layer=slot.layer)
        )
        whole = auto.whole(fun, frozenset(claimed))
        try:
          return run_step(params, opt_state, args, (whole, claimed))
        except ValueError as e:  # Whatever it refuses, this says why.
          raise mixed from e
      if (
        whole_loss
        and i in whole_loss[1]
        and (slot.layer is None or slot.ordinary)
      ):
        raise ValueError(
          _MIXED.format(name=name, path=slot.path, layer=whole_loss[1][i])
        )
      if slot.layer is not None and slot.ordinary:
        raise ValueError(
          _MIXED.format(name=name, path=slot.path, layer=slot.layer)
        )
      if slot.layer is not None and slot.stepped and in_place:
        program = plan.leaves[i]
        grads.append(
          base.Stepped(
            dws[i], [written[i][program.reads.index(k)] for k in program.writes]
          )
        )
      elif slot.layer is not None and slot.stepped:
        grads.append(
          base.ImmediateGrad(
            dws[i], nonfinite if tx.atomic else None, slot.layer_axes
          )
        )
      elif slot.ordinary:
        grads.append(
          axes.mean_of_cotangent(cts[i], leaves[i], axis_name, reduce_dtype)
        )
      else:  # Untouched this step: keep its weights and state.
        grads.append(base.Stepped(leaves[i]))
    grads = treedef.unflatten(grads)
    value = (value, aux[0]) if has_aux else value
    if measure_dx:
      return (
        value,
        grads,
        treedef.unflatten(
          [_measured(change, slot) for change, slot in zip(changes, run.slots)]
        ),
      )
    return value, grads

  def step(params, opt_state, *args):
    return run_step(params, opt_state, args, None)

  return step


def _dx_at(mode, name: str) -> float:
  """``mode`` as the fraction of the update that dX sees."""
  if isinstance(mode, str) and mode in _MODES:
    return _MODES[mode]
  if (
    isinstance(mode, numbers.Real)
    and not isinstance(mode, bool)
    and math.isfinite(mode)
  ):
    return float(mode)
  raise ValueError(
    f'{name}: mode must be "current", "updated" or a '
    f"finite real number a (dX at W + a * (W_new - W)), got {mode!r}."
  )


def _measured(change, slot):
  """A leaf's dX measurement from its probe's cotangent, or None."""
  if slot.layer is None or not slot.stepped:
    return None
  first = (slice(None),) * slot.layer_axes
  return change[first + (0,) * (change.ndim - slot.layer_axes)]


def _check_loss(fun, out, has_aux, name: str):
  if has_aux and not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(
      f"{name}: with has_aux=True, {fun!r} must return "
      f"(loss, aux), got {type(out).__name__}."
    )
  value = out[0] if has_aux else out
  if not (
    getattr(value, "shape", None) == ()
    and jnp.issubdtype(jnp.result_type(value), jnp.floating)
  ):
    raise TypeError(
      f"{name}: {getattr(fun, '__qualname__', fun)!r} "
      f"must return a real scalar loss, got {value!r}."
    )


_NOT_IN_PLACE = (
  "{name}: the optimizer's step for parameter {path} writes state leaf "
  "{leaf} ({aval}){why}, which a step written in place cannot return "
  "through its layer's backward pass. Use a shim with atomic=True (the "
  "default), whose step keeps the gradients, or drop that part of the "
  "optimizer."
)


def _check_in_place(plan: plan_lib.Plan, paths: list, name: str) -> None:
  """Refuses a rule whose per-parameter state the in-place step cannot
  carry: a leaf written but not read (its old value has no slot to come
  back through), or one that is not floating point (no cotangent).
  """
  state_paths = [
    jax.tree_util.keystr(path)
    for path, _ in jax.tree_util.tree_flatten_with_path(
      plan.state_def.unflatten(plan.state_avals)
    )[0]
  ]
  for path, program in zip(paths, plan.leaves):
    for k in program.writes:
      aval = plan.state_avals[k]
      why = None
      if not jnp.issubdtype(aval.dtype, jnp.floating):
        why = ", not floating point"
      elif k not in program.reads:
        why = " without reading it"
      if why is not None:
        raise ValueError(
          _NOT_IN_PLACE.format(
            name=name,
            path=path,
            leaf=state_paths[k],
            aval=f"{aval.dtype}{list(aval.shape)}",
            why=why,
          )
        )
