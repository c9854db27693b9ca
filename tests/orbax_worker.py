"""One process of test_orbax.py's 2-process x 2-device orbax checkpoint run.

Started as ``python orbax_worker.py PROCESS_ID PORT CKPT_DIR OUT``. It joins
JAX's multi-process engine over loopback (CPU collectives: gloo), builds a
global mesh of the 4 devices and trains multiprocess_problem's 3-layer
model FSDP style (every weight matrix, and adam's mu and nu of it, split
along the data axis; biases and counts replicated; the batch split too),
each process holding only its share of every global array, always donating
the buffers of the step before:

1. the uninterrupted run of all the problem's steps;
2. a fresh run of ``SAVE_AT`` steps that saves one checkpoint collectively
   (``ocp.CheckpointManager``, async, both processes writing their shards)
   and trains on while the write finishes;
3. with a new manager, the latest checkpoint restored into the abstract
   tree of a fresh template (with the FSDP shardings), and the remaining
   steps trained from it.

What each part ends with is gathered to the host and saved to ``OUT`` (an
``.npz``); the parent compares them bit for bit. Everything happens in
``main``: pytest's ``--doctest-modules`` imports this file, which must then
do nothing.
"""

import os
import sys

SAVE_AT = 1  # Then 2 more steps after the restore.


def main(process_id, port, ckpt_dir, out):
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=120,
  )

  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax
  import orbax.checkpoint as ocp

  import immgrad

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import multiprocess_problem as problem

  assert jax.process_count() == 2 and jax.device_count() == 4
  assert jax.local_device_count() == 2
  mesh = jax.make_mesh((4,), ("data",))
  batch_sharding = NamedSharding(mesh, P("data"))
  tx = immgrad.shim(problem.optimizer())
  grad_fn = immgrad.value_and_grad(problem.loss_fn, tx, mode=problem.MODE)

  def put(tree):
    """FSDP global arrays: each process builds only its own shards."""
    return jax.tree.map(
      lambda a: jax.make_array_from_callback(
        a.shape,
        NamedSharding(mesh, P("data") if a.ndim == 2 else P()),
        lambda i: a[i],
      ),
      tree,
    )

  def global_batch(x):
    """This process's half of a batch, as one global array on the mesh."""
    half = len(x) // 2
    local = x[process_id * half : (process_id + 1) * half]
    return jax.make_array_from_process_local_data(
      batch_sharding, local, x.shape
    )

  def fresh():
    """Initial params and shim state, FSDP-sharded."""
    return {
      "params": put(problem.params()),
      "opt_state": put(jax.device_get(tx.init(problem.params()))),
    }

  def step(tree, x, y):
    params, opt_state = tree["params"], tree["opt_state"]
    _, grads = grad_fn(params, opt_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return {
      "params": optax.apply_updates(params, updates),
      "opt_state": opt_state,
    }

  step = jax.jit(step, donate_argnums=0)

  def run(tree, batches):
    for x, y in batches:
      tree = step(tree, global_batch(x), global_batch(y))
    return tree

  results = {}

  def record(name, tree):
    """Gathers ``tree`` to the host and stores it under ``name``."""
    gathered = multihost_utils.process_allgather(tree, tiled=True)
    for path, leaf in jax.tree_util.tree_flatten_with_path(gathered)[0]:
      results[name + jax.tree_util.keystr(path)] = np.asarray(leaf)
    leaves = jax.tree.leaves(tree)
    results[name + ":specs"] = np.asarray(
      [str(a.sharding.spec) for a in leaves]
    )
    # Of each array's 4 shards, this process holds 2.
    results[name + ":local_shards"] = np.asarray(
      [len(a.addressable_shards) for a in leaves]
    )

  batches = problem.batches()
  options = ocp.CheckpointManagerOptions(
    max_to_keep=1, enable_async_checkpointing=True
  )
  record("straight", run(fresh(), batches))

  tree = run(fresh(), batches[:SAVE_AT])
  record("saved", tree)
  mngr = ocp.CheckpointManager(ckpt_dir, options=options)
  mngr.save(SAVE_AT, args=ocp.args.StandardSave(tree))
  # Train on while the write runs, donating (so deleting) the saved
  # buffers: orbax has copied them to the host before save returns.
  record("trained_on", run(tree, batches[SAVE_AT:]))
  mngr.wait_until_finished()
  assert mngr.all_steps() == [SAVE_AT], mngr.all_steps()
  mngr.close()

  mngr = ocp.CheckpointManager(ckpt_dir, options=options)
  template = fresh()  # Only its structure, shapes, dtypes and shardings.
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
  assert mngr.latest_step() == SAVE_AT, mngr.latest_step()
  restored = mngr.restore(
    mngr.latest_step(), args=ocp.args.StandardRestore(abstract)
  )
  mngr.close()
  assert jax.tree.structure(restored) == jax.tree.structure(template)
  assert isinstance(restored["opt_state"], immgrad.ShimState)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert got.sharding == want.sharding, (got.sharding, want.sharding)
    assert got.dtype == want.dtype and got.shape == want.shape
  record("restored", restored)
  record("resumed", run(restored, batches[SAVE_AT:]))
  np.savez(out, **results)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
