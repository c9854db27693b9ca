"""The optax catalogue through ``immgrad.shim``: every rule, and its status.

The list of rules is discovered from the installed optax (``optax`` and
``optax.contrib``), never kept by hand: every public callable whose return
annotation is a ``GradientTransformation`` (and every public class with a
``gradient_transformation`` method, like ``MultiSteps``) is a case. A
callable with no return annotation is tried (if it needs no arguments) or
must be named in :data:`NOT_RULES`; anything undecided is reported by
:func:`discover` as unclassified, and ``test_catalogue.py`` fails on it, so a
new optax release forces a decision.

What is kept by hand is only what cannot be inferred:

* :data:`ARGS`: construction arguments (the generic ones, by parameter
  name, are in :data:`BY_PARAM`), chosen so the rule does something on the
  tiny model (a clip that binds, factored second moments on 5x8 weights).
* :data:`EXTRA_ARGS`: rules whose ``update`` needs more than
  ``(grads, state, params)``, and what; the test checks each fails without
  it and runs with it.
* :data:`PRNG_STATE`: rules that draw random numbers from a key in their
  state (one key per parameter under the shim, one for the tree in plain
  training).
* :data:`SEMANTIC`: rules that are whole-tree by what they do on inputs a
  clean run does not show (a non-finite gradient), or by what they keep in
  their state, not by their trajectory.

Everything else is measured. Each case is trained on a tiny model for
:data:`STEPS` steps, plainly (``jax.value_and_grad`` + the whole-tree
optax update) and through ``immgrad.shim`` (``mode="current"``); a rule
the shim refuses is trained leaf by leaf instead (one ``tx`` state per
leaf, as the shim would), to show the refusal is real: a whole-tree rule
trains differently leaf by leaf. Comparisons are in float64 (with
``JAX_ENABLE_X64=1``, in a subprocess) to :data:`F64_TOL`, so a real
difference cannot hide behind float32 rounding, which some rules amplify
past any useful float32 tolerance in 40 steps (radam, contrib.cocob); the
float32 run is reported alongside, for information.

Statuses (:func:`status`):

* ``per-parameter``: accepted by the shim, and equal to plain training;
* ``whole-tree``: refused by the shim with a ValueError naming the rule;
* ``extra arguments``: ``update`` needs more than grads, state and params.

Two verdicts fail the test: :data:`SILENT` (accepted, but training
differently) and :data:`WRONGLY_REFUSED` (a per-parameter rule refused: a
params-shaped option, a mask or labels, or a PRNG key in its state, which
the shim supports).

Script use::

  python tests/catalogue.py --readme           # docs/optimizer.md's table
  python tests/catalogue.py --json OUT.json    # results, this process' dtype
  python tests/catalogue.py --readme --results OUT.json  # table of those
"""

import argparse
import dataclasses
import functools
import inspect
import json
import os
import subprocess
import sys
import time
import typing
from typing import Any, Callable
import warnings

import jax
from jax import lax
import jax.numpy as jnp
import optax
import optax.contrib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import immgrad
import oracles
import xla_flags

MODULES = {"": optax, "contrib.": optax.contrib}

STEPS = 48
SIZES = (5, 8, 3)
BATCH = 8
LR = 1e-2
# Comparisons: max |got - want| / max(1, |want|) over every parameter after
# every step and every loss.
F64_TOL = 1e-10
F32_TOL = 1e-5
# Leaf by leaf, a whole-tree rule moves the params by far more than this.
WHOLE_TREE_MIN = 1e-6

PER_PARAMETER = "per-parameter"
WHOLE_TREE = "whole-tree"
EXTRA = "extra arguments"
STATUSES = (PER_PARAMETER, WHOLE_TREE, EXTRA)

# Public callables without a return annotation that are not rule factories.
NOT_RULES = {
  "bias_correction": "tree math helper",
  "matrix_inverse_pth_root": "linear algebra helper",
  "sigmoid_binary_cross_entropy": "a loss",
  "update_infinity_moment": "tree math helper",
  "update_moment": "tree math helper",
  "update_moment_per_elem_norm": "tree math helper",
  "contrib.schedule_free_eval_params": "evaluation params of a state",
}


def _per_leaf_mask(params):
  """A mask callable: the matrices, not the biases."""
  return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def _labels(params):
  return jax.tree.map(
    lambda p: "matrix" if jnp.ndim(p) > 1 else "vector", params
  )


def _adam():
  return optax.adam(LR)


def _global_norm(updates):
  return optax.tree.norm(updates)


def _schedule():
  """LR down to LR / 10, linearly, in the run's dtype.

  Not ``optax.linear_schedule``: that computes in float32 even under
  JAX_ENABLE_X64, and an ulp of the rate, rounded in another fusion in the
  shim's program than in plain training's, shows as a 1e-9 difference in a
  float64 comparison.
  """
  dtype = _dtype()
  return lambda count: (
    jnp.asarray(LR, dtype)
    * (1 - 0.9 * jnp.minimum(count, STEPS).astype(dtype) / STEPS)
  )


