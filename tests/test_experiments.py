"""``python -m immgrad.experiments``: end to end, and its definitions.

The runner is run as a user runs it, in a subprocess with its own device
count (2 simulated CPU devices here, to keep it quick).
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from immgrad.experiments import report
from immgrad.experiments import train

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(tmp_path, *args, name="out"):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # The runner makes its own devices.
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  out = tmp_path / name
  done = subprocess.run(
      [sys.executable, "-m", "immgrad.experiments", "--no-progress",
       "--devices", "2", "--out", str(out), *args],
      env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  return done, out


def test_digits_end_to_end_and_deterministic(tmp_path):
  args = ("--quick", "--steps", "30", "--seeds", "0", "1")
  first, out = _run(tmp_path, *args, name="a")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "Sanity check (current reproduces plain): PASSED" in first.stdout
  assert "| updated |" in first.stdout
  results = json.loads((out / "results.json").read_text())
  assert (out / "loss_curves.png").stat().st_size > 10_000
  runs = results["runs"]
  assert {(r["method"], r["seed"]) for r in runs} == {
      (m, s) for m in train.METHODS for s in (0, 1)}
  for r in runs:
    assert len(r["losses"]) == 30 and all(map(math.isfinite, r["losses"]))
    assert r["losses"][-1] < r["losses"][0]  # It trained.
    assert r["evals"][-1]["step"] == 30
    assert 0 <= r["evals"][-1]["heldout_accuracy"] <= 1
  by = {(r["method"], r["seed"]): r for r in runs}
  # Same data and init: the three start from the same loss...
  assert by["plain", 0]["losses"][0] == by["updated", 0]["losses"][0]
  # ...and updated then differs, while current tracks plain.
  assert by["plain", 0]["losses"][-1] != by["updated", 0]["losses"][-1]
  np.testing.assert_allclose(by["current", 0]["losses"],
                             by["plain", 0]["losses"], rtol=1e-4)
  assert results["aggregates"]["0.003"]["plain"]["final_train_loss"]["n"] == 2
  assert results["machine"]["devices"] and results["settings"]["devices"] == 2

  second, out2 = _run(tmp_path, *args, name="b")
  assert second.returncode == 0, second.stderr[-3000:]
  again = json.loads((out2 / "results.json").read_text())["runs"]
  assert [r["losses"] for r in again] == [r["losses"] for r in runs]


def test_lr_sweep_reports_divergence(tmp_path):
  done, out = _run(tmp_path, "--quick", "--steps", "15", "--optimizer",
                   "sgd", "--lr-sweep", "--lrs", "0.1", "1e6")
  assert done.returncode == 0, done.stderr[-3000:]
  sweep = json.loads((out / "results.json").read_text())["lr_sweep"]
  for method in train.METHODS:
    assert sweep[method]["best_lr"] == 0.1
    assert sweep[method]["lowest_diverging_lr"] == 1e6
  assert "diverged at step" in done.stdout


def test_chars_on_a_given_text(tmp_path):
  done, out = _run(tmp_path, "--task", "chars", "--quick", "--steps", "6",
                   "--seeds", "3", "--text", str(ROOT / "README.md"))
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert "README.md" in results["task"]
  assert results["loss_unit"] == "bits per byte"
  first = results["runs"][0]["losses"][0]
  assert 4 < first < 9  # About log2(256) = 8 bits before training.


def _run_record(losses, seconds=None, diverged_at=None):
  run = train.Run("x", losses=list(losses),
                  seconds=list(seconds or [1.0] * len(losses)),
                  diverged_at=diverged_at)
  run.evals = [{"step": 0, "train_loss": 3.0, "heldout_loss": 3.5},
               {"step": len(losses), "train_loss": 1.0, "heldout_loss": 1.5}]
  return run


def test_smoothing_is_a_trailing_mean():
  np.testing.assert_allclose(report.smoothed([4, 2, 6, 8], 2),
                             [4, 3, 4, 7])


def test_target_is_reached_by_every_method_that_did_not_diverge():
  runs = {"plain": _run_record([5, 4, 3, 2, 1] * 4),
          "current": _run_record([5, 4, 3, 2, 1.5] * 4),
          "updated": _run_record([5, math.nan], diverged_at=2)}
  target = report.default_target(runs, 20)
  assert target == pytest.approx(report.smoothed(
      runs["current"].losses, 2)[-1])
  for method in ("plain", "current"):
    summary = report.summarise(runs[method], runs["plain"], 20, target)
    assert summary["steps_to_target"] is not None
  summary = report.summarise(runs["current"], runs["plain"], 20, target)
  assert summary["seconds_to_target"] == summary["steps_to_target"] * 1.0
  assert summary["final_heldout_loss"] == 1.5
  assert summary["best_train_loss"] == 1.0


def test_step_time_ratio_and_aggregate():
  plain = _run_record([1.0] * 5, seconds=[1, 1, 1, 1, 9])
  slow = _run_record([1.0] * 5, seconds=[2, 2, 2, 2, 2])
  summary = report.summarise(slow, plain, 5, None)
  assert summary["step_time_ratio"] == 2.0  # Medians: 2 / 1.
  agg = report.aggregate([{"a": 1.0, "diverged_at": None},
                          {"a": 3.0, "diverged_at": 7}])
  assert agg["a"]["mean"] == 2.0 and agg["a"]["std"] == pytest.approx(
      math.sqrt(2))
  assert agg["diverged_runs"] == 1 and agg["diverged_at"] == [7]
