r"""Data parallel immediate updates across processes, with JAX's own engine.

On one machine, start 2 processes with 2 CPU devices each:

    python examples/multiprocess.py --launch 2

On a cluster, run the same file once per host (every host the same
command, its own ``--process-id``), with the coordinator's address:

    python examples/multiprocess.py --coordinator HOST0:PORT \
        --num-processes N --process-id I

Each process feeds its own slice of the global batch
(``jax.make_array_from_process_local_data``); ``jax.shard_map`` over the
global mesh runs the step, and ``immgrad.value_and_grad(...,
axis_name="data")`` averages each layer's gradient across all processes'
devices inside its backward rule. Every process ends with the same weights.
"""

import argparse
import os
import socket
import subprocess
import sys


def launch(n: int, devices: int) -> int:
  """Starts ``n`` local processes of this script and waits for them."""
  with socket.socket() as s:  # A free port for the coordinator.
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        __file__,
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        str(n),
        "--process-id",
        str(i),
        "--local-devices",
        str(devices),
      ]
    )
    for i in range(n)
  ]
  return max(p.wait() for p in procs)


def train(args) -> None:
  os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={args.local_devices}"
  )
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    args.coordinator,
    num_processes=args.num_processes,
    process_id=args.process_id,
  )
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  import numpy as np
  import optax

  import immgrad

  @immgrad.immediate_layer
  def dense(x, p):
    return x @ p["w"] + p["b"]

  def loss_fn(params, x, y):
    h = jax.nn.relu(dense(x, params["l1"]))
    return jnp.mean((dense(h, params["l2"]) - y) ** 2)

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  rng = np.random.default_rng(0)  # Same parameters on every process.
  params = {
    "l1": {
      "w": rng.normal(size=(8, 32)).astype(np.float32) / 3,
      "b": np.zeros(32, np.float32),
    },
    "l2": {
      "w": rng.normal(size=(32, 1)).astype(np.float32) / 6,
      "b": np.zeros(1, np.float32),
    },
  }
  tx = immgrad.shim(optax.adam(1e-2))
  opt_state = tx.init(params)
  grad_fn = immgrad.value_and_grad(loss_fn, tx, axis_name="data")

  def step(params, opt_state, x, y):
    loss, grads = grad_fn(params, opt_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (
      optax.apply_updates(params, updates),
      opt_state,
      jax.lax.pmean(loss, "data"),
    )

  step = jax.jit(
    jax.shard_map(
      step,
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P(), P()),
    )
  )
  batch = NamedSharding(mesh, P("data"))
  local = 16 * jax.local_device_count()  # This process's share.
  data = np.random.default_rng(1 + jax.process_index())
  for i in range(20):
    x = data.normal(size=(local, 8)).astype(np.float32)
    y = np.sin(x.sum(axis=1, keepdims=True))
    global_x = jax.make_array_from_process_local_data(batch, x)
    global_y = jax.make_array_from_process_local_data(batch, y)
    params, opt_state, loss = step(params, opt_state, global_x, global_y)
    if jax.process_index() == 0 and i % 5 == 4:
      print(f"step {i + 1}: loss {float(loss):.4f}", flush=True)
  total = float(jnp.sum(params["l1"]["w"]))
  print(
    f"process {jax.process_index()}: sum of l1.w {total:.6f} "
    f"(equal on every process)",
    flush=True,
  )
  jax.distributed.shutdown()


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--launch",
    type=int,
    metavar="N",
    help="start N local processes of this script",
  )
  parser.add_argument("--coordinator", help="HOST:PORT of process 0")
  parser.add_argument("--num-processes", type=int)
  parser.add_argument("--process-id", type=int)
  parser.add_argument(
    "--local-devices",
    type=int,
    default=2,
    help="simulated CPU devices per process",
  )
  args = parser.parse_args()
  if args.launch:
    sys.exit(launch(args.launch, args.local_devices))
  train(args)


if __name__ == "__main__":
  main()
