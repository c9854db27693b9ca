"""Where the 24-block transformer's compile time goes, compiled for a v5e.

Run as ``benchmarks.compile_tpu`` is (libtpu 0.0.42.1 on PYTHONPATH, no
chip): ``python benchmarks/where_compile_goes.py``. Each
method compiles in a subprocess of its own with libtpu's per-pass log on
(``TPU_VMODULE=hlo_pass_pipeline=2``, which slows compilation a little),
and reports: tracing, lowering and XLA's compile time; the traced
program's equation count; and XLA's time in its HLO passes (the sum the
log gives per pass), the rest being code generation. Three rounds, the
methods interleaved; medians. docs/devlog.md, "Compile time with the
check".
"""

import collections
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

METHODS = ("plain", "current (atomic=False)", "current")
REPEATS = 3
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def one(method: str) -> dict:
  """Compiles ``method``'s step in this process; its times and size."""
  from benchmarks import compile_tpu
  from benchmarks import models

  deep = dict(blocks=24, d_model=256, heads=4, mlp_size=1024, seq=256)
  (c,) = [
    c
    for c in models.transformer(batch=16, **deep, methods=(method,))
    if c.name == method
  ]
  sharding = compile_tpu.tpu_sharding()
  t0 = time.perf_counter()
  traced = compile_tpu.traced_for(c, sharding)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return {
    "trace_s": t1 - t0,
    "lower_s": t2 - t1,
    "compile_s": t3 - t2,
    "equations": _count(traced.jaxpr.jaxpr),
  }


def _count(jaxpr) -> int:
  """Equations in ``jaxpr`` and the jaxprs nested in its equations."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          n += _count(inner)
  return n


def passes(log: str) -> collections.Counter:
  """Seconds per HLO pass name, summed over the log's lines."""
  seconds = collections.Counter()
  for m in re.finditer(r"HLO pass: (\S+) time: ([\d.]+) (us|ms|s) ", log):
    seconds[m.group(1)] += float(m.group(2)) * UNITS[m.group(3)]
  return seconds


def main() -> None:
  if len(sys.argv) == 3 and sys.argv[1] == "--one":
    print("RESULT " + json.dumps(one(sys.argv[2])), flush=True)
    return
  env = dict(
    os.environ,
    TPU_STDERR_LOG_LEVEL="0",
    TPU_MIN_LOG_LEVEL="0",
    TPU_VMODULE="hlo_pass_pipeline=2",
  )
  rounds = {m: [] for m in METHODS}
  for r in range(REPEATS):
    for method in METHODS[r % 3 :] + METHODS[: r % 3]:
      rounds[method].append(measured(method, env))
      print(method, json.dumps(rounds[method][-1]), flush=True)
  keys = ("trace_s", "lower_s", "compile_s", "hlo_passes_s", "codegen_s")
  results = {
    m: {
      **{k: float(np.median([x[k] for x in rs])) for k in keys},
      "equations": rs[0]["equations"],
      "rounds": rs,
    }
    for m, rs in rounds.items()
  }
  out = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "where_compile_goes.json"
  )
  with open(out, "w") as f:
    json.dump(results, f, indent=1)


def measured(method: str, env: dict) -> dict:
  """``one(method)`` in a subprocess, with its HLO passes' times."""
  run = subprocess.run(
    [sys.executable, __file__, "--one", method],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  )
  (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
  r = json.loads(line[len("RESULT ") :])
  per_pass = passes(run.stderr)
  r["hlo_passes_s"] = sum(per_pass.values())
  r["codegen_s"] = r["compile_s"] - r["hlo_passes_s"]
  r["top_passes_s"] = dict(per_pass.most_common(8))
  return r


if __name__ == "__main__":
  main()
