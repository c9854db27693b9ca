"""Each method against plain, paired by seed, with 95% t intervals.

Seeds pair runs: the same seed starts every method from the same weights
and feeds it the same batches, so each seed's difference (method minus
plain) cancels what the seed alone decides. Over n seeds the mean
difference has the Student t interval ``mean ± t(0.975, n - 1) * sd /
sqrt(n)``.
"""

import math
from typing import Any, Sequence

import numpy as np

from immgrad.experiments import report

LEVEL = 0.95
# Summary key -> what the table calls it.
LOSSES = (
  ("final_smoothed_train_loss", "final smoothed train"),
  ("final_heldout_loss", "final held-out"),
  ("best_heldout_loss", "best held-out"),
)
TARGET_RULE = (
  "steps to target: on each seed, the first step at which the smoothed "
  "training loss is at or below the target, the higher of the method's "
  "and plain's final smoothed training losses on that seed (a loss both "
  "reach: positive, the method needs more steps to reach its own or "
  "plain's final loss than plain does)"
)


def t_cdf_two_sided(t: float, dof: int) -> float:
  """P(|T| <= t) for Student's t with ``dof`` (an integer) degrees of
  freedom: Abramowitz and Stegun 26.7.3 and 26.7.4, a finite sum.

  >>> round(t_cdf_two_sided(1.0, 1), 6)  # 2 atan(1) / pi.
  0.5
  """
  theta = math.atan(t / math.sqrt(dof))
  c2 = math.cos(theta) ** 2
  if dof % 2 == 0:
    term = total = 1.0
    for k in range(2, dof, 2):
      term *= (k - 1) / k * c2
      total += term
    return math.sin(theta) * total
  if dof == 1:
    return 2 * theta / math.pi
  term = total = math.cos(theta)
  for k in range(2, dof - 1, 2):
    term *= k / (k + 1) * c2
    total += term
  return 2 / math.pi * (theta + math.sin(theta) * total)


def t_quantile(q: float, dof: int) -> float:
  """The ``q`` quantile (``q`` > 0.5) of Student's t, by bisection.

  >>> round(t_quantile(0.975, 2), 4)  # 0.95 * sqrt(2 / (1 - 0.95**2)).
  4.3027
  """
  if not 0.5 < q < 1 or dof < 1:
    raise ValueError(
      f"t_quantile needs 0.5 < q < 1 and dof >= 1, got q={q}, dof={dof}."
    )
  want = 2 * q - 1
  low, high = 0.0, 1.0
  while t_cdf_two_sided(high, dof) < want:
    low, high = high, 2 * high
  for _ in range(100):
    mid = (low + high) / 2
    low, high = (mid, high) if t_cdf_two_sided(mid, dof) < want else (low, mid)
  return (low + high) / 2


def paired(method: Sequence, plain: Sequence) -> dict:
  """Per-seed differences ``method - plain``: mean and 95% t interval.

  >>> d = paired([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])  # Differences 1, 2, 3.
  >>> d["mean"], d["sd"], round(d["low"], 4), round(d["high"], 4)
  (2.0, 1.0, -0.4841, 4.4841)
  """
  d = np.asarray(method, np.float64) - np.asarray(plain, np.float64)
  out = {"differences": d.tolist(), "n": len(d), "mean": float(np.mean(d))}
  out["sd"] = out["low"] = out["high"] = None
  if len(d) > 1:
    sd = float(np.std(d, ddof=1))
    half = t_quantile(0.5 + LEVEL / 2, len(d) - 1) * sd / math.sqrt(len(d))
    out.update(sd=sd, low=out["mean"] - half, high=out["mean"] + half)
  return out


def first_step_at(losses: list, level: float, steps: int) -> int | None:
  """The first step (from 1) whose smoothed loss is <= ``level``; None if
  none is within the run.

  >>> first_step_at([4.0, 2.0, 2.0, 2.0], 2.5, 20)  # Window 2: 4, 3, 2, 2.
  3
  """
  curve = report.smoothed(losses, report.window_of(steps))
  reached = np.nonzero(curve <= level)[0]
  return int(reached[0]) + 1 if len(reached) else None


def steps_to_target(method, plain, steps: int, target: float | None) -> dict:
  """One seed's steps to target for ``method`` and ``plain`` (``Run``s):
  ``target`` if given, else the higher of their final smoothed losses.
  """
  window = report.window_of(steps)
  level = target
  if level is None:
    level = max(
      float(report.smoothed(r.losses, window)[-1]) for r in (method, plain)
    )
  return {
    "target": level,
    "method": first_step_at(method.losses, level, steps),
    "plain": first_step_at(plain.losses, level, steps),
  }