# Construction arguments by parameter name, for any factory that requires
# one (optional ones keep optax's defaults unless ARGS says otherwise).
BY_PARAM = {
  "learning_rate": lambda: LR,
  "inner": _adam,
  "opt": _adam,
  "tx": _adam,
  "fast_optimizer": _adam,
  "base_optimizer": _adam,
  "optimizer": _adam,
  "adv_optimizer": lambda: optax.sgd(LR),
  "inner_factory": lambda: optax.adam,
  "mask": lambda: _per_leaf_mask,
  "param_labels": lambda: _labels,
  "transforms": lambda: {"matrix": optax.adam(LR), "vector": optax.sgd(LR)},
  "max_delta": lambda: 0.02,
  "threshold": lambda: 0.02,
  "clipping": lambda: 0.05,
  "max_norm": lambda: 0.05,
  "l2_norm_clip": lambda: 0.1,
  "noise_multiplier": lambda: 0.5,
  "seed": lambda: 0,
  "decay": lambda: 0.9,
  "step_size": lambda: -LR,
  "step_size_fn": lambda: lambda count: -LR * 0.95**count,
  "max_consecutive_errors": lambda: 2,
  "should_transform_fn": lambda: lambda count: count % 2 == 0,
  "eta": lambda: 0.01,
  "gamma": lambda: 0.55,
  "max_backtracking_steps": lambda: 5,
  "max_linesearch_steps": lambda: 5,
  "measure": lambda: _global_norm,
  "measure_name": lambda: "norm",
  "measures": lambda: {"norm": optax.measure_with_ema(_global_norm, 0.9)},
  "every_k_schedule": lambda: 2,
  "sync_period": lambda: 3,
  "slow_step_size": lambda: 0.5,
}

# Per-rule arguments (required ones BY_PARAM lacks, and optional ones that
# make the rule act on the tiny model).
ARGS = {
  "adafactor": lambda: dict(learning_rate=LR, min_dim_size_to_factor=2),
  "adadelta": lambda: dict(learning_rate=1.0),
  "scale_by_factored_rms": lambda: dict(min_dim_size_to_factor=2),
  "add_decayed_weights": lambda: dict(weight_decay=0.1),
  "add_noise": lambda: dict(eta=0.01, gamma=0.55, key=0),
  "noisy_sgd": lambda: dict(learning_rate=LR, key=0),
  "apply_every": lambda: dict(k=3),
  # State dtypes that default to float32: the run's dtype instead.
  "MultiSteps": lambda: dict(
    opt=_adam(), every_k_schedule=2, accumulator_dtype=_dtype()
  ),
  "scale_by_distance_over_gradients": lambda: dict(param_dtype=_dtype()),
  # Rank >= 2 only: tried on the matrices, the biases masked out.
  "contrib.scale_by_muon": lambda: dict(
    weight_dimension_numbers=lambda params: jax.tree.map(
      lambda _: optax.contrib.MuonDimensionNumbers(), params
    ),
    wrap=lambda tx: optax.masked(tx, _per_leaf_mask),
  ),
  # Steps it does not transform pass the gradient through: a direction.
  "conditionally_transform": lambda: dict(
    inner=optax.scale_by_adam(), scaled=True
  ),
  "selective_transform": lambda: dict(optimizer=_adam(), freeze_mask=False),
  "stateless": lambda: dict(f=lambda u, p: jax.tree.map(lambda g: -LR * g, u)),
  "stateless_with_tree_map": lambda: dict(f=lambda g, p: -LR * g),
  "scale_by_rprop": lambda: dict(learning_rate=1.0),
  "chain": lambda: dict(
    args=(optax.scale_by_adam(), optax.scale_by_learning_rate(LR))
  ),
  "named_chain": lambda: dict(
    args=(
      ("adam", optax.scale_by_adam()),
      ("lr", optax.scale_by_learning_rate(LR)),
    )
  ),
  # Hyperparameters in the run's dtype (see _schedule).
  "inject_hyperparams": lambda: dict(
    inner_factory=optax.adam,
    hyperparam_dtype=_dtype(),
    call=dict(learning_rate=_schedule()),
  ),
  "inject_stateful_hyperparams": lambda: dict(
    inner_factory=optax.adam,
    hyperparam_dtype=_dtype(),
    call=dict(learning_rate=_schedule()),
  ),
  "lookahead": lambda: dict(
    fast_optimizer=_adam(), sync_period=3, slow_step_size=0.5
  ),
  "contrib.galore": lambda: dict(learning_rate=LR, rank=2, update_proj_gap=5),
  "contrib.scale_by_galore": lambda: dict(rank=2, update_proj_gap=5),
  "contrib.sophia": lambda: dict(learning_rate=LR, update_interval=3),
  "contrib.schedule_free": lambda: dict(
    base_optimizer=optax.sgd(1.0), learning_rate=LR
  ),
  "contrib.scale_by_madgrad": lambda: dict(learning_rate=1.0),
  "contrib.dpsgd": lambda: dict(
    learning_rate=LR, l2_norm_clip=0.1, noise_multiplier=0.5, seed=0
  ),
  "contrib.differentially_private_aggregate": lambda: dict(
    l2_norm_clip=0.1, noise_multiplier=0.5, key=0
  ),
}

