"""What a run means: summaries, the sanity check, tables, JSON and a plot.

The terms of its tables are defined in ``DEFINITIONS``, printed under them.
"""

import gzip
import hashlib
import json
import math
import os
import pathlib
import platform
import re
from typing import Any

import haiku
import jax
import numpy as np
import optax

import immgrad
from immgrad.experiments import stats
from immgrad.experiments import train as train_lib

# Printed under every table of a run.
DEFINITIONS = """Definitions, printed under every table:

* *smoothed loss*: the mean training-batch loss over a trailing window of
  a tenth of the run's steps;
* *target*: unless ``--target`` is given, the highest of the methods'
  final smoothed losses (runs that diverged left out): a loss that every
  method reaches, at its last step at the latest; "steps to target" asks
  how soon each gets there;
* *seconds*: the sum of the method's own step times, compilation excluded;
* *step time ratio*: the method's median step time over plain's median, in
  the same interleaved run (for runs joined with ``--merge``, plain's from
  its own run, at the same lr and seed);
* *sanity check*: ``current`` (``a=0`` in a mode sweep) must reproduce
  plain training; it passes if the per-step losses agree to a relative
  1e-4 over the first 20 steps, before float rounding (the two programs
  fuse differently) has been amplified by training, and the largest
  difference over the whole run is reported beside it;
* *a* (mode sweep): dX is computed at ``W + a * (W_new - W)``: ``a=0`` is
  ``current`` (ordinary training), ``a=1`` is ``updated``;
* *beats a=0* (mode sweep): no seed diverged, and the 95% t interval of
  the paired difference, each seed's a=0 loss minus the method's (same
  initialisation and batches), ``mean ± t(0.975, n - 1) x sd / sqrt(n)``
  over the n seeds, lies above 0; *worse*: it lies below 0; *no
  difference shown*: it contains 0; one seed: no interval, no verdict. A
  method that diverged on no seed beats an a=0 that diverged on one;
* *steps behind plain*: at each fifth of the run (step t), how many steps
  later than plain the method's smoothed loss first reaches plain's
  smoothed loss at t, to a relative 1e-4 (the sanity check's tolerance:
  ``current`` drifts from plain by rounding); negative: sooner, ahead of
  plain; "never" if a seed does not reach it within the run; mean over
  seeds;
* *dX change* (``--measure-dx``): per immediate layer and step,
  ``|dX_updated - dX_current| / |dX_current|``, the layer's input gradient
  from its new weights against that from its old ones, measured on the
  method's own trajectory whatever its a (norms over the whole batch).
"""

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


def default_target(runs: dict, steps: int) -> float | None:
  finals = [
    float(smoothed(run.losses, window_of(steps))[-1])
    for run in runs.values()
    if run.diverged_at is None and run.losses
  ]
  return max(finals) if finals else None


def summarise(run, plain, steps: int, target: float | None) -> dict:
  """The figures of one method in one run (``plain``: None if not run)."""
  curve = smoothed(run.losses, window_of(steps))
  out = {
    "diverged_at": run.diverged_at,
    "compile_seconds": run.compile_seconds,
    "final_smoothed_train_loss": float(curve[-1]) if len(curve) else None,
    "median_step_seconds": float(np.median(run.seconds))
    if run.seconds
    else None,
  }
  if out["median_step_seconds"] and plain is not None and plain.seconds:
    out["step_time_ratio"] = out["median_step_seconds"] / float(
      np.median(plain.seconds)
    )
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
      out["seconds_to_target"] = float(np.sum(run.seconds[: reached[0] + 1]))
  return out


LAG_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)


def lag_steps(steps: int) -> list[int]:
  """The steps (counted from 1) at which "steps behind plain" is read."""
  return sorted({max(1, round(f * steps)) for f in LAG_FRACTIONS})


