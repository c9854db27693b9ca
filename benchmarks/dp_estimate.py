"""``python -m benchmarks.dp_estimate``: `updated`'s all-reduces on many chips.

An estimate, not a measurement. In ``mode="updated"`` each immediate
layer's ``dW`` must be averaged over the replicas before that layer's dX
starts, so every layer's all-reduce sits on the backward pass's critical
path; plain training (and ``current``) overlaps them with the backward
pass. The exposed time per step is the sum over the collectives of

  ``steps * latency + 2 * (n - 1) / n * bytes / bandwidth``

on ``n`` chips. Two algorithms: XLA's all-reduce on a v5e slice's 2D
torus (reduce-scatter and all-gather along each dimension, all four links
at once: ``2 * ((nx - 1) + (ny - 1))`` steps at the pod's all-reduce
bandwidth per chip), and one ring through every chip on one link
(``2 * (n - 1)`` steps at one link's bandwidth). Prints a markdown table for
the benchmark's GPT-small transformer (docs/data-parallel.md holds it).

``--compiled`` adds the all-reduces XLA's TPU compiler makes of the step:
the model's ``updated`` step under ``shard_map`` with ``axis_name``,
compiled for a v5e 2x4 slice with no chip attached (``libtpu`` on the path,
as for ``benchmarks.compile_tpu``; minutes)::

  PYTHONPATH=/tmp/libtpu python -m benchmarks.dp_estimate --compiled
"""

import argparse
import functools
import json
import math
import os
import re
from typing import NamedTuple
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

# https://cloud.google.com/tpu/docs/v5e: "All-reduce bandwidth per Pod
# 51.2 TB/s" over a 256-chip pod, and "Bidirectional inter-chip
# interconnect (ICI) bandwidth (per chip) 400 GBps", which a 2D torus
# spreads over four links, each both ways.
ALL_REDUCE_BYTES_PER_S = 51.2e12 / 256
LINK_BYTES_PER_S = 400e9 / 4 / 2
# Per step of a collective (one hop and its synchronisation); not
# published: an assumption, the same for both algorithms.
STEP_LATENCY_S = 1e-6

GPT_SMALL = dict(blocks=12, d_model=768, heads=12, mlp_size=3072, seq=512)
SLICES = {8: (2, 4), 256: (16, 16)}  # v5e slice shapes.


class Algorithm(NamedTuple):
  name: str
  bandwidth: float  # Bytes per second per chip.

  def steps(self, shape: tuple) -> int:
    if self.name == "ring":
      return 2 * (math.prod(shape) - 1)
    return sum(2 * (k - 1) for k in shape)


TORUS = Algorithm("2D torus", ALL_REDUCE_BYTES_PER_S)
RING = Algorithm("ring", LINK_BYTES_PER_S)


def all_reduce_seconds(
  nbytes: float, shape: tuple, algorithm: Algorithm, latency: float
) -> tuple[float, float]:
  """``(latency part, bandwidth part)`` of one all-reduce of ``nbytes`` on
  a slice of ``shape`` chips.
  """
  n = math.prod(shape)
  return (
    algorithm.steps(shape) * latency,
    2 * (n - 1) / n * nbytes / algorithm.bandwidth,
  )


def exposed_seconds(
  collectives: list, shape: tuple, algorithm: Algorithm, latency: float
) -> tuple[float, float]:
  """``(latency part, bandwidth part)`` of all-reducing each of
  ``collectives`` (bytes) one after the other.
  """
  parts = [
    all_reduce_seconds(b, shape, algorithm, latency) for b in collectives
  ]
  return sum(p[0] for p in parts), sum(p[1] for p in parts)


def collectives(params: dict, itemsize: int) -> dict:
  """The bytes of each all-reduce of a Haiku params dict: ``"per leaf"``,
  one per parameter, and ``"per layer"``, one per module (an immediate
  layer under ``immgrad.haiku.immediate``), each element ``itemsize``
  bytes.
  """
  sizes = {
    m: [np.size(a) for a in leaves.values()] for m, leaves in params.items()
  }
  return {
    "per leaf": [s * itemsize for m in sizes.values() for s in m],
    "per layer": [sum(m) * itemsize for m in sizes.values()],
  }


_DTYPE_BYTES = {"f32": 4, "bf16": 2}


def compiled_collectives(hlo: str) -> list:
  """The bytes of each all-reduce in an optimized HLO module's text (a
  tuple of operands is one all-reduce).
  """
  sizes = []
  for line in hlo.splitlines():
    found = re.search(r"= (.*?) all-reduce(?:-start)?\(", line)
    if found:
      sizes.append(
        sum(
          _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
          for dtype, dims in re.findall(r"(f32|bf16)\[([\d,]*)\]", found[1])
        )
      )
  return sizes


