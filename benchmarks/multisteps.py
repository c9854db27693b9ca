"""``python -m benchmarks.multisteps``: what gradient accumulation costs.

``optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4)`` on the MLP of
``models.mlp`` (8 layers of 512, batch 64 a micro-batch): plain training
with it against immgrad's methods with it, compiled and timed interleaved
in one process (``measure.measure``), as ratios to plain; then the same
with ``optax.adam(1e-3)`` alone, for comparison. Prints docs/accumulation.md's
table.
"""

import argparse
import platform

import jax
import optax

from benchmarks import measure
from benchmarks import models

METHODS = (
  "plain",
  "current",
  "updated",
  "current (atomic=False)",
  "updated (atomic=False)",
)


def _ratios(make_opt, repeats: int) -> tuple[dict, dict]:
  """Each method's (peak memory, step time) over plain's; plain's own."""
  candidates = models.mlp(8, 512, 64, methods=METHODS, make_opt=make_opt)
  figures = measure.measure(candidates, warmup=8, repeats=repeats)
  plain = figures["plain"]
  return {
    name: (
      f["peak_bytes"] / plain["peak_bytes"],
      f["median_step_seconds"] / plain["median_step_seconds"],
    )
    for name, f in figures.items()
  }, plain


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=60)
  args = parser.parse_args()
  accumulated, plain = _ratios(
    lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4),
    args.repeats,
  )
  alone, _ = _ratios(lambda: optax.adam(1e-3), args.repeats)
  print(
    f"{jax.default_backend()} ({platform.machine()}), jax {jax.__version__};"
    f" plain MultiSteps: {plain['peak_bytes'] / 2**20:.1f} MiB,"
    f" {plain['median_step_seconds'] * 1e3:.1f} ms a micro-batch"
  )
  print("| method | peak memory | step time | adam alone: memory | time |")
  print("| --- | --- | --- | --- | --- |")
  for name in METHODS[1:]:
    (memory, time), (memory_alone, time_alone) = accumulated[name], alone[name]
    print(
      f"| {name} | {memory:.3f} | {time:.2f} | {memory_alone:.3f} "
      f"| {time_alone:.2f} |"
    )


if __name__ == "__main__":
  main()