def steps_behind(losses, reference, steps: int) -> list[int | None]:
  """At each of ``lag_steps(steps)`` (step t): how many steps later than
  the smoothed ``reference`` the smoothed ``losses`` first reach the
  reference's value at t, to a relative ``SANITY_RTOL`` (negative if
  sooner; 0 for the same curve, however it wiggles, and for one that
  differs by rounding); None if they never do within the run.

  >>> steps_behind([4.0, 3.0, 2.0, 1.0, 0.5], [3.0, 2.0, 1.0, 0.0, 0.0], 5)
  [1, 1, 1, None, None]
  """
  window = window_of(steps)
  curve, ref = smoothed(losses, window), smoothed(reference, window)
  out = []
  for t in lag_steps(steps):
    if t > len(ref) or not np.isfinite(ref[t - 1]):
      out.append(None)
      continue
    level = ref[t - 1] + SANITY_RTOL * abs(ref[t - 1])
    first = int(np.argmax(ref <= level))  # Plain's own first time.
    reached = np.nonzero(curve <= level)[0]
    out.append(int(reached[0]) - first if len(reached) else None)
  return out


def lag_table(lags: dict, steps: int) -> str:
  """Markdown table of "steps behind plain", one row per method;
  ``lags``: method -> one ``steps_behind`` list per seed.
  """
  at = lag_steps(steps)
  head = "| method | " + " | ".join(f"at step {t:,}" for t in at) + " |"
  rows = [
    "Steps behind plain (see below):",
    "",
    head,
    "|" + " --- |" * (len(at) + 1),
  ]
  for method, per_seed in lags.items():
    cells = []
    for values in zip(*per_seed):
      if any(v is None for v in values):
        cells.append("never")
      else:
        cells.append(f"{np.mean(values):.0f}")
    rows.append(f"| {method} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def reference_method(methods) -> str:
  """The immgrad method that must reproduce plain training."""
  return "current" if "current" in methods else "a=0"


def sanity(runs: dict) -> dict:
  """How closely ``current`` (or ``a=0``) tracks ``plain``."""
  reference = reference_method(runs)
  a = np.asarray(runs[reference].losses, np.float64)
  b = np.asarray(runs["plain"].losses, np.float64)
  n = min(len(a), len(b))
  rel = np.abs(a[:n] - b[:n]) / np.maximum(np.abs(b[:n]), 1e-30)
  early = float(np.max(rel[:SANITY_STEPS])) if n else math.inf
  return {
    "max_relative_loss_difference_first_steps": early,
    "first_steps": min(n, SANITY_STEPS),
    "max_relative_loss_difference_whole_run": float(np.max(rel))
    if n
    else math.inf,
    # Not kept in results.json: None for runs --merge read back.
    "max_final_parameter_difference": train_lib.max_param_difference(
      runs[reference].final_params, runs["plain"].final_params
    )
    if runs["plain"].final_params is not None
    else None,
    "reference": reference,
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
    out[key] = {
      "mean": float(np.mean(values)),
      "std": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
      "min": float(np.min(values)),
      "max": float(np.max(values)),
      "n": len(values),
      "of": len(summaries),
    }
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
  return {
    "platform": platform.platform(),
    "processor": platform.processor(),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    "devices": [str(d) for d in jax.devices()],
    "jax": jax.__version__,
    "optax": optax.__version__,
    "haiku": haiku.__version__,
    "immgrad": immgrad.__version__,
    "immgrad_source_sha256": source_sha256(),
  }


def source_sha256(root: str | None = None) -> str:
  """The sha256 of a package's Python source (``root``, by default
  immgrad's): each ``.py`` file's path under it and its bytes, in path
  order. It names the code a run ran, which the version does not: one
  version covers every commit, and a source tree that is not installed,
  as on the chip, reads "0+unknown".

  >>> import tempfile
  >>> with tempfile.TemporaryDirectory() as d:
  ...   _ = pathlib.Path(d, "a.py").write_text("x = 1")
  ...   before = source_sha256(d)
  ...   _ = pathlib.Path(d, "a.py").write_text("x = 2")
  ...   before != source_sha256(d)
  True
  """
  top = pathlib.Path(root or immgrad.__file__).resolve()
  top = top if top.is_dir() else top.parent
  digest = hashlib.sha256()
  for path in sorted(top.rglob("*.py")):
    name = path.relative_to(top).as_posix().encode()
    digest.update(name + b"\0" + path.read_bytes() + b"\0")
  return digest.hexdigest()


# Significant digits kept of each step's loss, time and dX change: the
# reports print at most 4 (of a mean over many steps).
LOSS_DIGITS, SECONDS_DIGITS, DX_DIGITS = 5, 5, 4


def _rounded(values: list, digits: int) -> list:
  return [float(f"{v:.{digits}g}") for v in values]


def rounded_run(record: dict) -> dict:
  """A ``runs`` entry of results.json with its per-step figures rounded
  to ``LOSS_DIGITS``, ``SECONDS_DIGITS`` and ``DX_DIGITS`` significant
  digits (the evaluations, a few a run, and the summaries keep theirs).

  >>> rounded_run({"losses": [2.718281828], "seconds": [0.0261234567]})
  {'losses': [2.7183], 'seconds': [0.026123]}
  """
  out: dict[str, Any] = dict(
    record,
    losses=_rounded(record["losses"], LOSS_DIGITS),
    seconds=_rounded(record["seconds"], SECONDS_DIGITS),
  )
  if record.get("dx_change") is not None:
    out["dx_change"] = {
      k: _rounded(v, DX_DIGITS) for k, v in record["dx_change"].items()
    }
  return out


def write_json(path: str, payload: dict) -> None:
  """``payload`` as JSON, each list of numbers on one line; gzip-compressed
  (and the same bytes for the same payload) where ``path`` ends in .gz.
  """
  text = json.dumps(payload, indent=1, default=float)
  text = re.sub(
    r"\[\s+([^\[\]{}\"]*?)\s+\]",
    lambda m: "[" + re.sub(r",\s+", ",", m.group(1)) + "]",
    text,
  )
  if path.endswith(".gz"):  # No name or time in the header: same bytes.
    with open(path, "wb") as f:
      with gzip.GzipFile("", "wb", fileobj=f, mtime=0) as z:
        z.write(text.encode())
  else:
    with open(path, "w") as f:
      f.write(text)


def read_json(path: str) -> dict:
  """What :func:`write_json` wrote (gzip-compressed or not)."""
  with (gzip.open if str(path).endswith(".gz") else open)(path, "rt") as f:
    return json.load(f)


def plot(
  path: str, records: list[dict], steps: int, unit: str, title: str
) -> None:
  """Smoothed train loss against step and against wall seconds, on the
  axis `loss_axis` gives for the runs that did not diverge (those that did
  run off its top).
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  colors = _colors([r["method"] for r in records])
  fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2))
  labelled, span = set(), []
  for record in records:
    method = record["method"]
    curve = smoothed(record["losses"], window_of(steps))
    if not len(curve):
      continue
    if record["summary"]["diverged_at"] is None:
      span += [np.min(curve), np.max(curve)]
    label = None if method in labelled else method
    labelled.add(method)
    style = dict(
      color=colors[method],
      alpha=0.85,
      lw=1.4,
      label=label,
      ls="--" if method in ("current", "a=0") else "-",
    )
    by_step.plot(np.arange(1, len(curve) + 1), curve, **style)
    by_time.plot(np.cumsum(record["seconds"]), curve, **style)
  for ax, xlabel in ((by_step, "step"), (by_time, "wall seconds (steps only)")):
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"train loss, smoothed ({unit})")
    if span and np.all(np.isfinite(span)):
      scale, limits = loss_axis(min(span), max(span))
      ax.set_yscale(scale)
      ax.set_ylim(*limits)
    ax.grid(True, alpha=0.3)
    ax.legend()
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def loss_axis(low: float, high: float) -> tuple[str, tuple[float, float]]:
  """The y axis for losses from `low` to `high`: linear with a 3% margin,
  or logarithmic where they span more than two decades (a classifier's
  loss falling towards 0, whose end a linear axis would flatten).

  >>> loss_axis(1.4, 8.0)[0], [round(v, 3) for v in loss_axis(1.4, 8.0)[1]]
  ('linear', [1.202, 8.198])
  >>> loss_axis(1e-6, 2.4)
  ('log', (5e-07, 4.8))
  """
  if low > 0 and high / low > 100:
    return "log", (low / 2, high * 2)
  margin = 0.03 * (high - low) or 0.03 * abs(high) or 1.0
  return "linear", (low - margin, high + margin)


def _colors(methods) -> dict:
  fixed = {
    "plain": "tab:gray",
    "current": "tab:blue",
    "updated": "tab:red",
    "a=0": "tab:blue",
    "a=1": "tab:red",
  }
  others = iter(
    [
      "tab:orange",
      "tab:green",
      "tab:purple",
      "tab:brown",
      "tab:pink",
      "tab:olive",
      "tab:cyan",
      "black",
    ]
    * 4
  )
  out = {}
  for m in dict.fromkeys(methods):
    out[m] = fixed.get(m) or next(others)
  return out


# -- mode sweep: which a, and does any beat a=0 ---------------------------

MODE_KEYS = (
  ("final smoothed train", "final_smoothed_train_loss"),
  ("final held-out", "final_heldout_loss"),
)


def compare_modes(
  per_method: dict,
  baseline: str = "a=0",
  key: str = "final_smoothed_train_loss",
) -> dict:
  """Each method's ``key`` over seeds, against ``baseline`` (paired).

  ``per_method``: method -> summaries, in the same seed order for all.
  """
  base = [s.get(key) for s in per_method[baseline]]
  base_diverged = any(
    s["diverged_at"] is not None for s in per_method[baseline]
  )
  out = {}
  for method, summaries in per_method.items():
    values = [s.get(key) for s in summaries]
    diverged = [
      s["diverged_at"] for s in summaries if s["diverged_at"] is not None
    ]
    finite = [v for v in values if v is not None and math.isfinite(v)]
    row = {
      "values": values,
      "diverged_at": diverged,
      "n": len(finite),
      "of": len(values),
    }
    if finite and not diverged:
      row.update(
        mean=float(np.mean(finite)),
        min=float(np.min(finite)),
        max=float(np.max(finite)),
        std=float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0,
      )
    if method != baseline and not diverged and base_diverged:
      # a=0 diverged on some seed and this method on none: better, though
      # not by a loss difference.
      row.update(verdict="beats", baseline_diverged=True)
    elif (
      method != baseline
      and not diverged
      and len(finite) == len(base)
      and all(v is not None and math.isfinite(v) for v in base)
    ):
      d = stats.paired(base, values)  # a=0 minus the method, per seed.
      row.update(
        paired_difference=d["mean"],
        low=d["low"],
        high=d["high"],
        verdict=_verdict(d),
      )
    out[method] = row
  return out


def _verdict(d: dict) -> str | None:
  """The mode sweep's verdict on :func:`stats.paired`'s a=0 minus method."""
  if d["low"] is None:  # One seed: no interval.
    return None
  if d["low"] > 0:
    return "beats"
  return "worse" if d["high"] < 0 else "no difference shown"


def best_mode(comparison: dict) -> str | None:
  """The immgrad method (not plain) with the lowest mean, none diverged."""
  ok = {
    m: r["mean"] for m, r in comparison.items() if m != "plain" and "mean" in r
  }
  return min(ok, key=ok.__getitem__) if ok else None


def _value(row: dict) -> str:
  if "mean" not in row:
    if row["diverged_at"]:
      return "diverged at step " + ", ".join(str(s) for s in row["diverged_at"])
    return "-"
  cell = f"{row['mean']:.4g}"
  if row["of"] > 1:
    cell += f" ± {row['std']:.2g} [{row['min']:.4g}, {row['max']:.4g}]"
  return cell


def _difference_cell(row: dict) -> str:
  if row.get("baseline_diverged"):
    return "a=0 diverged, this did not: **beats**"
  if "paired_difference" not in row:
    return "-"
  cell = f"{row['paired_difference']:+.2g}"
  if row["low"] is not None:
    cell += f" [{row['low']:+.2g}, {row['high']:+.2g}]"
  if row["verdict"] == "beats":
    cell += " **beats**"
  elif row["verdict"] is not None:
    cell += f" {row['verdict']}"
  return cell


def mode_table(per_method: dict, unit: str, title: str) -> tuple[str, dict]:
  """The mode sweep's table and verdicts for one set of runs."""
  comparisons = {
    key: compare_modes(per_method, key=key) for _, key in MODE_KEYS
  }
  rows = [
    title,
    "",
    "| method | final smoothed train (mean ± std [min, max]) | "
    "a=0 minus it (paired, mean [95% t interval]) | final held-out | "
    "a=0 minus it |",
    "|" + " --- |" * 5,
  ]
  train_c = comparisons["final_smoothed_train_loss"]
  held_c = comparisons["final_heldout_loss"]
  for method in per_method:
    rows.append(
      f"| {method} | {_value(train_c[method])} | "
      f"{_difference_cell(train_c[method])} | "
      f"{_value(held_c[method])} | "
      f"{_difference_cell(held_c[method])} |"
    )
  rows += [
    "",
    f"Losses in {unit}; 'beats'/'worse': the 95% t interval of a=0 "
    "minus the method lies above/below 0 (the rule below).",
  ]
  verdict = {}
  for label, key in MODE_KEYS:
    c = comparisons[key]
    best = best_mode(c)
    winners = [
      m
      for m, r in c.items()
      if m not in ("plain", "a=0") and r.get("verdict") == "beats"
    ]
    verdict[key] = {
      "best": best,
      "best_mean": c[best]["mean"] if best else None,
      "best_spread": [c[best]["min"], c[best]["max"]] if best else None,
      "beat_a0": winners,
    }
    if best is None:
      line = f"- {label}: every a diverged on some seed"
    else:
      line = f"- {label}: best {best} ({_value(c[best])}); " + (
        f"beating a=0 (95% t interval above 0): {', '.join(winners)}"
        if winners
        else "no nonzero a beats a=0 (95% t interval above 0)"
      )
    rows.append(line)
  return "\n".join(rows), {"comparisons": comparisons, "verdict": verdict}


# -- dX change: how large the second-order term is ------------------------


def natural_key(name: str):
  """Sorts ``linear_2`` before ``linear_10`` (Haiku's creation order)."""
  return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def dx_summary(dx_change: dict, diverged_at: int | None, last: int = 5) -> dict:
  """A run's dX change in a few figures (over its finite measurements).

  * ``first``: the largest layer's ratio at step 1;
  * ``median``: the largest, over layers, of the layer's median over steps;
  * ``median_sum``: the median over steps of the sum over layers (what
    compounds through the depth);
  * ``end``: the largest ratio in the last ``last`` steps measured (before
    the divergence, for a run that diverged);
  * ``argmax_layer``: the layer with the largest median.
  """
  names = sorted(dx_change, key=natural_key)
  if not names:
    return {}
  x = np.asarray([dx_change[n] for n in names], np.float64)  # layers, steps
  steps = x.shape[1]
  if diverged_at is not None:  # The diverging step's own measurement too.
    steps = min(steps, diverged_at - 1)
  x = x[:, : max(steps, 1)]
  x = np.where(np.isfinite(x), x, np.nan)
  with np.errstate(all="ignore"):
    med = np.nanmedian(x, axis=1)
    out = {
      "first": float(np.nanmax(x[:, 0])),
      "median": float(np.nanmax(med)),
      "median_sum": float(np.nanmedian(np.nansum(x, axis=0))),
      "end": float(np.nanmax(x[:, -last:])),
      "argmax_layer": names[int(np.nanargmax(med))],
    }
  return out


def dx_table(rows: list[dict]) -> str:
  """``rows``: dicts with lr, method, seeds' dx summaries and divergences."""
  out = [
    "dX change |dX_updated - dX_current| / |dX_current| (see below), "
    "mean over seeds:",
    "",
    "| lr | method | diverged at | at step 1 (max layer) | median over "
    "steps (max layer) | sum over layers (median step) | last 5 steps "
    "before the end or divergence (max) | layer of the largest median |",
    "|" + " --- |" * 8,
  ]
  for r in rows:
    s = r["summaries"]
    mean = lambda k, s=s: (
      f"{np.mean([x[k] for x in s if x]):.3g}" if any(s) else "-"
    )
    layers = sorted({x["argmax_layer"] for x in s if x})
    div = ", ".join(str(d) for d in r["diverged_at"]) or "no"
    out.append(
      f"| {r['lr']:g} | {r['method']} | {div} | {mean('first')} | "
      f"{mean('median')} | {mean('median_sum')} | {mean('end')} | "
      f"{', '.join(layers)} |"
    )
  return "\n".join(out)


def plot_dx(path: str, records: list[dict], title: str) -> None:
  """dX change against step, one line per layer, one panel per lr and a."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  records = [r for r in records if r.get("dx_change")]
  if not records:
    return
  seed = min(r["seed"] for r in records)
  records = [r for r in records if r["seed"] == seed]
  lrs = sorted({r["lr"] for r in records})
  methods = list(dict.fromkeys(r["method"] for r in records))
  fig, axes = plt.subplots(
    len(lrs),
    len(methods),
    squeeze=False,
    sharex=True,
    sharey=True,
    # At least the title's width: one panel alone would cut it.
    figsize=(max(6.5, 3.6 * len(methods) + 0.6), 2.6 * len(lrs) + 0.8),
  )
  cmap = plt.get_cmap("viridis")
  for r in records:
    ax = axes[lrs.index(r["lr"])][methods.index(r["method"])]
    names = sorted(r["dx_change"], key=natural_key)
    for i, name in enumerate(names):
      y = np.asarray(r["dx_change"][name], np.float64)
      y = np.where(np.isfinite(y) & (y > 0), y, np.nan)
      ax.plot(
        np.arange(1, len(y) + 1),
        y,
        lw=0.8,
        alpha=0.8,
        color=cmap(i / max(1, len(names) - 1)),
        label=name if len(names) <= 8 else None,
      )
    div = r["summary"]["diverged_at"]
    if div is not None:
      ax.axvline(div, color="red", ls="--", lw=1.2)
      ax.text(
        div,
        1.0,
        f" diverged {div}",
        color="red",
        fontsize=7,
        transform=ax.get_xaxis_transform(),
        va="top",
      )
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"lr {r['lr']:g}, {r['method']}", fontsize=8)
    if len(names) <= 8 and ax is axes[0][0]:
      ax.legend(fontsize=6)
  for ax in axes[-1]:
    ax.set_xlabel("step")
  for row in axes:
    row[0].set_ylabel("|dX_upd - dX_cur| / |dX_cur|", fontsize=8)
  fig.suptitle(
    f"{title} (seed {seed}; colour: layer by creation order, "
    "dark first, yellow last)",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


# -- the study's figures: held-out loss with seed bands, against lr, steps --


def _pyplot():
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def heldout(record: dict) -> tuple[list, list]:
  """A run's held-out evaluations after step 0: steps, losses."""
  evals = [e for e in record["evals"] if e["step"] > 0 and "heldout_loss" in e]
  return [e["step"] for e in evals], [e["heldout_loss"] for e in evals]


def heldout_gaps(records: list[dict]) -> dict:
  """Each method's held-out loss minus plain's, paired by seed (the
  records of one column of :func:`plot_heldout`: one run a method and
  seed): method -> step -> the differences over the seeds where both were
  evaluated at that step (a run that diverged stops being evaluated).

  >>> runs = [
  ...   dict(seed=s, method=m, evals=[{"step": 10, "heldout_loss": v}])
  ...   for s, m, v in [(0, "plain", 2.0), (0, "a=1", 2.5), (1, "plain", 3.0),
  ...                   (1, "a=1", 2.75), (2, "a=1", 2.0)]
  ... ]
  >>> heldout_gaps(runs)  # Seed 2 has no plain to pair with.
  {'a=1': {10: [0.5, -0.25]}}
  """
  plain = {
    r["seed"]: dict(zip(*heldout(r))) for r in records if r["method"] == "plain"
  }
  out = {}
  for r in records:
    reference = plain.get(r["seed"])
    if r["method"] == "plain" or reference is None:
      continue
    by_step = out.setdefault(r["method"], {})
    for step, loss in zip(*heldout(r)):
      if step in reference:
        by_step.setdefault(step, []).append(loss - reference[step])
  return out


def _mean_and_band(ax, by_step: dict, label: str, color) -> None:
  """A line through the mean over seeds at each step, a band from the
  lowest to the highest seed.
  """
  x = sorted(by_step)
  values = [np.asarray(by_step[s], np.float64) for s in x]
  ax.plot(x, [v.mean() for v in values], label=label, lw=1.4, color=color)
  ax.fill_between(
    x,
    [v.min() for v in values],
    [v.max() for v in values],
    alpha=0.2,
    color=color,
  )


def plot_heldout(
  path: str, columns: dict[str, list[dict]], unit: str, title: str
) -> None:
  """Held-out loss against step, a column per entry of ``columns`` (its
  title -> its runs, one a method and seed: those at one lr, or each
  method at its own best lr): per method the mean over seeds (line) and
  the lowest to highest seed (band); where plain ran, a second row draws
  each method's loss minus plain's, paired by seed (:func:`heldout_gaps`),
  alike. Linear axes.
  """
  plt = _pyplot()
  every = [r for records in columns.values() for r in records]
  colors = _colors([r["method"] for r in every])
  gaps = {name: heldout_gaps(records) for name, records in columns.items()}
  rows = 2 if any(gaps.values()) else 1
  fig, axes = plt.subplots(
    rows,
    len(columns),
    squeeze=False,
    sharex="col",
    figsize=(max(6.5, 4.6 * len(columns) + 1), 4.3 + 3.2 * (rows - 1)),
  )
  for ax in axes[0][1:]:
    ax.sharey(axes[0][0])  # The losses on one scale; each gap on its own.
  for column, (name, records) in enumerate(columns.items()):
    ax = axes[0][column]
    for method in colors:
      by_step = {}
      for r in records:
        if r["method"] == method:
          for step, loss in zip(*heldout(r)):
            by_step.setdefault(step, []).append(loss)
      if by_step:
        _mean_and_band(ax, by_step, method, colors[method])
    ax.set_title(name, fontsize=9)
    if rows == 2:
      below = axes[1][column]
      for method, by_step in gaps[name].items():
        _mean_and_band(below, by_step, method, colors[method])
      below.axhline(0, color=colors.get("plain", "gray"), lw=0.8)
    for a in axes[:, column]:
      a.grid(True, alpha=0.3)
    axes[-1][column].set_xlabel("step")
  axes[0][0].set_ylabel(f"held-out loss ({unit})")
  axes[0][0].legend(fontsize=8)
  if rows == 2:
    axes[1][0].set_ylabel("method minus plain, same seed")
  fig.suptitle(
    f"{title}\nline: mean over seeds, band: lowest to highest seed", fontsize=9
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def train_curve(record: dict) -> tuple[np.ndarray, np.ndarray]:
  """Steps and smoothed training loss of one run (results.json ``runs``),
  averaged over a trailing tenth of its steps (:func:`smoothed`).

  >>> steps, curve = train_curve(dict(losses=[4.0] * 10 + [2.0] * 10))
  >>> int(steps[10]), float(curve[10]), float(curve[-1])  # window: 2 steps
  (11, 3.0, 2.0)
  """
  losses = record["losses"]
  return np.arange(1, len(losses) + 1), smoothed(losses, window_of(len(losses)))


def did_not_learn(records: list[dict], curve=train_curve) -> set:
  """``(method, lr)`` whose final loss (mean over seeds) is above the
  lowest loss any method had at that rate a fifth of the way into the run
  (mean over seeds): runs that stayed where the others had left early,
  not runs that learned less. ``curve(record)`` gives a run's steps and
  losses (:func:`train_curve`, :func:`heldout`); runs that diverged are
  left out.

  >>> def run(method, lr, losses):
  ...   return dict(method=method, lr=lr, losses=losses,
  ...               summary=dict(diverged_at=None))
  >>> stalled = run("a=1", 4e-3, [8.0] * 10 + [3.9] * 90)  # a plateau
  >>> trains = run("plain", 4e-3, [8.0] * 10 + [3.0] * 10 + [1.5] * 80)
  >>> near_0 = [run("plain", 1e-2, [2.3] * 10 + [0.1] * 10 + [1e-4] * 80),
  ...           run("a=1", 1e-2, [2.3] * 10 + [0.1] * 10 + [1.6e-4] * 80)]
  >>> did_not_learn([stalled, trains] + near_0)
  {('a=1', 0.004)}
  """
  early: dict = {}
  final: dict = {}
  for record in records:
    steps, values = curve(record)
    if record["summary"]["diverged_at"] is not None or not len(values):
      continue
    fifth = int(np.searchsorted(steps, steps[-1] / 5))
    key = (record["method"], record["lr"])
    early.setdefault(key, []).append(values[fifth])
    final.setdefault(key, []).append(values[-1])
  lowest: dict = {}
  for (_, lr), values in early.items():
    lowest[lr] = min(lowest.get(lr, np.inf), float(np.mean(values)))
  return {
    key for key, values in final.items() if np.mean(values) > lowest[key[1]]
  }


def plot_against_lr(
  path: str, points: dict, unit: str, title: str, off: set
) -> None:
  """Final held-out loss against learning rate, a line per method;
  ``points``: method -> (lr, mean, half width) (``stats.against_lr``).
  The ``(method, lr)`` in ``off``, runs that did not learn
  (:func:`did_not_learn`), are drawn at the top edge as triangles
  labelled with their value, so that they do not squash the others.
  """
  plt = _pyplot()
  colors = _colors(points)
  ends = [  # The tops of the bars drawn where they are.
    mean + half
    for method, rows in points.items()
    for lr, mean, half in rows
    if (method, lr) not in off
  ] or [0.0]
  top = max(ends) + 0.08 * (max(ends) - min(ends) or 1.0)
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for i, (method, rows) in enumerate(points.items()):
    if not rows:
      continue
    # Each method a little to the side, so that the bars do not cover.
    x = {lr: lr * 1.02 ** (i - len(points) / 2) for lr, _, _ in rows}
    lrs, means, halves = zip(*rows)
    ax.errorbar(
      [x[lr] for lr in lrs],
      [top if (method, lr) in off else m for lr, m in zip(lrs, means)],
      yerr=[0 if (method, lr) in off else h for lr, h in zip(lrs, halves)],
      marker="o",
      capsize=3,
      color=colors[method],
      label=method,
      ls="--" if method in ("current", "a=0") else "-",
    )
    for lr, mean in zip(lrs, means):
      if (method, lr) in off:
        ax.plot(x[lr], top, marker="^", ms=10, color=colors[method])
        ax.annotate(
          f"{mean:.2f}",
          (x[lr], top),
          textcoords="offset points",
          xytext=(0, -14 - 9 * i),
          ha="center",
          fontsize=7,
          color=colors[method],
        )
  if off:  # Room for the triangles.
    bottom = ax.get_ylim()[0]
    ax.set_ylim(bottom, top + 0.04 * (top - bottom))
  ax.set_xscale("log")
  rates = sorted({lr for rows in points.values() for lr, _, _ in rows})
  ax.set_xticks(rates, [f"{lr:g}" for lr in rates])
  ax.minorticks_off()
  ax.set_xlabel("peak learning rate")
  ax.set_ylabel(f"final held-out loss ({unit})")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title(
    f"{title}\nmean over seeds, bars: its 95% t interval", fontsize=9
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_steps_to_target(path: str, against: dict, title: str) -> None:
  """Steps to target, method minus plain (``stats.against_plain`` per lr):
  a dot per seed, the mean with its 95% t interval; a method that
  diverged, or a seed that never reached the target, is named, not drawn.
  """
  plt = _pyplot()
  lrs = [lr for lr in sorted(against) if against[lr]]
  fig, axes = plt.subplots(
    1,
    len(lrs),
    squeeze=False,
    sharey=True,
    figsize=(max(6.5, 3.6 * len(lrs) + 1), 4.3),
  )
  for ax, lr in zip(axes[0], lrs):
    methods = list(against[lr])
    colors = _colors(["plain", *methods])
    for i, method in enumerate(methods):
      row = against[lr][method]
      figure = row.get("steps_to_target", {})
      if "diverged" in row or not figure.get("n"):
        why = "diverged" if "diverged" in row else "never"
        ax.annotate(why, (i, 0), ha="center", fontsize=7, rotation=90)
        continue
      ax.plot(
        [i] * figure["n"],
        figure["differences"],
        "o",
        ms=4,
        alpha=0.6,
        color=colors[method],
      )
      if figure["low"] is not None:
        ax.errorbar(
          [i + 0.15],
          [figure["mean"]],
          yerr=[
            [figure["mean"] - figure["low"]],
            [figure["high"] - figure["mean"]],
          ],
          fmt="s",
          capsize=3,
          color=colors[method],
        )
      if figure["never"]:
        ax.annotate(
          f"never: seeds {figure['never']}", (i, figure["mean"]), fontsize=6
        )
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(range(len(methods)), methods, fontsize=8)
    ax.set_xlim(-0.6, len(methods) - 0.4)
    ax.set_title(f"lr {lr:g}", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
  axes[0][0].set_ylabel("steps to target, method minus plain")
  fig.suptitle(
    f"{title}\ndots: seeds; square and bar: their mean and its 95% t interval",
    fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