def compiled_for_tpu(reduce_dtype=None) -> list:
  """:func:`compiled_collectives` of GPT-small's ``updated (atomic=False)``
  step, 1 sequence per chip, on 8 v5e chips (needs ``libtpu``).
  """
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  import jax
  from jax.experimental import topologies
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from benchmarks import models
  import immgrad

  topology = topologies.get_topology_desc(
    platform="tpu", topology_name="v5e:2x4"
  )
  mesh = topologies.make_mesh(topology, (8,), ("d",))
  grad = functools.partial(
    immgrad.value_and_grad, axis_name="d", reduce_dtype=reduce_dtype
  )
  with mock.patch.object(immgrad, "value_and_grad", grad):
    (updated,) = models.transformer(
      batch=8, **GPT_SMALL, methods=("updated (atomic=False)",)
    )
  step = jax.jit(
    jax.shard_map(
      updated.step,
      mesh=mesh,
      in_specs=(P(), P(), P("d"), P("d")),
      out_specs=P(),
      check_vma=False,
    )
  )
  place = lambda tree, spec: jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(
      a.shape, a.dtype, sharding=NamedSharding(mesh, spec)
    ),
    tree,
  )
  compiled = step.lower(
    place(updated.params, P()),
    place(updated.opt_state, P()),
    *place(updated.batch, P("d")),
  ).compile()
  return compiled_collectives(compiled.as_text())


def gpt_small_params() -> dict:
  """The parameters of ``python -m benchmarks``'s GPT-small transformer."""
  from benchmarks import models

  (plain,) = models.transformer(batch=1, **GPT_SMALL, methods=("plain",))
  return plain.params


def step_seconds() -> float:
  """Plain training's step of that model on one v5e chip, batch 16
  (``results_tpu_v5e.json``).
  """
  with open(os.path.join(HERE, "results_tpu_v5e.json")) as f:
    models = json.load(f)["models"]
  (name,) = [m for m in models if "d 768" in m and m.endswith("unrolled")]
  return models[name]["figures"]["plain"]["median_step_seconds"]


def table(
  params: dict,
  step: float,
  latency: float = STEP_LATENCY_S,
  compiled: dict | None = None,
) -> str:
  """The markdown table of exposed milliseconds and their share of
  ``step``, for 8 and 256 chips, per leaf and per layer (and ``compiled``:
  as compiled, by dtype), float32 and bfloat16, under both algorithms.
  """
  rows = [
    "| chips | all-reduces | dtype | MB | 2D torus: latency + bandwidth "
    "(ms) | of the step | one ring (ms) | of the step |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for chips, shape in SLICES.items():
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
      kinds = collectives(params, itemsize)
      if compiled:
        kinds["as compiled"] = compiled[dtype]
      for kind, sizes in kinds.items():
        cells = [f"{chips} ({shape[0]}x{shape[1]})", f"{len(sizes)} ({kind})"]
        cells += [dtype, f"{sum(sizes) / 1e6:.0f}"]
        for algorithm in (TORUS, RING):
          lat, bw = exposed_seconds(sizes, shape, algorithm, latency)
          if algorithm is TORUS:
            cells.append(
              f"{lat * 1e3:.1f} + {bw * 1e3:.1f} = {(lat + bw) * 1e3:.1f}"
            )
          else:
            cells.append(f"{(lat + bw) * 1e3:.1f}")
          cells.append(f"{(lat + bw) / step:.0%}")
        rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.dp_estimate",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument(
    "--latency-us",
    type=float,
    default=STEP_LATENCY_S * 1e6,
    help="the assumed latency of one step of a collective, microseconds",
  )
  parser.add_argument(
    "--compiled",
    action="store_true",
    help="add the all-reduces of the step compiled for 8 v5e chips (libtpu)",
  )
  args = parser.parse_args(argv)
  compiled = None
  if args.compiled:
    compiled = {
      "float32": compiled_for_tpu(),
      "bfloat16": compiled_for_tpu("bfloat16"),
    }
  params = gpt_small_params()
  leaves = [a for m in params.values() for a in m.values()]
  matrices = [
    m for m, ls in params.items() if "w" in ls and np.ndim(ls["w"]) == 2
  ]
  step = step_seconds()
  print(
    f"GPT-small: {len(params)} modules, {len(leaves)} leaves, "
    f"{len(matrices)} weight matrices, "
    f"{sum(np.size(a) for a in leaves) / 1e6:.1f}M parameters; "
    f"plain step on one v5e chip {step * 1e3:.1f} ms"
  )
  print(table(params, step, args.latency_us * 1e-6, compiled))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
