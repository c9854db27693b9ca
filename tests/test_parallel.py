"""Data parallel on 4 simulated CPU devices equals one device, full batch.

Each transform runs 3 steps of the per-device loss (mean over the local
quarter of the batch) and is compared with an independent single-device
reference on the whole batch: plain training for mode="current" (on the
model with ordinary parameters too, so their averaging is checked), and the
sequential re-linearization for mode="updated" (with adam, with
momentum, under which the experiments see "updated" diverge, and with the
hidden layers stacked under immgrad.scan), and both modes once more with
the layers found by ``immgrad.immediate`` in the undecorated model. Tolerance as in
test_current.py (atol=1e-6, rtol=1e-5), which also covers the different
summation order of a mean over 4 devices (one ulp per step). Replicas must
hold bitwise identical weights after every step.

A sum instead of a mean (the shard_map check_vma trap) would be 4x off, and
a missing mean would leave replicas with different weights.
"""

import re

import chex
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import immgrad
import models
import oracles

ATOL, RTOL = 1e-6, 1e-5
DEVICES = 4
TRANSFORMS = [
  "pmap",
  "shard_map_check_vma",
  "shard_map_no_check_vma",
  "jit_mesh",
]


UPDATED_OPTIMIZERS = {
  "adam": lambda: optax.adam(1e-2),
  "momentum": lambda: optax.sgd(0.1, momentum=0.9),
}


def _scanned_problem(split=lambda data: data, **reference):
  """mode="updated", adam: the 3 hidden layers stacked under immgrad.scan
  (its own backward loop), against the sequential reference unrolled
  (``reference``: its ``reduce`` and ``compile_step``; ``split`` places
  its batches).
  """
  opt = optax.adam(1e-2)
  chain, params = oracles.mlp([6, 16, 16, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 3, (16, 6), (16, 3))
  expected, _ = oracles.sequential_steps(
    chain, opt, params, split(data), **reference
  )
  dense = immgrad.immediate_layer(oracles.dense)

  def pack(p):
    hidden = [p[f"layer{i}"] for i in (1, 2, 3)]
    return {
      "in": p["layer0"],
      "out": p["layer4"],
      "blocks": jax.tree.map(lambda *a: jnp.stack(a), *hidden),
    }

  def loss_fn(params, x, y):
    h = jax.nn.relu(dense(x, params["in"]))
    h, _ = immgrad.scan(
      lambda h, p: (jax.nn.relu(dense(h, p)), None), h, params["blocks"]
    )
    return oracles.mse(dense(h, params["out"]), y)

  return loss_fn, opt, pack(params), data, [pack(e) for e in expected]


def _problem(mode, updated_opt="adam"):
  if updated_opt == "scanned":
    return _scanned_problem()
  if updated_opt == "immediate":  # The layers found by immgrad.immediate.
    loss_fn, opt, params, data, expected = _problem(mode, "adam")
    chain = (
      models.loss_fn()
      if mode == "current"
      else oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))[0].loss_fn()
    )
    return immgrad.immediate(chain), opt, params, data, expected
  if mode == "current":
    # Not adam: adam is nearly blind to a gradient scaled 4x.
    opt = optax.sgd(0.05, momentum=0.9)
    params = models.init(jax.random.PRNGKey(2))
    data = models.batches(jax.random.PRNGKey(3), 3, batch=16)
    expected, _ = oracles.plain_steps(models.loss_fn(), opt, params, data)
    return models.loss_fn(immgrad.immediate_layer), opt, params, data, expected
  opt = UPDATED_OPTIMIZERS[updated_opt]()
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 3, (16, 6), (16, 3))
  expected, _ = oracles.sequential_steps(chain, opt, params, data)
  return chain.loss_fn(immgrad.immediate_layer), opt, params, data, expected