# Rules whose update needs more than (grads, state, params): what, and the
# keyword arguments that supply it in plain training (see _extras).
EXTRA_ARGS = {
  "polyak_sgd": ("value",),
  "scale_by_polyak": ("value",),
  "lbfgs": ("value", "grad", "value_fn"),
  "scale_by_zoom_linesearch": ("value", "grad", "value_fn"),
  "scale_by_backtracking_linesearch": ("value", "grad", "value_fn"),
  "contrib.momo": ("value",),
  "contrib.momo_adam": ("value",),
  "contrib.reduce_on_plateau": ("value",),
  "contrib.sophia": ("obj_fn",),
  "contrib.hutchinson_estimator_diag_hessian": ("obj_fn",),
  "contrib.dpsgd": ("per-example gradients",),
  "contrib.differentially_private_aggregate": ("per-example gradients",),
  "lookahead": ("optax.LookaheadParams as params",),
}

PRNG_STATE = {"noisy_sgd", "add_noise"}

# Whole-tree by what a clean trajectory does not show.
SEMANTIC = {
  "apply_if_finite": "skips every parameter's step when any gradient is "
  "not finite",
  "flatten": "keeps one state for all parameters, concatenated",
  "snapshot": "keeps a measurement of the whole tree in its state",
  "monitor": "keeps measurements of the whole tree in its state (and "
  "its init state is shaped unlike its update's, so plain "
  "training cannot carry it through lax.scan either)",
  "measure_with_ema": "a measure for optax.monitor (its update returns "
  "the measurement, not updates): whole-tree",
}

# Parameters that take a params-shaped tree (or a callable making one).
TREE_OPTIONS = ("mask", "weight_decay_mask", "param_labels", "freeze_mask")

WRAPPER_PARAMS = (
  "inner",
  "opt",
  "tx",
  "fast_optimizer",
  "base_optimizer",
  "optimizer",
  "inner_factory",
  "transforms",
)


@dataclasses.dataclass
class Case:
  """One thing to try through the shim."""

  name: str  # "adam", "contrib.cocob", "adamw(mask=tree)"
  rule: str  # The factory's name: "adamw".
  fn: Callable[..., Any]
  wrapper: bool = False
  variant: str | None = None  # The tree option, for params-shaped cases.
  aliases: tuple = ()  # Other names optax exports the same factory under.

  @property
  def display(self) -> str:
    head = f"optax.{self.rule}"
    return head + (f"({self.variant}=tree)" if self.variant else "")


def _is_tx_annotation(annotation) -> bool:
  if annotation is inspect.Signature.empty:
    return False
  if isinstance(annotation, type):
    return issubclass(annotation, optax.GradientTransformation)
  return False


def _mentions_tx(annotation) -> bool:
  return (
    annotation is not inspect.Signature.empty
    and "GradientTransformation" in str(annotation)
  )


def _public(module):
  names = set(getattr(module, "__all__", ())) | set(dir(module))
  return sorted(n for n in names if not n.startswith("_"))


def _canonical(names: list, obj) -> str:
  """The name to file an object exported under several names under."""
  module = getattr(obj, "__module__", "") or ""
  own = [
    n
    for n in names
    if n.startswith("contrib.") == module.startswith("optax.contrib")
  ]
  same = [
    n
    for n in own or names
    if n.split(".")[-1] == getattr(obj, "__name__", None)
  ]
  return (same or own or names)[0]


