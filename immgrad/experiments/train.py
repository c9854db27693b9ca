"""Trains one task several ways, in lockstep, data parallel over a mesh.

The methods (:func:`methods_of`) start from the same parameters and see the
same batches in the same order, taking turns step by step.
"""

import dataclasses
import math
import time
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

import immgrad

METHODS = ("plain", "current", "updated")
AXIS = "data"


def methods_of(modes=None) -> dict:
  """Method name -> immgrad mode (None: plain), in the order they are run.

  Without ``modes``: plain, current and updated. With a list of numbers
  ``a``: plain, then ``a=<a>`` for each (``value_and_grad(mode=a)``).
  """
  if modes is None:
    return {"plain": None, "current": "current", "updated": "updated"}
  out: dict[str, str | float | None] = {"plain": None}
  for a in modes:
    name = mode_name(a)
    if name in out:
      raise ValueError(f"mode {a:g} given twice.")
    out[name] = float(a)
  return out


def mode_name(a: float) -> str:
  return f"a={float(a):g}"


WEIGHT_DECAY = 0.1  # adamw, on the leaves decay_mask selects.
_NOT_DECAYED = ("b", "scale", "offset")  # Haiku's biases and norm params.


def decay_mask(params: Any) -> Any:
  """Which leaves adamw decays: GPT practice, weights but not biases/norms.

  ``True`` for the weights of matrix products and embeddings (Haiku's
  ``w``, ``embeddings``, and learned positions), ``False`` for biases and
  LayerNorm scales and offsets, by the leaf's name, so stacked layers
  (``hk.layer_stack``) are masked like unrolled ones.
  """
  return jax.tree_util.tree_map_with_path(
    lambda path, _: getattr(path[-1], "key", None) not in _NOT_DECAYED, params
  )


