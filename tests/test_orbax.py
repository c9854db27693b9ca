"""orbax-checkpoint: params and ShimState round-trip bitwise, runs resume.

Large models are checkpointed with orbax (sharded, multi-host, async).
Checked here, all bit for bit (no tolerance: every leaf's dtype, shape and
raw bytes, and the tree structure with its NamedTuple types, ShimState,
adam's ScaleByAdamState and EmptyState):

* a trained ``{"params", "opt_state"}`` with a bfloat16 weight, adam's int32
  counts and a ShimState whose ``rejected`` counted a non-finite step;
* a run checkpointed at step k and restored into a fresh template
  continues exactly like the uninterrupted run: ``ocp.StandardCheckpointer``
  (async) with ``mode="updated"``, and ``ocp.CheckpointManager`` (async,
  every 2nd step, keep 2, training on with donated buffers during the
  write) with ``mode="current"``;
* FSDP on the 4 simulated devices (conftest.py): weights and adam's mu and
  nu split along the data axis, restored onto the shardings of an abstract
  tree from ``jax.eval_shape`` (nothing materialized, as for a large model)
  or onto another sharding, and resumed;
* 2 processes x 2 devices (jax.distributed over loopback, as in
  test_multiprocess.py; see orbax_worker.py), each holding half of every
  sharded array, saving one checkpoint together (async, training on with
  donated buffers); a new manager restores it into a fresh FSDP template
  and continues like the uninterrupted 2-process run; and this process
  restores the same checkpoint on its own 4 devices.

orbax restores NamedTuples as dicts and EmptyState as None unless it is
given the target structure: always pass an abstract tree
(``jax.tree.map(ocp.utils.to_shape_dtype_struct, template)``), which also
carries the shardings to restore onto.

orbax-checkpoint is not a dependency of immgrad: without it (CI's
minimum-versions pass) the module is skipped.
"""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import immgrad
import models
import multiprocess_problem as problem
import oracles

ocp = pytest.importorskip(
  "orbax.checkpoint",
  reason="orbax-checkpoint is not installed (it is optional)",
)

HERE = pathlib.Path(__file__).resolve().parent


def assert_bitwise(got, want):
  """Same structure (node types included), dtypes, shapes and bytes."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
  for (path, a), b in zip(got_leaves, jax.tree.leaves(want)):
    name = jax.tree_util.keystr(path)
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape), name
    np.testing.assert_array_equal(
      a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8), err_msg=name
    )


def abstract(tree):
  """What orbax restores into: structure, shapes, dtypes and shardings."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def _nodes(tree, kind):
  """The subtrees of ``tree`` that are ``kind`` (a NamedTuple class)."""
  return [
    n
    for n in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, kind))
    if isinstance(n, kind)
  ]


def training(loss_fn, tx, mode, donate=False):
  """``run(tree, batches)`` on ``{"params", "opt_state"}``, jitted."""

  def step(tree, *batch):
    params, opt_state = tree["params"], tree["opt_state"]
    _, grads = immgrad.value_and_grad(loss_fn, tx, mode=mode)(
      params, opt_state, *batch
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    return {
      "params": optax.apply_updates(params, updates),
      "opt_state": opt_state,
    }

  step = jax.jit(step, donate_argnums=0 if donate else ())

  def run(tree, batches, after_step=lambda i, tree: None):
    for i, batch in enumerate(batches):
      tree = step(tree, *batch)
      after_step(i + 1, tree)
    return tree

  return run


def test_params_and_shim_state_round_trip_bitwise(tmp_path):
  chain, params = oracles.mlp([6, 16, 3], jax.random.PRNGKey(0))
  bf16 = lambda p: {
    **p,
    "layer0": {**p["layer0"], "w": p["layer0"]["w"].astype(jnp.bfloat16)},
  }
  params = bf16(params)
  tx = immgrad.shim(optax.adam(1e-2))
  run = training(chain.loss_fn(immgrad.immediate_layer), tx, "updated")
  data = oracles.batches(jax.random.PRNGKey(1), 3, (8, 6), (8, 3))
  data[1] = (data[1][0].at[0, 0].set(jnp.nan), data[1][1])  # Rejected.
  tree = run({"params": params, "opt_state": tx.init(params)}, data)
  tree["extras"] = {  # Bits that a float32 detour would lose.
    "bf16": jnp.array([1.5, -0.0, jnp.inf, jnp.nan, 2**-133], jnp.bfloat16),
    "int32_max": jnp.array(2**31 - 1, jnp.int32),
  }
  state = tree["opt_state"]
  assert int(state.rejected) == 1 and state.rejected.dtype == jnp.int32
  adam = _nodes(state.inner, optax.ScaleByAdamState)
  assert adam and _nodes(state.inner, optax.EmptyState)
  for node in adam:
    assert {int(c) for c in jax.tree.leaves(node.count)} == {2}  # Of 3.
    assert all(c.dtype == jnp.int32 for c in jax.tree.leaves(node.count))
  assert any(
    m.dtype == jnp.bfloat16 for node in adam for m in jax.tree.leaves(node.mu)
  )

  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, tree)  # Async: returns once the arrays are on host.
    ckptr.wait_until_finished()
    # Another init: only its structure, shapes, dtypes and shardings count.
    _, other = oracles.mlp([6, 16, 3], jax.random.PRNGKey(7))
    template = {
      "params": bf16(other),
      "opt_state": tx.init(bf16(other)),
      "extras": jax.tree.map(jnp.zeros_like, tree["extras"]),
    }
    restored = ckptr.restore(path, abstract(template))

  assert_bitwise(restored, tree)
  state = restored["opt_state"]
  assert isinstance(state, immgrad.ShimState)
  assert len(_nodes(state.inner, optax.ScaleByAdamState)) == len(adam)
  assert _nodes(state.inner, optax.EmptyState)
  assert int(state.rejected) == 1