def discover():
  """``(cases, unclassified)``: every rule optax exports, and the undecided.

  ``unclassified`` lists ``(name, why)`` for public callables that may be a
  rule factory but are neither constructed nor named in NOT_RULES.
  """
  exported = {}  # id -> (obj, names)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Deprecated aliases warn on access.
    for prefix, module in MODULES.items():
      for attr in _public(module):
        obj = getattr(module, attr)
        exported.setdefault(id(obj), (obj, []))[1].append(prefix + attr)
  cases, unclassified = [], []
  for obj, names in exported.values():
    name = _canonical(names, obj)
    aliases = tuple(n for n in names if n != name)
    if inspect.ismodule(obj) or not callable(obj):
      continue
    if inspect.isclass(obj):
      if callable(getattr(obj, "gradient_transformation", None)):
        cases.append(Case(name, name, obj, wrapper=True, aliases=aliases))
      continue
    try:
      sig = inspect.signature(obj)
    except (TypeError, ValueError):
      continue
    if getattr(obj, "__module__", "") == "typing" or isinstance(
      obj, typing.TypeVar
    ):
      continue
    params = sig.parameters.values()
    takes_tx = any(_mentions_tx(p.annotation) for p in params)
    returns = sig.return_annotation
    if _is_tx_annotation(returns) or (takes_tx and _mentions_tx(returns)):
      cases.append(Case(name, name, obj, wrapper=takes_tx, aliases=aliases))
    elif returns is inspect.Signature.empty:
      if name in NOT_RULES:
        continue
      try:
        made = build(Case(name, name, obj))
      except Exception as e:
        unclassified.append((name, f"unannotated, cannot be built: {e}"))
        continue
      if isinstance(made, optax.GradientTransformation):
        cases.append(Case(name, name, obj, wrapper=takes_tx, aliases=aliases))
      else:
        unclassified.append(
          (name, "unannotated and not a rule: name it in NOT_RULES")
        )
  cases.sort(key=lambda c: (c.name.startswith("contrib."), c.name))
  variants = []
  for case in cases:
    if case.wrapper and case.rule in (
      "inject_hyperparams",
      "inject_stateful_hyperparams",
    ):
      continue
    try:
      names = inspect.signature(case.fn).parameters
    except (TypeError, ValueError):
      continue
    for option in TREE_OPTIONS:
      if option in names:
        variants.append(
          dataclasses.replace(
            case, name=f"{case.rule}({option}=tree)", variant=option
          )
        )
  return cases + variants, unclassified


def _tree_option(option: str, params):
  """A params-shaped value for ``option``, on the model's ``params``."""
  if option == "param_labels":
    return _labels(params)
  if option == "freeze_mask":
    return jax.tree.map(lambda p: False, params)
  return _per_leaf_mask(params)


def build(case: Case, params=None, inner=None):
  """The case's transformation (``inner`` replaces a wrapper's rule)."""
  fn = case.fn
  kwargs = ARGS[case.rule]() if case.rule in ARGS else {}
  call = kwargs.pop("call", None)
  args = kwargs.pop("args", ())
  wrap = kwargs.pop("wrap", None)
  kwargs.pop("scaled", None)
  sig = inspect.signature(fn)
  for p in sig.parameters.values():
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in kwargs:
      continue
    if p.default is p.empty or (
      p.name == "learning_rate" and p.default is None
    ):
      if p.name not in BY_PARAM:
        raise TypeError(
          f"{case.name}: no construction value for required "
          f"argument {p.name!r}: add it to catalogue.ARGS"
        )
      kwargs[p.name] = BY_PARAM[p.name]()
  if case.variant:
    if params is None:
      params = _model()[1]
    kwargs[case.variant] = _tree_option(case.variant, params)
  if inner is not None:
    args = _swap_inner(case, kwargs, args, inner)
  made = fn(*args, **kwargs)
  if call is not None:
    made = made(**call)
  if inspect.isclass(fn):
    made = made.gradient_transformation()
  if wrap is not None:
    made = wrap(made)
  return made


def wrapped_slot(case: Case) -> str | None:
  """The argument a wrapper takes its rule in, or None if it takes none."""
  if case.rule in ("chain", "named_chain"):
    return "args"
  names = inspect.signature(case.fn).parameters
  return next((k for k in WRAPPER_PARAMS if k in names), None)


def _swap_inner(case, kwargs, args, inner):
  """Puts ``inner`` where the wrapper's rule goes."""
  slot = wrapped_slot(case)
  if slot is None:
    raise TypeError(f"{case.name}: no rule argument to wrap")
  if slot == "args":
    return (inner,) if case.rule == "chain" else (("inner", inner),)
  if slot == "inner_factory":
    kwargs[slot] = lambda learning_rate: optax.chain(
      inner, optax.scale_by_learning_rate(learning_rate)
    )
  elif slot == "transforms":
    kwargs[slot] = {k: inner for k in kwargs[slot]}
  else:
    kwargs[slot] = inner
  return args


def _scaled(case: Case) -> bool:
  """Whether the rule's output is a direction, not a step (needs a rate)."""
  if case.rule in ARGS and "scaled" in ARGS[case.rule]():
    return ARGS[case.rule]()["scaled"]
  if case.wrapper:
    return False
  names = inspect.signature(case.fn).parameters
  steps = ("learning_rate", "step_size", "step_size_fn", "f")
  return (
    case.rule.split(".")[-1].startswith("scale_by")
    or not any(n in names for n in steps)
    or case.rule in ("scale_by_rprop",)
  )


def trainable(case: Case, tx):
  """``tx`` as trained: directions get ``scale(-LR)`` after them."""
  if case.rule == "keep_params_nonnegative":
    return optax.chain(optax.sgd(LR), tx)
  if _scaled(case):
    return optax.chain(tx, optax.scale(-LR))
  return tx