def schedule(lr: float, steps: int) -> optax.Schedule:
  """Linear warm-up from 0 over 5% of the steps, cosine decay to lr / 10."""
  return optax.warmup_cosine_decay_schedule(
    0.0,
    lr,
    warmup_steps=max(1, steps // 20),
    decay_steps=steps,
    end_value=lr / 10,
  )


def optimizer(
  name: str, lr: float, steps: int = 1000
) -> optax.GradientTransformation:
  """``name`` at ``lr``; ``adamw`` with :func:`schedule` over ``steps``.

  adamw is the language-model recipe: betas (0.9, 0.95), weight decay
  ``WEIGHT_DECAY`` on :func:`decay_mask`'s leaves, the learning rate
  warmed up and decayed by :func:`schedule`. The others are constant.
  """
  if name == "sgd":
    return optax.sgd(lr)
  if name == "momentum":
    return optax.sgd(lr, momentum=0.9)
  if name == "adam":
    return optax.adam(lr)
  if name == "adamw":
    return optax.adamw(
      schedule(lr, steps),
      b1=0.9,
      b2=0.95,
      weight_decay=WEIGHT_DECAY,
      mask=decay_mask,
    )
  raise ValueError(
    f"unknown optimizer {name!r}: choose sgd, momentum, adam or adamw."
  )


@dataclasses.dataclass
class Run:
  """One method's record of one training run."""

  method: str
  losses: list = dataclasses.field(default_factory=list)  # Per step.
  seconds: list = dataclasses.field(default_factory=list)  # Per step.
  evals: list = dataclasses.field(default_factory=list)  # {"step", ...}.
  diverged_at: int | None = None  # First step with a non-finite loss.
  compile_seconds: float = 0.0
  final_params: Any = None  # On the host, after the last step.
  # measure_dx: layer name -> per step |dX_updated - dX_current| / |dX_current|.
  dx_change: dict | None = None


def layer_name(path) -> str:
  """A parameter leaf's layer: its path without the leaf's own key.

  Haiku names a module's parameters ``params[module][name]``, so this is the
  module's name (``"linear_3"``, ``"blocks/~/multi_head_attention/query"``).
  """
  keys = [
    getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path
  ]
  return "/".join(str(k) for k in keys[:-1]) or str(keys[-1])


def _per_layer(dx_change) -> dict:
  """The measurement of each immediate layer, once (from its first leaf)."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(dx_change)[0]:
    out.setdefault(layer_name(path), leaf)  # None leaves are not leaves.
  return out


STEPS = ("optax", "atomic", "in-place")


def _step_fn(mode, task, opt, mesh, measure_dx=False, kind="optax"):
  """The jitted, sharded training step of ``method``, and its optimizer.

  ``kind`` (an immgrad method's step): ``"optax"``, ``value_and_grad`` +
  ``tx.update`` + ``optax.apply_updates`` with ``shim(opt,
  atomic=False)``; ``"atomic"``, the same with the default atomic shim;
  ``"in-place"``, ``immgrad.train_step`` with ``shim(opt, atomic=False)``,
  each layer's new weights written over the old.
  """
  dx_out = ()
  if mode is not None and kind == "in-place":
    tx = immgrad.shim(opt, atomic=False)
    whole = immgrad.train_step(task.loss_fn, tx, mode=mode, axis_name=AXIS)

    def in_place(params, opt_state, inputs, targets):
      loss, params, opt_state = whole(params, opt_state, inputs, targets)
      return params, opt_state, jax.lax.pmean(loss, AXIS)

    step = in_place
  elif mode is None:
    tx = opt

    def plain_step(params, opt_state, inputs, targets):
      loss, grads = jax.value_and_grad(task.loss_fn)(params, inputs, targets)
      grads = jax.lax.pmean(grads, AXIS)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (
        optax.apply_updates(params, updates),
        opt_state,
        jax.lax.pmean(loss, AXIS),
      )

    step = plain_step
  else:
    tx = immgrad.shim(opt, atomic=kind == "atomic")
    grad_fn = immgrad.value_and_grad(
      task.loss_fn, tx, mode=mode, axis_name=AXIS, measure_dx=measure_dx
    )
    if measure_dx:
      dx_out = (P(),)  # Already averaged over the axis: replicated.

    def step(params, opt_state, inputs, targets):
      loss, grads, *dx = grad_fn(params, opt_state, inputs, targets)
      updates, opt_state = tx.update(grads, opt_state, params)
      dx = (_per_layer(dx[0]),) if measure_dx else ()
      return (
        optax.apply_updates(params, updates),
        opt_state,
        jax.lax.pmean(loss, AXIS),
        *dx,
      )

  sharded = jax.shard_map(
    step,
    mesh=mesh,
    in_specs=(P(), P(), P(AXIS), P(AXIS)),
    out_specs=(P(), P(), P()) + dx_out,
    check_vma=False,
  )
  return tx, jax.jit(sharded, donate_argnums=(0, 1))


def train(
  task,
  *,
  optimizer_name: str,
  lr: float,
  steps: int,
  batch_size: int,
  seed: int,
  eval_every: int,
  progress=None,
  methods: dict | None = None,
  measure_dx: bool = False,
  devices=None,
  current_for: int = 0,
  step_kind: str = "optax",
) -> dict[str, Run]:
  """Trains ``task`` with every method; returns their records.

  ``methods``: name -> mode, from :func:`methods_of` (default: plain,
  current, updated). ``measure_dx``: record each immgrad method's dX change
  per layer and step in ``Run.dx_change``. ``devices``: those to train
  data parallel on (default: all). ``current_for``: every immgrad method
  takes its first ``current_for`` steps in mode ``current`` (ordinary
  training, in the shim's own state) and its own mode after.
  ``step_kind``: how the immgrad methods' step is written (``STEPS``; see
  ``_step_fn``).

  Each step runs under ``jax.shard_map`` over the devices (the batch split
  along the data axis, parameters replicated), jitted with parameters and
  optimizer state donated; ``current`` averages each layer's gradient in its
  backward rule and must track ``plain`` to float rounding. The methods take
  turns in an order that rotates every step, so that drift in the machine's
  speed (another process, thermal throttling) falls on all of them alike. A
  step's time is the wall time from dispatch until its loss is on the host;
  compilation is done, and timed, before the first step. Unless
  ``step_kind="atomic"``, the shim runs with ``atomic=False``: a non-finite
  step is applied, as plain optax would; a non-finite loss is counted as a
  divergence either way.
  """
  if measure_dx and step_kind == "in-place":
    raise ValueError(
      "train(measure_dx=True) measures through immgrad.value_and_grad; "
      "step_kind='in-place' (immgrad.train_step) has no such channel. "
      "Measure with step_kind='optax' (the same arithmetic, optax's step)."
    )
  methods = methods or methods_of()
  names = tuple(methods)
  devices = list(devices or jax.devices())
  if batch_size % len(devices):
    raise ValueError(
      f"--batch-size {batch_size} must be a multiple of the "
      f"number of devices ({len(devices)})."
    )
  mesh = jax.make_mesh((len(devices),), (AXIS,), devices=devices)
  replicated = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P(AXIS))
  init = jax.device_get(task.init(seed))  # Fresh buffers per method.
  batches = task.batches(seed, batch_size)
  first = next(task.batches(seed, batch_size))
  runs, state, compiled, early = {}, {}, {}, {}
  for method, mode in methods.items():
    opt = optimizer(optimizer_name, lr, steps)
    tx, step = _step_fn(
      mode, task, opt, mesh, measure_dx=measure_dx, kind=step_kind
    )
    params = jax.device_put(init, replicated)
    opt_state = jax.device_put(tx.init(init), replicated)
    args = (params, opt_state, *jax.device_put(first, split))
    start = time.perf_counter()
    compiled[method] = step.lower(*args).compile()
    if current_for and mode not in (None, 0.0, "current"):
      # The same shim's state, stepped in mode "current".
      _, step = _step_fn(
        0.0, task, opt, mesh, measure_dx=measure_dx, kind=step_kind
      )
      early[method] = step.lower(*args).compile()
    runs[method] = Run(method, compile_seconds=time.perf_counter() - start)
    if measure_dx and mode is not None:
      runs[method].dx_change = {}
    state[method] = (params, opt_state)

  def evaluate(step_number):
    for method, run in runs.items():
      if run.diverged_at is None:  # On one device, not once per replica.
        params = jax.device_get(state[method][0])
        run.evals.append({"step": step_number, **task.evaluate(params)})

  evaluate(0)
  for i in range(steps):
    batch = jax.device_put(next(batches), split)
    k = i % len(names)
    for method in names[k:] + names[:k]:
      run = runs[method]
      if run.diverged_at is not None:
        continue
      early_step = i < current_for and method in early
      step = early[method] if early_step else compiled[method]
      start = time.perf_counter()
      params, opt_state, loss, *dx = step(*state[method], *batch)
      loss = float(loss) * task.loss_scale
      run.seconds.append(time.perf_counter() - start)
      run.losses.append(loss)
      state[method] = (params, opt_state)
      if dx:  # After the timing: the copy to the host is not the step's.
        _record_dx(run.dx_change, jax.device_get(dx[0]))
      if not math.isfinite(loss):
        run.diverged_at = i + 1
    if (i + 1) % eval_every == 0 or i + 1 == steps:
      evaluate(i + 1)
    if progress is not None:
      progress.update(1)
      progress.set_postfix(
        {m: f"{r.losses[-1]:.3f}" if r.losses else "-" for m, r in runs.items()}
      )
  for method in names:
    runs[method].final_params = jax.device_get(state[method][0])
  return runs


def _record_dx(record: dict, measured: dict) -> None:
  """Appends one step's measurements; a stacked layer's one per index."""
  for name, value in measured.items():
    value = np.asarray(value, np.float64)
    if value.ndim == 0:
      record.setdefault(name, []).append(float(value))
    else:
      for index, v in enumerate(value.reshape(-1)):
        record.setdefault(f"{name}[{index}]", []).append(float(v))


def max_param_difference(a: Any, b: Any) -> float:
  return max(
    float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )
