"""``python -m benchmarks.compile_tpu``: the models compiled for a TPU, no TPU.

XLA's TPU compiler (``libtpu``) compiles for a TPU topology on any Linux
host, no chip attached ("deviceless" ahead-of-time compilation,
``jax.experimental.topologies``). This compiles ``python -m benchmarks``'s
accelerator models for one TPU v5e chip and records what compilation alone
tells: XLA's FLOPs, bytes accessed and peak memory, the optimized HLO's
operation counts, and the compile time on this host, as ratios to plain
training (XLA counts a loop's body once: the scanned models' FLOPs and
bytes accessed hold one iteration of each loop). No step time: that needs
the chip.

The figures are the chip's when ``libtpu`` is the version the TPU machine
runs: the one ``jax[tpu]`` pins for the installed JAX (``libtpu 0.0.42.1``
for jax 0.10.2). Install it into a folder of its own, not beside JAX: with
``libtpu`` importable every JAX process looks for a TPU at start::

  pip download --no-deps "libtpu==0.0.42.*" -d /tmp/wheels
  pip install --no-deps --target /tmp/libtpu /tmp/wheels/libtpu-*.whl
  PYTHONPATH=/tmp/libtpu python -m benchmarks.compile_tpu --models 24

``--repeats`` compiles every method that many times, interleaved (A, B, C,
then B, C, A, ...), and reports the median: compile time on a shared CPU
drifts. ``--hlo-dir`` writes each step's optimized TPU HLO. See
docs/development.md ("Compiling for the TPU without one").
"""

import argparse
from importlib import metadata
import json
import os
import sys
import time
from unittest import mock

import numpy as np

# libtpu reads these at start; without them it warns and guesses.
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

import jax
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from benchmarks import __main__ as bench
from benchmarks import measure
from benchmarks import models
from immgrad._src import commit

HERE = os.path.dirname(os.path.abspath(__file__))


def tpu_sharding(topology: str = "v5e:1x1") -> NamedSharding:
  """A sharding that places an array whole on the first chip of ``topology``."""
  kwargs = {}
  if topology == "v5e:1x1":  # libtpu's default host is 2x2 chips.
    kwargs["chips_per_host_bounds"] = (1, 1, 1)
  topo = topologies.get_topology_desc(
    platform="tpu", topology_name=topology, **kwargs
  )
  mesh = topologies.make_mesh(topo, (1,), ("x",))
  return NamedSharding(mesh, PartitionSpec())


def traced_for(candidate: measure.Candidate, sharding) -> jax.stages.Traced:
  """``candidate``'s step traced for arrays placed by ``sharding``.

  The atomic shim commits by select on an accelerator and by ``lax.cond``
  on the CPU, choosing by the default backend while it is traced, which
  in this process is the CPU: the accelerator's choice is made here.
  """
  shapes = measure.abstract_inputs(candidate, sharding)
  step = jax.jit(measure._fresh(candidate.step), donate_argnums=(0, 1))
  with mock.patch.object(commit, "by_select", lambda: True):
    return step.trace(*shapes)


def compile_for(candidate: measure.Candidate, sharding) -> tuple:
  """``(compiled, figures)``: ``candidate``'s step compiled for ``sharding``
  (:func:`traced_for`), and the seconds that took.
  """
  start = time.perf_counter()
  compiled = traced_for(candidate, sharding).lower().compile()
  seconds = time.perf_counter() - start
  return compiled, {
    "compile_seconds": seconds,
    **measure.compiled_figures(compiled),
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.compile_tpu",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument(
    "--models", nargs="*", help="only models whose names contain one of these"
  )
  parser.add_argument(
    "--immediate",
    action="store_true",
    help="immgrad.immediate against the adapters",
  )
  parser.add_argument(
    "--methods", nargs="*", help="only these methods (plain always)"
  )
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--hlo-dir", help="write each step's optimized HLO here")
  parser.add_argument(
    "--out",
    default=os.path.join(HERE, "results_tpu_v5e_compiled.json"),
    help="results file",
  )
  args = parser.parse_args(argv)
  sharding = tpu_sharding()
  methods = models.IMMEDIATE_METHODS if args.immediate else models.METHODS
  if args.methods:
    methods = tuple(m for m in methods if m == "plain" or m in args.methods)
  results = {
    "settings": {
      "topology": "v5e:1x1",
      "repeats": args.repeats,
      "optimizer": "adam(1e-3)",
      "libtpu": _libtpu_version(),
    },
    "machine": bench._machine(),
    "models": {},
  }
  for name, make, _ in bench.accelerator_models(methods):
    if args.models and not any(m in name for m in args.models):
      continue
    print(f"compiling {name} ...", file=sys.stderr, flush=True)
    candidates = make()
    figures = {c.name: None for c in candidates}
    times = {c.name: [] for c in candidates}
    for r in range(args.repeats):
      shift = r % len(candidates)
      for c in candidates[shift:] + candidates[:shift]:
        compiled, f = compile_for(c, sharding)
        times[c.name].append(f.pop("compile_seconds"))
        if figures[c.name] is None:
          figures[c.name] = f
          if args.hlo_dir:
            folder = os.path.join(args.hlo_dir, bench._slug(name))
            measure.write_hlo(folder, c.name, compiled)
        elif f != figures[c.name]:
          raise RuntimeError(f"{name} | {c.name}: compiled differently")
        del compiled
    for method, f in figures.items():
      f["compile_seconds"] = times[method]
      f["median_compile_seconds"] = float(np.median(times[method]))
    keys = ("flops", "bytes_accessed", "peak_bytes", "median_compile_seconds")
    results["models"][name] = {
      "figures": figures,
      "ratios": measure.ratios(figures, keys=keys),
    }
    with open(args.out, "w") as f:  # After each model: a later one may fail.
      json.dump(results, f, indent=1)
  print(table(results))
  return 0


def table(results) -> str:
  """A Markdown table of the ratios to plain training."""
  rows = [
    "| model | method | FLOPs | bytes accessed | peak memory | compile "
    "| plain's compile s | selects | fusions |",
    "| --- " * 9 + "|",
  ]
  for name, entry in results["models"].items():
    label, plain = name, entry["figures"]["plain"]["median_compile_seconds"]
    for method, r in entry["ratios"].items():
      h = entry["figures"][method]["hlo"]
      rows.append(
        f"| {label} | {method} | {r['flops']:.4f} | "
        f"{r['bytes_accessed']:.3f} | {r['peak_bytes']:.3f} | "
        f"{r['median_compile_seconds']:.2f} | {plain:.1f} | "
        f"{h['select']} | {h['fusion']} |"
      )
      label = ""
  return "\n".join(rows)


def _libtpu_version() -> str | None:
  try:
    return metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    return None


if __name__ == "__main__":
  sys.exit(main())