# ---------------------------------------------------------------------------
# Training.


def _dtype():
  return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


@functools.cache
def _model_cached(dtype_name):
  dtype = jnp.dtype(dtype_name)
  chain, params = oracles.mlp(list(SIZES), jax.random.PRNGKey(0))
  data = oracles.batches(
    jax.random.PRNGKey(1), STEPS, (BATCH, SIZES[0]), (BATCH, SIZES[-1])
  )
  params = jax.tree.map(lambda a: a.astype(dtype), params)
  xs = jnp.stack([x for x, _ in data]).astype(dtype)
  ys = jnp.stack([y for _, y in data]).astype(dtype)
  return chain, params, xs, ys


def _model():
  return _model_cached(jnp.dtype(_dtype()).name)


def _plain_run(loss_fn, tx, params, xs, ys, extras=None):
  def step(carry, batch):
    p, s = carry
    loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
    kwargs = extras(loss_fn, p, grads, loss, batch) if extras else {}
    if extras is not None and "per_example" in kwargs:
      grads = kwargs.pop("per_example")
    updates, s = tx.update(grads, s, p, **kwargs)
    p = optax.apply_updates(p, updates)
    return (p, s), (p, loss)

  return lax.scan(step, (params, tx.init(params)), (xs, ys))[1]


def _leafwise_run(loss_fn, tx, params, xs, ys):
  """One tx state per parameter leaf, each leaf updated on its own."""
  leaves, treedef = jax.tree.flatten(params)

  def step(carry, batch):
    p, states = carry
    loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
    out = [
      tx.update(g, s, w)
      for g, s, w in zip(
        treedef.flatten_up_to(grads), states, treedef.flatten_up_to(p)
      )
    ]
    updates = treedef.unflatten([u for u, _ in out])
    p = optax.apply_updates(p, updates)
    return (p, [s for _, s in out]), (p, loss)

  states = [tx.init(leaf) for leaf in leaves]
  return lax.scan(step, (params, states), (xs, ys))[1]


def _shim_run(loss_fn, tx, params, xs, ys):
  shimmed = immgrad.shim(tx)

  def step(carry, batch):
    p, s = carry
    loss, grads = immgrad.value_and_grad(loss_fn, shimmed, mode="current")(
      p, s, *batch
    )
    updates, s = shimmed.update(grads, s, p)
    p = optax.apply_updates(p, updates)
    return (p, s), (p, loss)

  return lax.scan(step, (params, shimmed.init(params)), (xs, ys))[1]


def _error(got, want):
  """``(err, finite)``: max |got - want| / max(1, |want|) (inf if ``got`` is
  not finite), and whether ``want`` (plain training) is finite.
  """
  errs, got_ok, want_ok = [], [], []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    errs.append(jnp.max(jnp.abs(a - b) / jnp.maximum(1.0, jnp.abs(b))))
    got_ok.append(jnp.all(jnp.isfinite(a)))
    want_ok.append(jnp.all(jnp.isfinite(b)))
  err = jnp.where(jnp.all(jnp.stack(got_ok)), jnp.max(jnp.stack(errs)), jnp.inf)
  return err, jnp.all(jnp.stack(want_ok))


def _extras(loss_fn, p, grads, loss, batch):
  """Every extra argument an EXTRA_ARGS rule may ask for."""
  value_fn = lambda q: loss_fn(q, *batch)
  per_example = jax.vmap(lambda x, y: jax.grad(loss_fn)(p, x[None], y[None]))(
    *batch
  )
  return dict(
    value=loss,
    grad=grads,
    value_fn=value_fn,
    obj_fn=value_fn,
    per_example=per_example,
  )


def _pick_extras(wanted):
  def extras(loss_fn, p, grads, loss, batch):
    every = _extras(loss_fn, p, grads, loss, batch)
    if "per-example gradients" in wanted:
      return {"per_example": every["per_example"]}
    if "obj_fn" in wanted:
      return {"obj_fn": every["obj_fn"]}
    return {k: every[k] for k in ("value", "grad", "value_fn") if k in wanted}

  return extras


def _run_jobs(jobs):
  """Runs ``{key: fn(params, xs, ys) -> (err, finite)}`` in one jit.

  Returns ``{key: {"err", "finite"}}``, or ``{key: {"exc", "msg"}}`` for a
  job that raised while it was traced (the shim refuses when traced). If
  the whole program fails to compile, the jobs run one at a time.
  """
  _, params, xs, ys = _model()
  failed = {}

  def program(params, xs, ys):
    out = {}
    for key, fn in jobs.items():
      try:
        out[key] = fn(params, xs, ys)
      except _PlainFailed as e:
        failed[key] = {"exc": "plain training failed", "msg": str(e)[:2000]}
      except Exception as e:
        failed[key] = {
          "exc": type(e).__name__,
          "msg": str(e)[:2000],
          "refused": isinstance(e, ValueError),
        }
    return out

  try:
    out = jax.jit(program)(params, xs, ys)
    out = {k: {"err": float(e), "finite": bool(f)} for k, (e, f) in out.items()}
  except Exception as e:
    if len(jobs) == 1:
      return {next(iter(jobs)): {"exc": type(e).__name__, "msg": str(e)[:2000]}}
    out = {}
    for key, fn in jobs.items():
      out.update(_run_jobs({key: fn}))
    return out
  out.update(failed)
  return out