def test_resume_from_standard_checkpointer_is_bitwise(tmp_path):
  """mode="updated", adamw on a cosine schedule (reads the count)."""
  chain, params = oracles.mlp([6, 16, 16, 3], jax.random.PRNGKey(0))
  data = oracles.batches(jax.random.PRNGKey(1), 6, (8, 6), (8, 3))
  tx = immgrad.shim(optax.adamw(optax.cosine_decay_schedule(1e-2, 6)))
  run = training(chain.loss_fn(immgrad.immediate_layer), tx, "updated")
  fresh = lambda: {"params": params, "opt_state": tx.init(params)}

  straight = run(fresh(), data)
  halfway = run(fresh(), data[:3])
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "step_3", halfway)
    ckptr.wait_until_finished()
    restored = ckptr.restore(tmp_path / "step_3", abstract(fresh()))
  assert_bitwise(restored, halfway)
  assert_bitwise(run(restored, data[3:]), straight)


def test_resume_from_checkpoint_manager_is_bitwise(tmp_path):
  """mode="current", ordinary leaves too; saves while training donates."""
  params = jax.device_get(models.init(jax.random.PRNGKey(2)))  # Not donated.
  data = models.batches(jax.random.PRNGKey(3), 6)
  tx = immgrad.shim(optax.sgd(0.05, momentum=0.9))
  # Each step donates (deletes) the buffers of the one before.
  run = training(
    models.loss_fn(immgrad.immediate_layer), tx, "current", donate=True
  )
  fresh = lambda: {"params": params, "opt_state": tx.init(params)}
  history = {}
  straight = run(
    fresh(), data, lambda i, tree: history.setdefault(i, jax.device_get(tree))
  )

  options = ocp.CheckpointManagerOptions(
    save_interval_steps=2, max_to_keep=2, enable_async_checkpointing=True
  )
  with ocp.CheckpointManager(tmp_path / "run", options=options) as mngr:
    # Async: the next step deletes the buffers a save has just taken, and
    # the write goes on from orbax's host copy.
    run(
      fresh(),
      data,
      lambda i, tree: mngr.save(i, args=ocp.args.StandardSave(tree)),
    )
    mngr.wait_until_finished()
    assert mngr.all_steps() == [4, 6]
    restore = lambda step: mngr.restore(
      step, args=ocp.args.StandardRestore(abstract(fresh()))
    )
    assert_bitwise(restore(6), straight)
    restored = restore(4)
  assert_bitwise(restored, history[4])
  assert_bitwise(run(restored, data[4:]), straight)


def _fsdp_problem():
  mesh = jax.make_mesh((4,), ("data",))
  fsdp = lambda a: NamedSharding(mesh, P("data") if a.ndim == 2 else P())
  put = lambda tree: jax.tree.map(lambda a: jax.device_put(a, fsdp(a)), tree)
  return mesh, fsdp, put