def _step(loss_fn, tx, mode, axis_name, **options):
  def step(params, state, *batch):
    _, grads = immgrad.value_and_grad(
      loss_fn, tx, mode=mode, axis_name=axis_name, **options
    )(params, state, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


def _replicas_equal(stacked):
  for leaf in jax.tree.leaves(stacked):
    leaf = np.asarray(leaf)
    assert leaf.shape[0] == DEVICES
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize(
  "mode,updated_opt",
  [
    ("current", None),
    ("current", "immediate"),
    ("updated", "adam"),
    ("updated", "immediate"),
    ("updated", "momentum"),
    ("updated", "scanned"),
  ],
)
def test_data_parallel_equals_single_device(mode, updated_opt, transform):
  assert jax.device_count() >= DEVICES, "conftest.py sets 4 CPU devices"
  loss_fn, opt, params, data, expected = _problem(mode, updated_opt)
  tx = immgrad.shim(opt)
  state = tx.init(params)

  if transform == "pmap":
    step = jax.pmap(_step(loss_fn, tx, mode, "d"), axis_name="d")
    stack = lambda t: jax.tree.map(lambda a: jnp.stack([a] * DEVICES), t)
    split = lambda a: a.reshape((DEVICES, -1) + a.shape[1:])
    params, state = stack(params), stack(state)
    for i, batch in enumerate(data):
      params, state = step(params, state, *map(split, batch))
      _replicas_equal(params)
      _replicas_equal(state)
      chex.assert_trees_all_close(
        jax.tree.map(lambda a: a[0], params), expected[i], atol=ATOL, rtol=RTOL
      )
    return

  mesh = jax.make_mesh((DEVICES,), ("d",))
  put = lambda t, spec: jax.tree.map(
    lambda a: jax.device_put(a, NamedSharding(mesh, spec)), t
  )
  params, state = put(params, P()), put(state, P())

  if transform == "jit_mesh":
    step = jax.jit(_step(loss_fn, tx, mode, None))
    for i, batch in enumerate(data):
      params, state = step(params, state, *put(batch, P("d")))
      chex.assert_trees_all_close(params, expected[i], atol=ATOL, rtol=RTOL)
    return

  inner = _step(loss_fn, tx, mode, "d")

  def body(params, state, *batch):
    params, state = inner(params, state, *batch)
    copies = jax.tree.map(lambda a: a[None], (params, state))
    return params, state, copies

  step = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), P()) + (P("d"),) * len(data[0]),
      out_specs=(P(), P(), P("d")),
      check_vma=transform == "shard_map_check_vma",
    )
  )
  for i, batch in enumerate(data):
    params, state, copies = step(params, state, *put(batch, P("d")))
    _replicas_equal(copies)
    chex.assert_trees_all_close(params, expected[i], atol=ATOL, rtol=RTOL)