class _PlainFailed(Exception):
  """Plain optax training itself failed (not the shim)."""


def _against_plain(run, loss_fn, plain_loss, train):
  """A job: ``run`` (shim or leafwise) against plain training."""

  def job(p, x, y):
    try:
      want = _plain_run(plain_loss, train, p, x, y)
    except Exception as e:
      raise _PlainFailed(f"{type(e).__name__}: {e}") from e
    return _error(run(loss_fn, train, p, x, y), want)

  return job


def _run_all(jobs, chunk):
  keys, out = list(jobs), {}
  for i in range(0, len(keys), chunk):
    out.update(_run_jobs({k: jobs[k] for k in keys[i : i + chunk]}))
  return out


def _verdict(tx):
  """What the shim does with ``tx``: ``(verdict, message)``.

  ``"accepted"``, or ``"refused"`` (a ValueError) or ``"raised"`` (any other
  exception) with its message, from ``immgrad.shim(tx)``, its ``init`` on
  the model's params, or one traced step (wherever the shim checks).
  """
  chain, params, xs, ys = _model()
  loss_fn = chain.loss_fn(immgrad.immediate_layer)
  try:
    shimmed = immgrad.shim(tx)

    def one_step(p, x, y):
      s = shimmed.init(p)
      _, grads = immgrad.value_and_grad(loss_fn, shimmed, mode="current")(
        p, s, x, y
      )
      return shimmed.update(grads, s, p)

    jax.eval_shape(one_step, params, xs[0], ys[0])
  except ValueError as e:
    return "refused", str(e)
  except Exception as e:
    return "raised", f"{type(e).__name__}: {e}"
  return "accepted", None


def _float32_state(tx, params) -> list:
  """Float32 state leaves in a float64 run (they would round at float32)."""
  if _dtype() != jnp.float64:
    return []
  try:
    state = jax.eval_shape(tx.init, params)
  except Exception:
    return []
  return [
    jax.tree_util.keystr(path)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    if getattr(leaf, "dtype", None) == jnp.float32
  ]


def _needs_more(tx, params):
  """None if ``tx.update(grads, state, params)`` runs, else the error."""
  try:
    jax.eval_shape(lambda p: tx.update(p, tx.init(p), p), params)
  except Exception as e:
    return f"{type(e).__name__}: {e}"[:300]
  return None


def _lookahead_run(loss_fn, tx, params, xs, ys):
  """lookahead's own loop: params are LookaheadParams, grads at ``fast``."""
  params = optax.LookaheadParams.init_synced(params)

  def step(carry, batch):
    p, s = carry
    loss, grads = jax.value_and_grad(loss_fn)(p.fast, *batch)
    updates, s = tx.update(grads, s, p)
    p = optax.apply_updates(p, updates)
    return (p, s), (p, loss)

  return lax.scan(step, (params, tx.init(params)), (xs, ys))[1]


def _finite(tree):
  return jnp.zeros(()), jnp.all(
    jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])
  )


