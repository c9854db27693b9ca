"""Data parallel immediate updates: a raw JAX MLP on 4 devices.

The batch is split over a mesh axis ``"data"`` and the step runs under
``jax.shard_map``; ``immgrad.value_and_grad(..., axis_name="data")``
averages each layer's gradient over the devices inside its backward rule,
before the layer steps, so every device holds the same weights and the run
equals one device training on the whole batch, which the script checks.
The model is plain JAX made immediate by ``immgrad.immediate``. On a CPU,
the script asks XLA for 4 host devices before JAX starts:

    python -m pip install .
    python examples/data_parallel.py --mode updated --steps 200

Prints the loss every tenth of the run, then how far the 4-device weights
are from the 1-device run's.
"""

import os

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import argparse  # After XLA_FLAGS, which JAX reads when it starts.

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import optax

import immgrad


def mlp(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def init(key, sizes):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
    {"w": jax.random.normal(k, (m, n)) / jnp.sqrt(m), "b": jnp.zeros(n)}
    for k, m, n in zip(keys, sizes[:-1], sizes[1:])
  ]


def loss_fn(params, x, y):
  return jnp.mean((immgrad.immediate(mlp)(params, x) - y) ** 2)


def make_step(tx, mode, axis_name):
  """The training step; its gradients averaged over ``axis_name``."""
  grad_fn = immgrad.value_and_grad(loss_fn, tx, mode=mode, axis_name=axis_name)

  def step(params, opt_state, x, y):
    loss, grads = grad_fn(params, opt_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    if axis_name:  # Each device's loss is of its own shard: average them.
      loss = jax.lax.pmean(loss, axis_name)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--mode", default="updated", choices=["updated", "current"]
  )
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--lr", type=float, default=0.05)
  args = parser.parse_args()

  devices = jax.device_count()
  mesh = jax.make_mesh((devices,), ("data",))
  sizes = [16, 64, 64, 4]
  teacher_key, student_key, data_key = jax.random.split(jax.random.key(0), 3)
  teacher = init(teacher_key, sizes)
  tx = immgrad.shim(optax.sgd(args.lr, momentum=0.9))

  # Weights and optimizer state replicated (P()), the batch split (P("data")).
  parallel = jax.jit(
    jax.shard_map(
      make_step(tx, args.mode, axis_name="data"),
      mesh=mesh,
      in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P(), P()),
    )
  )
  single = jax.jit(make_step(tx, args.mode, axis_name=None))

  params = single_params = init(student_key, sizes)
  opt_state = single_state = tx.init(params)
  every = max(1, args.steps // 10)
  for i, key in enumerate(jax.random.split(data_key, args.steps), 1):
    x = jax.random.normal(key, (32 * devices, sizes[0]))
    y = mlp(teacher, x)
    shards = jax.device_put((x, y), NamedSharding(mesh, P("data")))
    params, opt_state, loss = parallel(params, opt_state, *shards)
    single_params, single_state, _ = single(single_params, single_state, x, y)
    if i == 1 or i % every == 0:
      print(f"step {i:4d}  loss {float(loss):.5f}  ({devices} devices)")

  gap = max(
    float(jnp.abs(a - b).max())
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(single_params))
  )
  print(
    f"{devices} devices vs 1 device on the whole batch, mode {args.mode}: "
    f"largest weight difference {gap:.1e}"
  )


if __name__ == "__main__":
  main()
