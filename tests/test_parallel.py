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


def _scanned_problem():
  """mode="updated", adam: the 3 hidden layers stacked under immgrad.scan
  (its own backward loop), against the sequential reference unrolled.
  """
  opt = optax.adam(1e-2)
  chain, params = oracles.mlp([6, 16, 16, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 3, (16, 6), (16, 3))
  expected, _ = oracles.sequential_steps(chain, opt, params, data)
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


def _step(loss_fn, tx, mode, axis_name):
  def step(params, state, *batch):
    _, grads = immgrad.value_and_grad(
      loss_fn, tx, mode=mode, axis_name=axis_name
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