def against_plain(runs: dict, steps: int, target: float | None) -> dict:
  """Every method against plain at one learning rate.

  ``runs``: seed -> {method: (``Run``, its summary)}; a method is paired
  with plain on the seeds where both ran (``seeds`` in its row). Returns
  method -> {figure: :func:`paired`}, or for a method with a seed where it
  or plain diverged, ``diverged``: {method or plain: seeds}; steps to
  target also names the seeds where one of the two ``never`` reaches the
  target. Empty where plain did not run.
  """
  with_plain = [s for s in sorted(runs) if "plain" in runs[s]]
  methods = dict.fromkeys(
    m for s in with_plain for m in runs[s] if m != "plain"
  )
  out = {}
  for m in methods:
    seeds = [s for s in with_plain if m in runs[s]]
    diverged = {
      k: [s for s in seeds if runs[s][k][0].diverged_at is not None]
      for k in (m, "plain")
    }
    row: dict[str, Any] = {"seeds": seeds}
    if any(diverged.values()):
      row["diverged"] = {k: v for k, v in diverged.items() if v}
      out[m] = row
      continue
    for key, _ in LOSSES:
      pairs = [
        (runs[s][m][1].get(key), runs[s]["plain"][1].get(key)) for s in seeds
      ]
      if any(None in pair for pair in pairs):  # Not measured (no evals).
        row[key] = {"n": 0}
        continue
      row[key] = paired(*zip(*pairs))
    reach = {
      s: steps_to_target(runs[s][m][0], runs[s]["plain"][0], steps, target)
      for s in seeds
    }
    both = [
      s for s in seeds if None not in (reach[s]["method"], reach[s]["plain"])
    ]
    row["steps_to_target"] = dict(
      paired(
        [reach[s]["method"] for s in both], [reach[s]["plain"] for s in both]
      )
      if both
      else {"n": 0},
      per_seed=reach,
      never=[s for s in seeds if s not in both],
    )
    out[m] = row
  return out


def _cell(figure: dict, digits: str) -> str:
  if figure["n"] == 0:
    return "-"
  cell = f"{figure['mean']:+{digits}}"
  if figure["low"] is not None:
    cell += f" [{figure['low']:+{digits}}, {figure['high']:+{digits}}]"
  if figure.get("never"):
    cell += f" ({figure['n']} seeds; never reached on seeds {figure['never']})"
  return cell


def table(comparison: dict, where: str) -> str:
  """Markdown table of :func:`against_plain` (``where``: "lr 0.001"...)."""
  head = [label for _, label in LOSSES] + ["steps to target"]
  rows = [
    f"Against plain, {where}: method minus plain, paired by seed, mean "
    f"[95% t interval] (positive: higher loss, or more steps, than plain).",
    "",
    "| method | seeds | " + " | ".join(head) + " |",
    "|" + " --- |" * (len(head) + 2),
  ]
  for m, row in comparison.items():
    if "diverged" in row:
      why = "; ".join(
        f"{k} diverged on seeds {v}" for k, v in row["diverged"].items()
      )
      cells = [why] * len(head)
    else:
      cells = [_cell(row[key], ".4g") for key, _ in LOSSES]
      cells.append(_cell(row["steps_to_target"], ".0f"))
    rows.append(f"| {m} | {len(row['seeds'])} | " + " | ".join(cells) + " |")
  return "\n".join(rows)


def best_lrs(by_lr: dict) -> dict:
  """Each method's best learning rate: its lowest final held-out loss,
  mean over the seeds it ran at that rate (the final smoothed training
  loss where there is no held-out); rates where it diverged on a seed are
  out.

  ``by_lr``: lr -> seed -> method -> (``Run``, summary), as for
  :func:`against_plain`. Returns method -> lr, for methods with one.
  """
  means = {}
  for lr, per_seed in by_lr.items():
    for m in dict.fromkeys(m for runs in per_seed.values() for m in runs):
      pairs = [runs[m] for runs in per_seed.values() if m in runs]
      if any(r.diverged_at is not None for r, _ in pairs):
        continue
      key = "final_heldout_loss"
      if any(summary.get(key) is None for _, summary in pairs):
        key = "final_smoothed_train_loss"
      means.setdefault(m, {})[lr] = float(np.mean([s[key] for _, s in pairs]))
  return {m: min(by, key=by.get) for m, by in means.items()}


def tuned(by_lr: dict) -> tuple[dict, dict]:
  """Each method at its :func:`best_lrs` rate: (method -> lr, seed ->
  method -> (``Run``, summary)) over the seeds on which every method ran
  at its chosen rate.
  """
  best = best_lrs(by_lr)
  if not best:  # Every method diverged at every rate.
    return best, {}
  seeds = set.intersection(
    *(
      {s for s, runs in by_lr[lr].items() if m in runs}
      for m, lr in best.items()
    )
  )
  runs = {s: {m: by_lr[lr][s][m] for m, lr in best.items()} for s in seeds}
  return best, dict(sorted(runs.items()))


def legend(unit: str, target: float | None) -> str:
  """What :func:`table`'s figures mean, printed once under the tables."""
  rule = (
    f"steps to target: on each seed, the first step at which the "
    f"smoothed training loss is at or below {target:g}"
    if target is not None
    else TARGET_RULE
  )
  return (
    f"Losses in {unit}; interval: mean ± t(0.975, n - 1) x sd / sqrt(n) "
    f"over the n seeds (none for one seed); {rule}."
  )


def against_lr(records: list[dict]) -> dict:
  """Final held-out loss per method and lr (results.json ``runs``): method
  -> [(lr, mean over seeds, half width of its 95% t interval)], runs that
  diverged left out (half width 0 for one seed).
  """
  out = {}
  for lr in sorted({r["lr"] for r in records}):
    for method in dict.fromkeys(r["method"] for r in records):
      values = [
        report.heldout(r)[1][-1]
        for r in records
        if r["lr"] == lr
        and r["method"] == method
        and r["summary"]["diverged_at"] is None
        and report.heldout(r)[1]
      ]
      if not values:
        out.setdefault(method, [])
        continue
      half = 0.0
      if len(values) > 1:
        half = (
          t_quantile(0.5 + LEVEL / 2, len(values) - 1)
          * float(np.std(values, ddof=1))
          / math.sqrt(len(values))
        )
      out.setdefault(method, []).append((lr, float(np.mean(values)), half))
  return out
