"""Measuring one training step: XLA's cost and memory, compile and step time.

Every figure is taken from a compiled, jitted step whose parameters and
optimizer state are donated, as a user would run it:

* FLOPs: ``compiled.cost_analysis()["flops"]``;
* peak memory: ``compiled.memory_analysis()``, temp + arguments + outputs
  - aliased (donated inputs reused as outputs), in bytes;
* compile time: ``lower`` + ``compile``, wall seconds;
* step time: the median of ``repeats`` steps after ``warmup`` steps, each
  timed from dispatch to ``block_until_ready``. The methods of one model
  are timed interleaved (A, B, C, then B, C, A, ...), so that drift in the
  machine's speed falls on all of them alike.
"""

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np


@dataclasses.dataclass
class Candidate:
  """One method on one model: a step and the arguments it starts from."""
  name: str
  step: Callable  # (params, opt_state, *batch) -> (params, opt_state, loss)
  params: Any
  opt_state: Any
  batch: tuple


def _flops(compiled) -> float:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older JAX: one dict per device.
    cost = cost[0]
  return float(cost["flops"])


def _peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes +
             m.output_size_in_bytes - m.alias_size_in_bytes)


def measure(candidates: list[Candidate], *, warmup: int,
            repeats: int) -> dict[str, dict]:
  """Figures for each candidate, timed interleaved; absolute values."""
  compiled, state, out = {}, {}, {}
  for c in candidates:
    jitted = jax.jit(c.step, donate_argnums=(0, 1))
    start = time.perf_counter()
    compiled[c.name] = jitted.lower(c.params, c.opt_state, *c.batch).compile()
    out[c.name] = {"compile_seconds": time.perf_counter() - start,
                   "flops": _flops(compiled[c.name]),
                   "peak_bytes": _peak_bytes(compiled[c.name]),
                   "step_seconds": []}
    state[c.name] = (c.params, c.opt_state)
  names = [c.name for c in candidates]
  batches = {c.name: c.batch for c in candidates}
  for i in range(warmup + repeats):
    order = names[i % len(names):] + names[:i % len(names)]
    for name in order:
      start = time.perf_counter()
      params, opt_state, loss = compiled[name](*state[name], *batches[name])
      jax.block_until_ready((params, opt_state, loss))
      if i >= warmup:
        out[name]["step_seconds"].append(time.perf_counter() - start)
      state[name] = (params, opt_state)
  for figures in out.values():
    figures["median_step_seconds"] = float(np.median(figures["step_seconds"]))
  return out


def flops(candidates: list[Candidate]) -> dict[str, float]:
  """Each candidate's FLOPs, compiled only (for a loop-free twin of a model:
  XLA's cost analysis counts a loop's body once, whatever its trip count)."""
  return {c.name: _flops(jax.jit(c.step, donate_argnums=(0, 1)).lower(
      c.params, c.opt_state, *c.batch).compile()) for c in candidates}


def ratios(figures: dict[str, dict], baseline: str = "plain") -> dict:
  """Each candidate's figures divided by the baseline's, same run."""
  base = figures[baseline]
  return {name: {key: f[key] / base[key] for key in
                 ("flops", "peak_bytes", "median_step_seconds",
                  "compile_seconds")}
          for name, f in figures.items()}
