"""Measuring one training step: XLA's cost and memory, compile and step time.

Every figure is taken from a compiled, jitted step whose parameters and
optimizer state are donated, as a user would run it:

* FLOPs: ``compiled.cost_analysis()["flops"]``;
* peak memory: ``compiled.memory_analysis()``, temp + arguments + outputs
  - aliased (donated inputs reused as outputs), in bytes;
* compile time: ``lower`` + ``compile``, wall seconds;
* bytes accessed: ``compiled.cost_analysis()["bytes accessed"]``, XLA's
  count of the bytes every operation reads and writes (a loop's body once);
* step time: the median of ``repeats`` steps after ``warmup`` steps, each
  timed from dispatch to ``block_until_ready``.

:func:`measure` keeps every method's buffers on the device and times the
methods of one model interleaved (A, B, C, then B, C, A, ...), so that
drift in the machine's speed falls on all of them alike (the CPU).
:func:`measure_alone` compiles each method from shapes alone and puts
only that method's parameters and state on the device, one method at a
time, so that a model sized for an accelerator fits (on a TPU a step's
time does not drift).
"""

import collections
import dataclasses
import functools
import glob
import os
import re
import tempfile
import time
from typing import Any, Callable

import jax
import numpy as np


@dataclasses.dataclass
class Candidate:
  """One method on one model: a step and the arguments it starts from."""

  name: str
  step: Callable  # (params, opt_state, *batch) -> (params, opt_state, loss)
  params: Any  # On the host (numpy): each measurement puts its own copy on
  opt_state: Any  # the device, which the step donates.
  batch: tuple


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # Older JAX: one dict per device.
    cost = cost[0]
  return cost


def _flops(compiled) -> float:
  return float(_cost(compiled)["flops"])


def _peak_bytes(compiled) -> int:
  m = compiled.memory_analysis()
  return int(
    m.temp_size_in_bytes
    + m.argument_size_in_bytes
    + m.output_size_in_bytes
    - m.alias_size_in_bytes
  )


def _fresh(step: Callable) -> Callable:
  """``step`` as a new function, which no cache of ``jax.jit`` has seen."""

  @functools.wraps(step)
  def fresh(*args):
    return step(*args)

  return fresh


def measure(
  candidates: list[Candidate], *, warmup: int, repeats: int, compiles: int = 1
) -> dict[str, dict]:
  """Figures for each candidate, timed interleaved; absolute values.

  ``compiles`` > 1: the compile time is the median of that many, taken
  interleaved after one more that is dropped (the first pays for imports
  and JAX's first-use caches), each through a fresh ``jax.jit`` wrapper so
  that no cache serves it; ``compile_seconds_each`` lists them.
  """
  compiled, state, out, seconds = {}, {}, {}, {}
  for _ in range(compiles + (compiles > 1)):
    for c in candidates:
      jitted = jax.jit(_fresh(c.step), donate_argnums=(0, 1))
      start = time.perf_counter()
      compiled[c.name] = jitted.lower(c.params, c.opt_state, *c.batch).compile()
      seconds.setdefault(c.name, []).append(time.perf_counter() - start)
  for c in candidates:
    each = seconds[c.name][1:] if compiles > 1 else seconds[c.name]
    out[c.name] = {
      "compile_seconds": float(np.median(each)),
      **({"compile_seconds_each": each} if compiles > 1 else {}),
      "flops": _flops(compiled[c.name]),
      "peak_bytes": _peak_bytes(compiled[c.name]),
      "step_seconds": [],
    }
    state[c.name] = jax.device_put((c.params, c.opt_state))
  names = [c.name for c in candidates]
  batches = {c.name: c.batch for c in candidates}
  for i in range(warmup + repeats):
    order = names[i % len(names) :] + names[: i % len(names)]
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


def abstract_inputs(candidate: Candidate, sharding=None) -> tuple:
  """``candidate``'s step arguments (params, optimizer state, batch) as
  shapes and dtypes, placed by ``sharding`` (None: JAX's default).
  """
  return jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
    (candidate.params, candidate.opt_state, *candidate.batch),
  )


def compiled_figures(compiled) -> dict:
  """What compilation alone tells of a step: XLA's FLOPs, bytes accessed and
  peak memory, and the optimized HLO's operation counts (:func:`hlo_counts`).
  """
  return {
    "flops": _flops(compiled),
    "bytes_accessed": float(_cost(compiled)["bytes accessed"]),
    "peak_bytes": _peak_bytes(compiled),
    "hlo": hlo_counts(compiled.as_text()),
  }


def write_hlo(folder: str, method: str, compiled) -> None:
  """Writes ``compiled``'s optimized HLO to ``folder/METHOD.hlo.txt``."""
  os.makedirs(folder, exist_ok=True)
  name = re.sub(r"[^A-Za-z0-9.]+", "_", method).strip("_")
  with open(os.path.join(folder, f"{name}.hlo.txt"), "w") as f:
    f.write(compiled.as_text())


