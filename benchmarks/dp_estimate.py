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
"""

import argparse
import json
import math
import os
from typing import NamedTuple

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


def table(params: dict, step: float, latency: float = STEP_LATENCY_S) -> str:
  """The markdown table of exposed milliseconds and their share of
  ``step``, for 8 and 256 chips, per leaf and per layer, float32 and
  bfloat16, under both algorithms.
  """
  rows = [
    "| chips | all-reduces | dtype | MB | 2D torus: latency + bandwidth "
    "(ms) | of the step | one ring (ms) | of the step |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for chips, shape in SLICES.items():
    for dtype, itemsize in (("float32", 4), ("bfloat16", 2)):
      for kind, sizes in collectives(params, itemsize).items():
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
  args = parser.parse_args(argv)
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
  print(table(params, step, args.latency_us * 1e-6))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