def evaluate(cases=None, chunk: int = 8, only_accepted: bool = False):
  """Results for every case, in this process' float dtype (see module doc).

  ``{case: {"rule", "shim" (accepted/refused/raised), "message",
  "needs_more" (why plain ``tx.update(grads, state, params)`` fails, or
  None), and per run "<run>_err" and "<run>_finite" or "<run>_error"}}``;
  the runs: ``shim`` (through the shim, against plain training),
  ``leafwise`` (leaf by leaf, against plain; for refused rules) and
  ``with_extras`` (plain training given the extra arguments; for
  EXTRA_ARGS rules). ``only_accepted``: the shim runs only, of the rules
  (not their params-shaped variants).
  """
  if cases is None:
    cases = discover()[0]
  chain, params, _, _ = _model()
  plain_loss = chain.loss_fn()
  immediate_loss = chain.loss_fn(immgrad.immediate_layer)
  results, trained, jobs = {}, {}, {}
  for case in cases:
    r = results[case.name] = {
      "rule": case.rule,
      "wrapper": case.wrapper,
      "wraps": bool(case.wrapper and wrapped_slot(case)),
      "variant": case.variant,
      "aliases": list(case.aliases),
    }
    try:
      tx = build(case, params)
    except Exception as e:
      r["build_error"] = f"{type(e).__name__}: {e}"
      continue
    r["needs_more"] = _needs_more(tx, params)
    r["f32_state"] = _float32_state(tx, params)
    if only_accepted and case.variant:
      continue
    train = trained[case.name] = trainable(case, tx)
    if case.rule in EXTRA_ARGS:
      # Not trained through the shim: it would call update without them.
      r["shim"], r["message"] = _verdict(tx)
      if only_accepted:
        continue
      run = (
        _lookahead_run
        if case.rule == "lookahead"
        else functools.partial(
          _plain_run, extras=_pick_extras(EXTRA_ARGS[case.rule])
        )
      )
      jobs[(case.name, "with_extras")] = lambda p, x, y, train=train, run=run: (
        _finite(run(plain_loss, train, p, x, y))
      )
    else:  # The shim's verdict comes from tracing this run.
      jobs[(case.name, "shim")] = _against_plain(
        _shim_run, immediate_loss, plain_loss, train
      )
  leafwise = {}
  for (name, run), value in _run_all(jobs, chunk).items():
    r = results[name]
    if run == "shim" and value.get("exc") == "plain training failed":
      r["plain_error"] = value["msg"]
      r["shim"], r["message"] = _verdict(trained[name])
      continue
    if run == "shim" and "exc" in value:
      r["shim"] = "refused" if value["refused"] else "raised"
      r["message"] = (
        value["msg"]
        if r["shim"] == "refused"
        else f"{value['exc']}: {value['msg']}"
      )
      if not only_accepted and not r.get("variant"):
        leafwise[(name, "leafwise")] = _against_plain(
          _leafwise_run, plain_loss, plain_loss, trained[name]
        )
      continue
    if run == "shim":
      r["shim"], r["message"] = "accepted", None
    _record(r, run, value)
  for (name, run), value in _run_all(leafwise, chunk).items():
    _record(results[name], run, value)
  return results


def _record(r, run, value):
  if "exc" in value:
    r[run + "_error"] = f"{value['exc']}: {value['msg']}"
  else:
    r[run + "_err"], r[run + "_finite"] = value["err"], value["finite"]


# ---------------------------------------------------------------------------
# Classification and the table in docs/optimizer.md (once in the README).


SILENT = "silently wrong"
WRONGLY_REFUSED = "refused, though per-parameter"


def classify(results: dict) -> dict:
  """``{case: status}``: a STATUSES entry, SILENT, WRONGLY_REFUSED, or
  None (undecided).
  """
  return {name: _status(r, results) for name, r in results.items()}


def _status(r: dict, results: dict) -> str | None:
  if "build_error" in r:
    return None
  rule = r["rule"]
  if rule in EXTRA_ARGS:
    return EXTRA
  if "plain_error" in r and r["shim"] == "refused" and rule in SEMANTIC:
    return WHOLE_TREE  # Refused for what it keeps; plain training fails.
  if r["needs_more"] is not None or "plain_error" in r or "shim" not in r:
    return None  # Plain training fails: EXTRA_ARGS or ARGS must say why.
  if r["shim"] == "accepted":
    if "shim_err" not in r:
      return None
    if not r["shim_finite"]:
      return None  # Plain training diverges: ARGS must tame it.
    return PER_PARAMETER if r["shim_err"] <= F64_TOL else SILENT
  if r.get("variant"):
    base = results.get(rule)
    if base is not None and _status(base, results) == WHOLE_TREE:
      return WHOLE_TREE
    return WRONGLY_REFUSED  # A params-shaped option of a per-parameter rule.
  if rule in PRNG_STATE:
    return WRONGLY_REFUSED  # A PRNG key in its state: carried by the shim.
  if r["shim"] != "refused":
    return None  # The shim crashed, not refused.
  if rule in SEMANTIC or r.get("leafwise_err", 0.0) > WHOLE_TREE_MIN:
    return WHOLE_TREE
  return None  # Refused, yet it trains the same leaf by leaf.


def short_name(rule: str) -> str:
  """The name the shim's messages use: the factory's own."""
  return rule.split(".")[-1]


def _why(message: str) -> str:
  """The reason part of the shim's refusal."""
  start = message.find("separately (")
  if start < 0:
    return message.split(":", 1)[-1].strip()
  depth, i = 0, start + len("separately (")
  for j in range(i, len(message)):
    depth += {"(": 1, ")": -1}.get(message[j], 0)
    if depth < 0:
      return message[i:j]
  return message[i:]


# Hand-written notes for the table (what a reader needs to know).
NOTES = {
  "contrib.scale_by_muon": "rank >= 2 parameters only: tried on the "
  "matrices, masked",
  "chain": "as its parts are",
  "named_chain": "as its parts are",
}