def measure_alone(
  candidates: list[Candidate],
  *,
  warmup: int,
  repeats: int,
  hlo_dir: str | None = None,
  profile: bool = False,
) -> dict[str, dict]:
  """Figures for each candidate, one at a time; absolute values.

  Besides :func:`measure`'s figures: bytes accessed, counts of operations
  in the optimized HLO (:func:`hlo_counts`), and with ``profile`` the
  device's time per step and by kind of operation over ``repeats`` more
  steps, from a ``jax.profiler`` trace (:func:`device_ops`). With
  ``hlo_dir`` the optimized HLO of each step is written there.
  """
  out = {}
  for c in candidates:
    jitted = jax.jit(c.step, donate_argnums=(0, 1))
    shapes = abstract_inputs(c)
    start = time.perf_counter()
    compiled = jitted.lower(*shapes).compile()
    figures = {
      "compile_seconds": time.perf_counter() - start,
      **compiled_figures(compiled),
    }
    if hlo_dir is not None:
      write_hlo(hlo_dir, c.name, compiled)
    state = jax.device_put((c.params, c.opt_state))
    times = []
    for i in range(warmup + repeats):
      start = time.perf_counter()
      *state, loss = compiled(*state, *c.batch)
      jax.block_until_ready((state, loss))
      if i >= warmup:
        times.append(time.perf_counter() - start)
    figures["step_seconds"] = times
    figures["median_step_seconds"] = float(np.median(times))
    if profile:
      try:
        figures["device_ops"], state = device_ops(
          compiled, state, c.batch, repeats
        )
        steps = [
          v["total_us"]
          for k, v in figures["device_ops"].items()
          if k.endswith("| Steps")
        ]
        if steps:  # The device's own time per step (a TPU's "Steps" line).
          figures["device_step_seconds"] = steps[0] / 1e6
      except Exception as e:
        figures["device_ops"] = {"error": f"{type(e).__name__}: {e}"}
        state = []  # Lost in the failed trace: freed with it.
    jax.tree.map(lambda a: a.delete(), state)  # Before the next method's.
    del compiled
    out[c.name] = figures
  return out


_COUNTED = (
  "conditional",
  "while",
  "fusion",
  "transpose",
  "copy",
  "convolution",
  "dot",
  "select",
  "all-reduce",
  "custom-call",
)


def _opcode(line: str) -> str | None:
  """The operation of one HLO instruction line (``%x = TYPE op(...)``)."""
  if " = " not in line:
    return None
  rest = line.split(" = ", 1)[1]
  if rest.startswith("("):  # A tuple type: skip to its closing parenthesis.
    depth = 0
    for i, ch in enumerate(rest):
      depth += {"(": 1, ")": -1}.get(ch, 0)
      if depth == 0:
        rest = rest[i + 1 :]
        break
  else:
    rest = rest.split(" ", 1)[1] if " " in rest else ""
  m = re.match(r"\s*([a-z][a-z0-9-]*)\(", rest)
  return m.group(1) if m else None


def hlo_counts(text: str) -> dict[str, int]:
  """How many of some operations an optimized HLO module holds.

  Counted in every computation, fused ones included (a transpose inside a
  fusion counts), except ``fusion``, which counts the fused kernels: the
  fusion instructions of the unfused computations.
  """
  counts = collections.Counter()
  fused = False
  for line in text.splitlines():
    if line and not line.startswith(" "):  # A computation's header.
      fused = "fused" in line.split("(")[0]
      continue
    op = _opcode(line)
    if op in _COUNTED and not (op == "fusion" and fused):
      counts[op] += 1
  return {op: counts.get(op, 0) for op in _COUNTED}


def device_ops(compiled, state, batch, steps: int):
  """Device time by kind of operation over ``steps`` steps, from a trace.

  Returns the times and the state after those steps.

  Sums the durations of the events on each device plane's lines (on a TPU
  the line "XLA Ops" holds one event per HLO operation run), in
  microseconds per step: each line's total and its operations summed by
  kind (:func:`by_kind`). Single operations are left to the trace itself
  (their names are whole HLO instructions: a results file of them ran to
  a megabyte). On a CPU the events are the host threads' (no device time).
  """
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder):
      for _ in range(steps):
        *state, loss = compiled(*state, *batch)
      jax.block_until_ready((state, loss))
    (path,) = glob.glob(
      os.path.join(folder, "**", "*.xplane.pb"), recursive=True
    )
    data = jax.profiler.ProfileData.from_file(path)
    lines = {}
    for plane in data.planes:
      if not plane.name.startswith("/device:"):
        continue
      for line in plane.lines:
        total = collections.Counter()
        for event in line.events:
          name = event.name.split(", metadata=")[0]  # The instruction.
          total[name] += event.duration_ns / 1e3 / steps
        lines[f"{plane.name} | {line.name}"] = {
          "total_us": sum(total.values()),
          "ops": len(total),
          "by_kind_us": by_kind(total),
        }
  return lines, state


def by_kind(times: dict[str, float]) -> dict[str, float]:
  """Times of profiler events summed by HLO operation (fusions by kind).

  A TPU's per-op events are named by their HLO instruction
  (``%fusion.3 = f32[...] fusion(...), kind=kOutput, ...``): a fusion
  counts as ``fusion:kOutput``, any other instruction as its operation,
  and an event that is no instruction under its own name.
  """
  out = collections.Counter()
  for name, t in times.items():
    op = _opcode(name.split(", metadata=")[0])
    if op == "fusion":
      kind = re.search(r"kind=(k[A-Za-z]+)", name)
      op = f"fusion:{kind.group(1)}" if kind else op
    out[op or name] += t
  return dict(out.most_common())


def flops(candidates: list[Candidate]) -> dict[str, float]:
  """Each candidate's FLOPs, compiled only (for a loop-free twin of a model:
  XLA's cost analysis counts a loop's body once, whatever its trip count).
  """
  return {
    c.name: _flops(
      jax.jit(c.step, donate_argnums=(0, 1))
      .lower(c.params, c.opt_state, *c.batch)
      .compile()
    )
    for c in candidates
  }


def ratios(
  figures: dict[str, dict],
  baseline: str = "plain",
  keys=("flops", "peak_bytes", "median_step_seconds", "compile_seconds"),
) -> dict:
  """Each candidate's figures divided by the baseline's, same run."""
  base = figures[baseline]
  return {
    name: {key: f[key] / base[key] for key in keys}
    for name, f in figures.items()
  }
