"""Where the scan MLP's `current` compile time went on the TPU (2026-12-06).

Times tracing (`lower`, which runs the per-layer check on first use) and
compiling the step of plain, current and updated on the 16x2048 scan MLP,
and each per-layer check on its own. Run from the repository root with
``PYTHONPATH=. python benchmarks/tpu_v5e_5f85c4a/check_compile.py``;
output in check_compile.log beside it.
"""

import functools
import logging
import time

import jax

from benchmarks import models
from immgrad._src import stacked

jax.config.update("jax_log_compiles", True)
logging.basicConfig(level=logging.WARNING, format="%(message).200s")
_compare = stacked._compare.__wrapped__  # pylint: disable=protected-access


@functools.lru_cache(maxsize=256)
def _timed(pair):
  start = time.perf_counter()
  worst = _compare(pair)
  seconds = time.perf_counter() - start
  print(f"CHECK {pair.programs[0].param_aval} -> {worst} in {seconds:.2f}s")
  return worst


stacked._compare = _timed  # pylint: disable=protected-access
for c in models.scanned_mlp(16, 2048, 1024):
  if c.name not in ("plain", "current", "updated"):
    continue
  shapes = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
    (c.params, c.opt_state, *c.batch),
  )
  start = time.perf_counter()
  lowered = jax.jit(c.step, donate_argnums=(0, 1)).lower(*shapes)
  traced = time.perf_counter()
  lowered.compile()
  done = time.perf_counter()
  print(
    f"STEP {c.name}: lower {traced - start:.2f}s compile {done - traced:.2f}s"
  )