def note(name: str, r: dict, st: str | None) -> str:
  """The table's note for one case (no numbers: stable across machines)."""
  rule = r["rule"]
  parts = []
  if r.get("aliases"):
    parts.append("also " + ", ".join(f"`optax.{a}`" for a in r["aliases"]))
  if rule in NOTES and not r.get("variant"):
    parts.append(NOTES[rule])
  elif r.get("wraps") and not r.get("variant"):
    parts.append("wraps a rule")
  if st == EXTRA:
    parts.append(
      "update needs "
      + ", ".join(a if " " in a else f"`{a}`" for a in EXTRA_ARGS[rule])
    )
    parts.append(
      "the shim passes none: "
      + (
        "refused"
        if r.get("shim") == "refused"
        else "raises " + (r.get("message") or "").split(":")[0]
        if r.get("shim") == "raised"
        else "accepted"
      )
    )
  elif st == WHOLE_TREE:
    parts.append(SEMANTIC.get(rule) or _why(r.get("message") or ""))
  elif st == PER_PARAMETER and r.get("variant"):
    parts.append(f"`{r['variant']}` given as a params-shaped tree")
  elif st == PER_PARAMETER and rule in PRNG_STATE:
    parts.append("random key in its state")
  del name
  return "; ".join(parts)


def display(r: dict) -> str:
  return f"`optax.{r['rule']}" + (
    f"({r['variant']}=tree)`" if r.get("variant") else "`"
  )


README_MARKERS = (
  "<!-- catalogue table: python tests/catalogue.py --readme -->",
  "<!-- end of catalogue table -->",
)


def readme_table(results=None) -> str:
  """docs/optimizer.md's table: rule | status | note, grouped by status."""
  if results is None:
    results = results_in_subprocess("float64")
  statuses = classify(results)
  order = STATUSES + (SILENT, WRONGLY_REFUSED, None)
  rows = sorted(
    (
      order.index(statuses[name]),
      r["rule"],
      r.get("variant") or "",
      display(r),
      statuses[name] or "undecided",
      note(name, r, statuses[name]),
    )
    for name, r in results.items()
  )
  lines = ["| rule | status | note |", "| --- | --- | --- |"]
  lines += [f"| {d} | {st} | {text} |" for _, _, _, d, st, text in rows]
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Subprocesses (float64 must not leak into the caller's JAX).

_FORCED_DEVICES = "--xla_force_host_platform_device_count"


def subprocess_env(dtype: str) -> dict:
  env = dict(os.environ)
  env["JAX_ENABLE_X64"] = "1" if dtype == "float64" else "0"
  flags = [
    f
    for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith(_FORCED_DEVICES) and f not in xla_flags.FAST_COMPILE
  ]
  # Some 250 small programs, each run for milliseconds: compiling is all
  # the time, and the suite's fast settings halve it (plain and shim runs
  # are compiled alike, so the comparison is unchanged).
  env["XLA_FLAGS"] = " ".join(flags + list(xla_flags.FAST_COMPILE))
  return env


def start_subprocess(
  dtype: str, out: str, only_accepted: bool = False, only: str | None = None
):
  cmd = [sys.executable, os.path.abspath(__file__), "--json", out]
  if only_accepted:
    cmd.append("--only-accepted")
  if only:
    cmd += ["--only", only]
  return subprocess.Popen(
    cmd,
    env=subprocess_env(dtype),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def finish_subprocess(proc, out: str) -> dict:
  log, _ = proc.communicate()
  if proc.returncode:
    raise RuntimeError(f"catalogue subprocess failed:\n{log[-4000:]}")
  with open(out) as f:
    return json.load(f)


def results_in_subprocess(dtype: str, only_accepted: bool = False) -> dict:
  import tempfile

  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "results.json")
    return finish_subprocess(start_subprocess(dtype, out, only_accepted), out)[
      "results"
    ]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--readme", action="store_true", help="print the table of docs/optimizer.md"
  )
  parser.add_argument(
    "--json", metavar="OUT", help="write results (this process' dtype) to OUT"
  )
  parser.add_argument(
    "--only-accepted",
    action="store_true",
    help="with --json: train only the rules the shim accepts",
  )
  parser.add_argument(
    "--results",
    metavar="JSON",
    help="with --readme: the table of these --json "
    "results (float64) instead of a new run",
  )
  parser.add_argument(
    "--only",
    metavar="NAMES",
    help="comma-separated cases to run (default: all)",
  )
  args = parser.parse_args(argv)
  if args.json:
    start = time.time()
    cases, unclassified = discover()
    if args.only:
      cases = [c for c in cases if c.name in args.only.split(",")]
    results = evaluate(cases, only_accepted=args.only_accepted)
    with open(args.json, "w") as f:
      json.dump(
        {
          "dtype": jnp.dtype(_dtype()).name,
          "unclassified": unclassified,
          "results": results,
          "seconds": time.time() - start,
        },
        f,
        indent=1,
      )
  if args.readme:
    results = None
    if args.results:
      with open(args.results) as f:
        results = json.load(f)["results"]
    print(readme_table(results), end="")


if __name__ == "__main__":
  main()