def test_fsdp_sharded_round_trip_and_resume_bitwise(tmp_path):
  assert jax.device_count() >= 4, "conftest.py sets 4 CPU devices"
  mesh, fsdp, put = _fsdp_problem()
  chain, params = oracles.mlp([8, 16, 16, 4], jax.random.PRNGKey(0))
  data = [
    jax.device_put(batch, NamedSharding(mesh, P("data")))
    for batch in oracles.batches(jax.random.PRNGKey(1), 4, (16, 8), (16, 4))
  ]
  tx = immgrad.shim(optax.adam(1e-2))
  run = training(chain.loss_fn(immgrad.immediate_layer), tx, "updated")
  fresh = lambda: put({"params": params, "opt_state": tx.init(params)})

  straight = run(fresh(), data)
  halfway = run(fresh(), data[:2])
  specs = [a.sharding.spec for a in jax.tree.leaves(halfway) if a.ndim == 2]
  assert len(specs) == 9 and all(s[0] == "data" for s in specs)  # w, mu, nu.
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "fsdp", halfway)
    ckptr.wait_until_finished()
    # A large model's target, never materialized: eval_shape, shardings.
    target = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=fsdp(s)),
      jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)}),
    )
    assert jax.tree.structure(target) == jax.tree.structure(fresh())
    restored = ckptr.restore(tmp_path / "fsdp", target)
    # The same checkpoint onto another layout: everything replicated.
    replicated = jax.tree.map(
      lambda a: a.update(sharding=NamedSharding(mesh, P())), target
    )
    gathered = ckptr.restore(tmp_path / "fsdp", replicated)

  assert_bitwise(restored, halfway)
  assert_bitwise(gathered, halfway)
  for got, want, was in zip(
    jax.tree.leaves(restored), jax.tree.leaves(target), jax.tree.leaves(halfway)
  ):
    assert got.sharding == want.sharding
    assert got.sharding.is_equivalent_to(was.sharding, got.ndim)
    assert len(got.addressable_shards) == 4
  for got in jax.tree.leaves(gathered):
    assert got.sharding.is_fully_replicated
  assert_bitwise(run(restored, data[2:]), straight)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(ckpt_dir, tmp_path):
  """Runs orbax_worker.py in 2 processes; their results."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # Each worker makes its own 2 devices.
  env["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]
  )
  port = _free_port()
  outs = [tmp_path / f"process{i}.npz" for i in range(2)]
  workers = [
    subprocess.Popen(
      [
        sys.executable,
        str(HERE / "orbax_worker.py"),
        str(i),
        str(port),
        str(ckpt_dir),
        str(out),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i, out in enumerate(outs)
  ]
  try:
    logs = [w.communicate(timeout=300)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  for w, log in zip(workers, logs):
    assert w.returncode == 0, log[-4000:]
  return [dict(np.load(out)) for out in outs]


def _named(results, name):
  """``name``'s gathered leaves from a worker, keyed by their path."""
  return {
    k[len(name) :]: v for k, v in results.items() if k.startswith(name + "[")
  }


def test_two_processes_save_one_checkpoint_and_resume_bitwise(tmp_path):
  import orbax_worker

  ckpt_dir = tmp_path / "ckpt"
  processes = _two_processes(ckpt_dir, tmp_path)
  assert sorted(os.listdir(ckpt_dir)) == [str(orbax_worker.SAVE_AT)]
  for results in processes:
    # Each process held 2 of every array's 4 shards, FSDP-split matrices.
    for name in ("saved", "restored"):
      assert set(results[name + ":local_shards"]) == {2}
      assert sum("data" in s for s in results[name + ":specs"]) == 9
    assert_bitwise(_named(results, "restored"), _named(results, "saved"))
    assert_bitwise(_named(results, "resumed"), _named(results, "straight"))
    assert_bitwise(_named(results, "trained_on"), _named(results, "straight"))
  assert_bitwise(processes[1], processes[0])

  # The checkpoint of 2 processes, restored here on 4 local devices.
  _, _, put = _fsdp_problem()
  tx = immgrad.shim(problem.optimizer())
  template = put(
    {"params": problem.params(), "opt_state": tx.init(problem.params())}
  )
  with ocp.CheckpointManager(ckpt_dir) as mngr:
    here = mngr.restore(
      mngr.latest_step(), args=ocp.args.StandardRestore(abstract(template))
    )
  assert isinstance(here["opt_state"], immgrad.ShimState)
  paths = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(here)[0]
  ]
  saved = _named(processes[0], "saved")
  assert sorted(paths) == sorted(saved)
  assert_bitwise(jax.tree.leaves(here), [saved[p] for p in paths])