def test_fsdp_sharded_stack_keeps_its_sharding():
  """Stacked weights sharded over the mesh (FSDP style) under immgrad.scan,
  jit over the mesh: the new weights and adam moments keep the weights'
  sharding, and equal the single-device sequential reference.
  """
  loss_fn, opt, params, data, expected = _scanned_problem()
  mesh = jax.make_mesh(
    (DEVICES,), ("d",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  fsdp = {"w": P(None, "d", None), "b": P(None, "d")}
  specs = {
    "in": {"w": P(), "b": P()},
    "out": {"w": P(), "b": P()},
    "blocks": fsdp,
  }
  params = jax.tree.map(
    lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs
  )
  tx = immgrad.shim(opt)
  state = tx.init(params)
  step = jax.jit(_step(loss_fn, tx, "updated", None))
  for i, (x, y) in enumerate(data):
    params, state = step(
      params, state, jax.device_put(x, NamedSharding(mesh, P("d"))), y
    )
    chex.assert_trees_all_close(params, expected[i], atol=ATOL, rtol=RTOL)
  for name, spec in fsdp.items():
    same = lambda a, spec=spec: a.sharding.is_equivalent_to(
      NamedSharding(mesh, spec), a.ndim
    )
    assert same(params["blocks"][name]), params["blocks"][name].sharding
    (adam,) = [
      s
      for s in jax.tree.leaves(
        state.inner, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState)
      )
      if isinstance(s, optax.ScaleByAdamState)
    ]
    moments = [adam.mu["blocks"][name], adam.nu["blocks"][name]]
    assert moments and all(same(m) for m in moments), moments


# -- How each layer's gradient is reduced ----------------------------------

# XLA's passes that merge independent all-reduces into one (CPU's own and
# the generic one): turned off, each parameter leaf keeps its own.
COMBINERS = "cpu-all-reduce-combiner,all-reduce-combiner"
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def _all_reduces(compiled) -> int:
  return len(re.findall(r" all-reduce(?:-start)?\(", compiled.as_text()))


def _xla_merges_all_reduces() -> bool:
  """Whether this XLA's CPU compiler merges two independent all-reduces
  into one (jaxlib 0.10's does; 0.7.0's keeps each).
  """
  merged = jax.jit(
    jax.shard_map(
      lambda a, b: jax.lax.psum((a, b), "d"),
      mesh=_mesh(),
      in_specs=P("d"),
      out_specs=P(),
    )
  )
  x = jax.ShapeDtypeStruct(
    (DEVICES,), jnp.float32, sharding=NamedSharding(_mesh(), P("d"))
  )
  return _all_reduces(merged.lower(x, x).compile()) == 1


def _mesh():
  return jax.make_mesh((DEVICES,), ("d",))


def _split(data):
  """The batches, each split over the 4 devices."""
  return jax.tree.map(
    lambda a: jax.device_put(a, NamedSharding(_mesh(), P("d"))), data
  )


def _mesh_step(check_vma=False, batch_args=2):
  """Makes ``fun(params, state, *batch)`` a ``jit`` of a ``shard_map`` over
  4 devices, the batch split; per-device outputs (a loss) come back as
  device 0's (unchecked with ``check_vma=False``).
  """
  mesh = _mesh()
  return lambda fun: jax.jit(
    jax.shard_map(
      fun,
      mesh=mesh,
      in_specs=(P(), P()) + (P("d"),) * batch_args,
      out_specs=P(),
      check_vma=check_vma,
    )
  )


def _chain(mode, opt_name, n_steps=3):
  """3 dense layers, each an immediate layer with ``w`` and ``b``, and the
  single-device reference on the full batch: plain training for
  ``current``, the sequential re-linearization for ``updated``.
  """
  opt = OPTIMIZERS[opt_name]()
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), n_steps, (16, 6), (16, 3))
  if mode == "current":
    expected, _ = oracles.plain_steps(chain.loss_fn(), opt, params, data)
  else:
    expected, _ = oracles.sequential_steps(chain, opt, params, data)
  return chain, opt, params, data, expected


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("mode", ["current", "updated"])
def test_one_all_reduce_per_layer(mode, opt_name):
  """immgrad averages a layer's ``w`` and ``b`` with one ``lax.pmean``,
  which JAX lowers to one all-reduce per leaf; XLA's all-reduce combiner
  merges them: the compiled step holds at most one all-reduce per layer
  (``updated`` exactly one, each needed before that layer's dX; ``current``
  fewer, merged across layers too). Where XLA's CPU compiler merges none
  (jaxlib 0.7.0) the counts are not asserted. Compiled with the combiner
  off (one all-reduce per leaf, 6), the step computes the same numbers bit
  for bit, and both equal one device on the full batch (ATOL, RTOL as
  above).
  """
  chain, opt, params, data, expected = _chain(mode, opt_name)
  tx = immgrad.shim(opt)
  state = tx.init(params)
  step = _mesh_step()(
    _step(chain.loss_fn(immgrad.immediate_layer), tx, mode, "d")
  )
  data = _split(data)
  lowered = step.lower(params, state, *data[0])
  per_layer = lowered.compile()
  per_leaf = lowered.compile(
    compiler_options={"xla_disable_hlo_passes": COMBINERS}
  )
  layers, leaves = len(chain.names), len(jax.tree.leaves(params))
  assert _all_reduces(per_leaf) == leaves
  if _xla_merges_all_reduces():
    if mode == "updated":
      assert _all_reduces(per_layer) == layers
    else:
      assert 1 <= _all_reduces(per_layer) <= layers
  got = {"per layer": (params, state), "per leaf": (params, state)}
  for i, batch in enumerate(data):
    for name, run in (("per layer", per_layer), ("per leaf", per_leaf)):
      got[name] = run(*got[name], *batch)
    chex.assert_trees_all_equal(got["per layer"], got["per leaf"])
    chex.assert_trees_all_close(
      got["per layer"][0], expected[i], atol=ATOL, rtol=RTOL
    )


