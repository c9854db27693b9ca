"""What a run means: summaries, the sanity check, tables, JSON and a plot.

Definitions, printed under every table:

* *smoothed loss*: the mean training-batch loss over a trailing window of
  a tenth of the run's steps;
* *target*: unless ``--target`` is given, the highest of the methods'
  final smoothed losses (runs that diverged left out): a loss that every
  method reaches, at its last step at the latest; "steps to target" asks
  how soon each gets there;
* *seconds*: the sum of the method's own step times, compilation excluded;
* *step time ratio*: the method's median step time over plain's median, in
  the same interleaved run;
* *sanity check*: ``current`` must reproduce plain training; it passes if
  the per-step losses agree to a relative 1e-4 over the first 20 steps,
  before float rounding (the two programs fuse differently) has been
  amplified by training, and the largest difference over the whole run is
  reported beside it.
"""

import json
import math
import os
import platform
from typing import Any, Optional

import haiku
import jax
import numpy as np
import optax

import immgrad
from immgrad.experiments import train as train_lib

SANITY_STEPS, SANITY_RTOL = 20, 1e-4


def smoothed(losses: list, window: int) -> np.ndarray:
  x = np.asarray(losses, np.float64)
  if not len(x):
    return x
  cumulative = np.cumsum(np.insert(x, 0, 0.0))
  index = np.arange(1, len(x) + 1)
  start = np.maximum(index - window, 0)
  return (cumulative[index] - cumulative[start]) / (index - start)


def window_of(steps: int) -> int:
  return max(1, steps // 10)


def default_target(runs: dict, steps: int) -> Optional[float]:
  finals = [float(smoothed(run.losses, window_of(steps))[-1])
            for run in runs.values()
            if run.diverged_at is None and run.losses]
  return max(finals) if finals else None


def summarise(run, plain, steps: int, target: Optional[float]) -> dict:
  """The figures of one method in one run."""
  curve = smoothed(run.losses, window_of(steps))
  out = {"diverged_at": run.diverged_at,
         "compile_seconds": run.compile_seconds,
         "final_smoothed_train_loss": float(curve[-1]) if len(curve) else None,
         "median_step_seconds": float(np.median(run.seconds))
                                if run.seconds else None}
  if out["median_step_seconds"] and plain.seconds:
    out["step_time_ratio"] = out["median_step_seconds"] / float(
        np.median(plain.seconds))
  for key in run.evals[-1] if run.evals else {}:
    if key == "step":
      continue
    values = [e[key] for e in run.evals]
    out[f"final_{key}"] = values[-1]
    best = max if key.endswith("accuracy") else min
    out[f"best_{key}"] = best(values)
  out["steps_to_target"] = out["seconds_to_target"] = None
  if target is not None and len(curve):
    reached = np.nonzero(curve <= target)[0]
    if len(reached):
      out["steps_to_target"] = int(reached[0]) + 1
      out["seconds_to_target"] = float(np.sum(run.seconds[:reached[0] + 1]))
  return out


def sanity(runs: dict) -> dict:
  """How closely ``current`` tracks ``plain``."""
  a = np.asarray(runs["current"].losses, np.float64)
  b = np.asarray(runs["plain"].losses, np.float64)
  n = min(len(a), len(b))
  rel = np.abs(a[:n] - b[:n]) / np.maximum(np.abs(b[:n]), 1e-30)
  early = float(np.max(rel[:SANITY_STEPS])) if n else math.inf
  return {
      "max_relative_loss_difference_first_steps": early,
      "first_steps": min(n, SANITY_STEPS),
      "max_relative_loss_difference_whole_run":
          float(np.max(rel)) if n else math.inf,
      "max_final_parameter_difference": train_lib.max_param_difference(
          runs["current"].final_params, runs["plain"].final_params),
      "passed": bool(early <= SANITY_RTOL),
  }


def aggregate(summaries: list[dict]) -> dict:
  """Mean, spread and range of each figure over seeds (per method)."""
  out = {}
  for key in summaries[0]:
    values = [s[key] for s in summaries if s.get(key) is not None]
    if key == "diverged_at":
      out["diverged_runs"] = len(values)
      out["diverged_at"] = values
      continue
    if not values or not all(isinstance(v, (int, float)) for v in values):
      out[key] = None
      continue
    out[key] = {"mean": float(np.mean(values)),
                "std": float(np.std(values, ddof=1)) if len(values) > 1
                       else 0.0,
                "min": float(np.min(values)), "max": float(np.max(values)),
                "n": len(values), "of": len(summaries)}
  return out


def _cell(figure: Any, digits: int = 3) -> str:
  if figure is None:
    return "-"
  if isinstance(figure, dict):
    mean = _cell(figure["mean"], digits)
    if figure["of"] > 1:
      mean += f" ± {figure['std']:.2g}"
      if figure["n"] < figure["of"]:
        mean += f" ({figure['n']}/{figure['of']})"
    return mean
  if isinstance(figure, float):
    return f"{figure:.{digits}g}"
  return str(figure)


def table(aggregates: dict, unit: str) -> str:
  """Markdown table, one row per method."""
  has_accuracy = any("final_heldout_accuracy" in a for a in aggregates.values())
  columns = [
      ("final train", "final_train_loss"),
      ("best train", "best_train_loss"),
      ("final held-out", "final_heldout_loss"),
      ("best held-out", "best_heldout_loss"),
  ]
  if has_accuracy:
    columns.append(("held-out accuracy", "final_heldout_accuracy"))
  columns += [
      ("steps to target", "steps_to_target"),
      ("seconds to target", "seconds_to_target"),
      ("step time / plain", "step_time_ratio"),
  ]
  head = "| method | " + " | ".join(c for c, _ in columns) + " | diverged |"
  rule = "|" + " --- |" * (len(columns) + 2)
  rows = [head, rule]
  for method, agg in aggregates.items():
    cells = [_cell(agg.get(key)) for _, key in columns]
    diverged = agg.get("diverged_at") or []
    cells.append(", ".join(f"step {s}" for s in diverged) or "no")
    rows.append(f"| {method} | " + " | ".join(cells) + " |")
  return "\n".join(rows) + f"\n\nLosses in {unit}."


def machine() -> dict:
  return {"platform": platform.platform(), "processor": platform.processor(),
          "cpu_count": os.cpu_count(), "python": platform.python_version(),
          "devices": [str(d) for d in jax.devices()],
          "jax": jax.__version__, "optax": optax.__version__,
          "haiku": haiku.__version__, "immgrad": immgrad.__version__}


def write_json(path: str, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=float)


def plot(path: str, records: list[dict], steps: int, unit: str,
         title: str) -> None:
  """Smoothed train loss against step and against wall seconds."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  colors = {"plain": "tab:gray", "current": "tab:blue",
            "updated": "tab:red"}
  fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
  labelled = set()
  for record in records:
    method = record["method"]
    curve = smoothed(record["losses"], window_of(steps))
    if not len(curve):
      continue
    label = None if method in labelled else method
    labelled.add(method)
    style = dict(color=colors[method], alpha=0.85, lw=1.4, label=label,
                 ls="--" if method == "current" else "-")
    by_step.plot(np.arange(1, len(curve) + 1), curve, **style)
    by_time.plot(np.cumsum(record["seconds"]), curve, **style)
  for ax, xlabel in ((by_step, "step"), (by_time, "wall seconds (steps only)")):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"train loss, smoothed ({unit})")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
