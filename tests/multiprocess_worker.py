"""One process of a 2-process x 2-device training run (test_multiprocess.py).

Started as ``python multiprocess_worker.py PROCESS_ID PORT OUT``: it joins
JAX's multi-process engine over loopback (CPU collectives: gloo), builds a
global mesh of the 4 devices, trains ``tiny``'s 3-layer model for 3 steps
in three ways, and saves the resulting parameters (gathered to the host)
and what it learned about shardings to ``OUT`` (an ``.npz``).

* ``axis_name``: ``jax.shard_map`` over the data axis, immgrad averaging
  each layer's gradient with ``lax.pmean``;
* ``jit_mesh``: plain ``jax.jit`` over the global mesh with the batch
  sharded along it and no axis name (XLA reduces);
* ``fsdp``: the same, with every weight matrix sharded along the data axis
  (FSDP style) and the bias replicated.
"""

import os
import sys

process_id, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
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

import immgrad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multiprocess_problem as problem

assert jax.process_count() == 2 and jax.device_count() == 4
mesh = jax.make_mesh((4,), ("data",))
replicated = NamedSharding(mesh, P())
batch_sharding = NamedSharding(mesh, P("data"))


def global_batch(x):
  """This process's half of a batch, as one global array on the mesh."""
  half = len(x) // 2
  local = x[process_id * half : (process_id + 1) * half]
  return jax.make_array_from_process_local_data(batch_sharding, local, x.shape)


def put(tree, sharding_of):
  return jax.tree.map(
    lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]),
    tree,
    sharding_of(tree),
  )


def train(kind):
  tx = immgrad.shim(problem.optimizer())
  axis = "data" if kind == "axis_name" else None
  grad_fn = immgrad.value_and_grad(
    problem.loss_fn, tx, mode=problem.MODE, axis_name=axis
  )

  def step(params, opt_state, x, y):
    _, grads = grad_fn(params, opt_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  if kind == "axis_name":
    step = jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P()),
    )
  if kind == "fsdp":
    shardings = lambda t: jax.tree.map(
      lambda a: NamedSharding(mesh, P("data") if a.ndim == 2 else P()), t
    )
  else:
    shardings = lambda t: jax.tree.map(lambda a: replicated, t)
  params = put(problem.params(), shardings)
  opt_state = put(
    jax.device_get(tx.init(problem.params())),
    lambda t: jax.tree.map(
      lambda a: (
        NamedSharding(mesh, P("data"))
        if kind == "fsdp" and a.ndim == 2
        else replicated
      ),
      t,
    ),
  )
  in_shardings = [a.sharding for a in jax.tree.leaves(params)]
  step = jax.jit(step, donate_argnums=(0, 1))
  for x, y in problem.batches():
    params, opt_state = step(
      params, opt_state, global_batch(x), global_batch(y)
    )
  same = all(
    a.sharding.is_equivalent_to(s, a.ndim)
    for a, s in zip(jax.tree.leaves(params), in_shardings)
  )
  # How each matrix of the new optimizer state is split on its first axis.
  state_sharded = [
    str(a.sharding.spec[0]) if len(a.sharding.spec) else ""
    for a in jax.tree.leaves(opt_state)
    if a.ndim == 2
  ]
  gathered = multihost_utils.process_allgather(params, tiled=True)
  return gathered, same, state_sharded


results = {}
for kind in ("axis_name", "jit_mesh", "fsdp"):
  params, same, state_specs = train(kind)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    results[f"{kind}{jax.tree_util.keystr(path)}"] = np.asarray(leaf)
  results[f"{kind}:same_sharding"] = np.asarray(same)
  results[f"{kind}:state_specs"] = np.asarray(state_specs)
np.savez(out, **results)
jax.distributed.shutdown()