def _mean_in(dtype):
  """The hand-written average over ``d`` in ``dtype``: each gradient cast
  to it, ``lax.pmean``, cast back.
  """

  def mean(grads):
    cast = jax.tree.map(lambda g: g.astype(dtype), grads)
    return jax.tree.map(
      lambda m, g: m.astype(g.dtype), jax.lax.pmean(cast, "d"), grads
    )

  return mean


@pytest.mark.parametrize(
  "mode,model,check_vma",
  [
    ("current", "ordinary too", False),
    ("current", "chain", True),
    ("updated", "chain", False),
    ("updated", "chain", True),
    ("updated", "scanned", False),
  ],
)
def test_reduce_dtype_bfloat16_equals_hand_reduction(mode, model, check_vma):
  """``reduce_dtype=jnp.bfloat16`` equals the references of the other
  tests run on 4 devices with every gradient (``current``: the whole
  gradient of plain training; ``updated``: each layer's dW in the
  sequential re-linearization) cast to bfloat16, averaged by ``lax.pmean``
  and cast back before optax. ``"ordinary too"`` has undecorated
  parameters, whose gradients immgrad averages after the backward pass;
  ``"scanned"`` steps its hidden layers in ``immgrad.scan``'s loop.
  Under ``check_vma=True`` JAX itself sums an undecorated replicated
  parameter's gradient, in its own dtype, so that model runs without it.
  Tolerance ATOL, RTOL as above (XLA may contract a multiply-add in one
  program and not the other); the same references averaged in float32
  differ from the bfloat16 ones by far more, so an ignored ``reduce_dtype``
  fails.
  """
  if model == "ordinary too":
    opt = optax.sgd(0.05, momentum=0.9)
    params = models.init(jax.random.PRNGKey(2))
    data = models.batches(jax.random.PRNGKey(3), 3, batch=16)
    loss_fn, plain_loss = (
      models.loss_fn(immgrad.immediate_layer),
      models.loss_fn(),
    )
  elif model == "scanned":
    loss_fn, opt, params, data, _ = _scanned_problem()
  else:
    chain, opt, params, data, _ = _chain(mode, "adam", n_steps=3)
    loss_fn, plain_loss = (
      chain.loss_fn(immgrad.immediate_layer),
      chain.loss_fn(),
    )
  batch_args = len(data[0])

  def reference(dtype):
    compile_step = _mesh_step(batch_args=batch_args)
    if mode == "current":
      return oracles.plain_steps(
        plain_loss, opt, params, data, _mean_in(dtype), compile_step
      )[0]
    if model == "scanned":
      return _scanned_problem(
        _split, reduce=_mean_in(dtype), compile_step=compile_step
      )[4]
    return oracles.sequential_steps(
      chain,
      opt,
      params,
      data,
      reduce=_mean_in(dtype),
      compile_step=compile_step,
    )[0]

  data = _split(data)

  expected = reference(jnp.bfloat16)
  assert oracles.max_abs_diff(expected, reference(jnp.float32)) > 100 * ATOL
  tx = immgrad.shim(opt)
  state = tx.init(params)
  step = _mesh_step(check_vma, batch_args)(
    _step(loss_fn, tx, mode, "d", reduce_dtype=jnp.bfloat16)
  )
  got = params
  for i, batch in enumerate(data):
    got, state = step(got, state, *batch)
    chex.assert_trees_all_close(got, expected[i], atol=ATOL, rtol=RTOL)
