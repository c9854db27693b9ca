"""``python -m immgrad.experiments``: end to end, and its definitions.

The runner runs as a user runs it, in a subprocess with its own devices,
three times: on its default devices (4 simulated CPU devices, the LM task)
and twice with ``--devices 2`` (the digits task, the second compiled
afresh, which must give the same numbers). The other runs
call its ``main`` with the same arguments in this process (conftest.py's
4 simulated devices, ``--devices 2`` of them where the test says so), which
spares each a new interpreter and shares this process' compiled programs.
"""

import collections
import contextlib
import hashlib
import io
import json
import lzma
import math
import os
import pathlib
import subprocess
import sys
import tarfile
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import immgrad
from immgrad.experiments import __main__ as runner
from immgrad.experiments import corpus
from immgrad.experiments import report
from immgrad.experiments import tasks
from immgrad.experiments import train

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The language-model tests' text: a file that does not change. (They read
# README.md until an edit of it moved their data and, with it, a measured
# margin; every figure measured on their runs below is on this text.)
TEXT = ROOT / "LICENSE"


class _Done(NamedTuple):
  """What ``subprocess.run`` returns, for a run in this process."""

  returncode: int
  stdout: str
  stderr: str


def _argv(out, args, devices):
  chosen = ("--devices", str(devices)) if devices else ()
  return ["--no-progress", *chosen, "--out", str(out), *args]


def _run(tmp_path, *args, name="out", devices=2):
  """``runner.main`` in this process, its output and exit status kept."""
  # The backend started first, so that the runner cannot change this
  # process' device count (it asks for its own only before JAX starts).
  assert len(jax.devices()) == 4  # conftest.py's simulated devices.
  out = tmp_path / name
  stdout, stderr = io.StringIO(), io.StringIO()
  with (
    contextlib.chdir(tmp_path),
    contextlib.redirect_stdout(stdout),
    contextlib.redirect_stderr(stderr),
  ):
    try:
      code = runner.main(_argv(out, args, devices))
    except SystemExit as exit_:  # As the interpreter reports one.
      code = exit_.code
      if not isinstance(code, int | None):
        print(code, file=sys.stderr)
        code = 1
  return _Done(code or 0, stdout.getvalue(), stderr.getvalue()), out


def _run_command(tmp_path, *args, name="out", devices=2, cache=True):
  """``python -m immgrad.experiments`` in a subprocess, as a user runs it."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # The runner makes its own devices.
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  if cache:
    # Its steps share programs (plain, current and updated evaluate
    # alike): a JAX compilation cache, the same numbers.
    env.update(
      JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  out = tmp_path / name
  done = subprocess.run(
    [sys.executable, "-m", "immgrad.experiments", *_argv(out, args, devices)],
    env=env,
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=600,
  )
  return done, out


def test_digits_end_to_end_and_deterministic(tmp_path):
  args = ("--quick", "--steps", "30", "--seeds", "0", "1")
  # In a process of 2 devices, as the second: jax 0.7.0 rounds the same
  # run differently in a process of 4 (conftest.py's), in the last bit of
  # some losses (measured in CI's minimum-versions pass; jax 0.10.2 does
  # not), which is no run-to-run difference a user could see.
  first, out = _run_command(tmp_path, *args, name="a")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "Sanity check (current reproduces plain): PASSED" in first.stdout
  assert "| updated |" in first.stdout
  results = json.loads((out / "results.json").read_text())
  assert (out / "loss_curves.png").stat().st_size > 10_000
  runs = results["runs"]
  assert {(r["method"], r["seed"]) for r in runs} == {
    (m, s) for m in train.METHODS for s in (0, 1)
  }
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
  np.testing.assert_allclose(
    by["current", 0]["losses"], by["plain", 0]["losses"], rtol=1e-4
  )
  assert results["aggregates"]["0.003"]["plain"]["final_train_loss"]["n"] == 2
  assert results["machine"]["devices"] and results["settings"]["devices"] == 2

  # Compiled afresh, so that determinism still covers XLA's compilation,
  # as a user runs it: its own process, 2 devices made by the runner.
  second, out2 = _run_command(tmp_path, *args, name="b", cache=False)
  assert second.returncode == 0, second.stderr[-3000:]
  again = json.loads((out2 / "results.json").read_text())["runs"]
  assert [r["losses"] for r in again] == [r["losses"] for r in runs]


def test_lr_sweep_reports_divergence(tmp_path):
  done, out = _run(
    tmp_path,
    "--quick",
    "--steps",
    "15",
    "--optimizer",
    "sgd",
    "--lr-sweep",
    "--lrs",
    "0.1",
    "1e6",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  sweep = json.loads((out / "results.json").read_text())["lr_sweep"]
  for method in train.METHODS:
    assert sweep[method]["best_lr"] == 0.1
    assert sweep[method]["lowest_diverging_lr"] == 1e6
  assert "diverged at step" in done.stdout


def test_sweep_table_names_runs_that_did_not_learn():
  def agg(mean, diverged_at=()):
    loss = None if diverged_at else {"mean": mean, "std": 0.0, "n": 1, "of": 1}
    return {
      "final_smoothed_train_loss": loss,
      "diverged_runs": len(diverged_at),
      "diverged_at": list(diverged_at),
    }

  # a=1 at 4e-3 did not learn (report.did_not_learn): named, and the rule
  # printed under the table; a=1 at 1e-3 and the diverged plain: not.
  aggregates = {
    1e-3: {"plain": agg(1.5), "a=1": agg(2.1)},
    4e-3: {"plain": agg(1.5), "a=1": agg(3.9)},
    8e-3: {"plain": agg(None, diverged_at=[7]), "a=1": agg(3.9)},
  }
  methods = ["plain", "a=1"]
  sweep = runner._sweep(aggregates, methods)
  text = runner._sweep_table(sweep, aggregates, methods, {("a=1", 4e-3)})
  assert "| 0.004 | 1.5 | 3.9 (did not learn) |" in text
  assert "| 0.001 | 1.5 | 2.1 |" in text
  assert "| 0.008 | diverged at step 7 | 3.9 |" in text
  assert "did not learn: a final loss above the lowest any method" in text
  # Nothing marked (none did not learn, or only where a seed diverged,
  # which the table names instead): no rule under the table.
  for stalled in (set(), {("plain", 8e-3)}):
    assert "did not learn" not in runner._sweep_table(
      sweep, aggregates, methods, stalled
    )


def test_chars_on_a_given_text(tmp_path):
  done, out = _run(
    tmp_path,
    "--task",
    "chars",
    "--quick",
    "--steps",
    "6",
    "--seeds",
    "3",
    "--text",
    str(TEXT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert "LICENSE" in results["task"]
  assert results["loss_unit"] == "bits per byte"
  first = results["runs"][0]["losses"][0]
  assert 4 < first < 9  # About log2(256) = 8 bits before training.


def _run_record(losses, seconds=None, diverged_at=None):
  run = train.Run(
    "x",
    losses=list(losses),
    seconds=list(seconds or [1.0] * len(losses)),
    diverged_at=diverged_at,
  )
  run.evals = [
    {"step": 0, "train_loss": 3.0, "heldout_loss": 3.5},
    {"step": len(losses), "train_loss": 1.0, "heldout_loss": 1.5},
  ]
  return run


def test_smoothing_is_a_trailing_mean():
  np.testing.assert_allclose(report.smoothed([4, 2, 6, 8], 2), [4, 3, 4, 7])


def test_target_is_reached_by_every_method_that_did_not_diverge():
  runs = {
    "plain": _run_record([5, 4, 3, 2, 1] * 4),
    "current": _run_record([5, 4, 3, 2, 1.5] * 4),
    "updated": _run_record([5, math.nan], diverged_at=2),
  }
  target = report.default_target(runs, 20)
  assert target == pytest.approx(report.smoothed(runs["current"].losses, 2)[-1])
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
  agg = report.aggregate(
    [{"a": 1.0, "diverged_at": None}, {"a": 3.0, "diverged_at": 7}]
  )
  assert agg["a"]["mean"] == 2.0 and agg["a"]["std"] == pytest.approx(
    math.sqrt(2)
  )
  assert agg["diverged_runs"] == 1 and agg["diverged_at"] == [7]


def test_steps_behind_plain_is_the_shift_between_the_curves():
  # Plain's loss falls by one a step, with a wiggle of +-0.75 (so it
  # rises every other step); the method follows the same curve k steps
  # late (k < 0: early). The reference figures are k by construction; the
  # last point is never reached by a late method (its losses stop k steps
  # short of plain's last value). Quarters, so that the smoothed curves'
  # sums are exact in float64 and equal values compare equal. A spike at
  # step 60 lifts plain's smoothed curve above where it was three steps
  # before: read at step 60, plain itself first had that loss at step 57,
  # so a method 7 steps late is 7 behind, not 7 - 3.
  t = np.arange(100, dtype=np.float64)
  plain = 200.0 - t + 0.75 * (-1.0) ** t
  plain[59] += 30.0

  def shifted(k):
    return [plain[min(max(i - k, 0), 99)] for i in range(100)]

  assert report.lag_steps(100) == [20, 40, 60, 80, 100]
  assert report.steps_behind(shifted(7), plain, 100) == [7, 7, 7, 7, None]
  assert report.steps_behind(shifted(-5), plain, 100) == [-5] * 5
  assert report.steps_behind(list(plain), plain, 100) == [0] * 5
  # Rounding (current against plain on the CPU) is not being behind: a
  # relative 1e-6 higher is still 0, a relative 1e-3 higher at the end
  # never reaches plain's last loss.
  assert report.steps_behind(list(plain * (1 + 1e-6)), plain, 100) == [0] * 5
  assert report.steps_behind(list(plain * (1 + 1e-3)), plain, 100)[-1] is None
  diverged = [200.0, 199.0, math.nan] + [math.nan] * 97
  assert report.steps_behind(diverged, plain, 100) == [None] * 5
  table = report.lag_table({"a=1": [[7, 7, 7, 7, None], [9, 9, 9, 9, 9]]}, 100)
  assert "| a=1 | 8 | 8 | 8 | 8 | never |" in table


# -- issue 16: between the modes ------------------------------------------


def _by(runs):
  return {(r["method"], r["lr"], r["seed"]): r for r in runs}


def test_mode_sweep_a0_is_plain_and_a_fraction_is_between(tmp_path):
  done, out = _run(
    tmp_path, "--quick", "--steps", "12", "--seeds", "0", "--modes", "0.5", "1"
  )
  assert done.returncode == 0, done.stderr[-3000:]
  # 0 is always added: it is the reference of the sanity check.
  assert "Sanity check (a=0 reproduces plain): PASSED" in done.stdout
  assert "| a=0.5 |" in done.stdout and "best a=" in done.stdout
  results = json.loads((out / "results.json").read_text())
  assert results["settings"]["methods"] == ["plain", "a=0", "a=0.5", "a=1"]
  by = _by(results["runs"])
  lr = results["settings"]["lr"]
  loss = {
    m: np.asarray(by[m, lr, 0]["losses"])
    for m in ("plain", "a=0", "a=0.5", "a=1")
  }
  # a=0 is ordinary training: plain to float rounding (1e-4, the sanity
  # check's tolerance; the two programs fuse differently).
  np.testing.assert_allclose(loss["a=0"], loss["plain"], rtol=1e-4)
  # Step 1's loss is taken before any update: the same for every a.
  assert len({float(v[0]) for v in loss.values()}) == 1
  # From step 2 on, a=0.5 differs from both ends by far more than rounding
  # (1e-4 relative)...
  for other in ("a=0", "a=1"):
    rel = np.abs(loss["a=0.5"][1:] - loss[other][1:]) / loss[other][1:]
    assert rel.max() > 1e-3, other
  # ...and at step 2 lies near their midpoint: one step in, dX is affine in
  # a for conv and linear layers, so the loss is nearly so (within a
  # quarter of the gap, for the second-order coupling between layers).
  gap = loss["a=1"][1] - loss["a=0"][1]
  assert abs(gap) > 1e-5
  assert abs(loss["a=0.5"][1] - (loss["a=0"][1] + loss["a=1"][1]) / 2) < (
    0.25 * abs(gap)
  )
  verdict = results["mode_sweep"][str(lr)]["verdict"]
  assert verdict["final_smoothed_train_loss"]["best"] in ("a=0", "a=0.5", "a=1")


def test_mode_sweep_with_lr_sweep_is_a_grid(tmp_path):
  done, out = _run(
    tmp_path,
    "--quick",
    "--steps",
    "8",
    "--seeds",
    "0",
    "--optimizer",
    "sgd",
    "--lr-sweep",
    "--lrs",
    "0.05",
    "1e6",
    "--modes",
    "0",
    "-0.5",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert {(r["method"], r["lr"]) for r in results["runs"]} == {
    (m, lr) for m in ("plain", "a=0", "a=-0.5") for lr in (0.05, 1e6, 0.1)
  }
  sweep = results["lr_sweep"]
  for method in ("plain", "a=0", "a=-0.5"):
    assert sweep[method]["lowest_diverging_lr"] == 1e6
  assert "tuned" in results["mode_sweep"]
  assert "each method at its own best lr" in done.stdout


def test_measure_dx_per_layer_and_linear_in_lr(tmp_path):
  done, out = _run(
    tmp_path,
    "--quick",
    "--steps",
    "4",
    "--seeds",
    "0",
    "--optimizer",
    "sgd",
    "--lr-sweep",
    "--lrs",
    "0.01",
    "0.02",
    "--lr",
    "0.01",
    "--modes",
    "0",
    "1",
    "--measure-dx",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert (out / "dx_change.png").stat().st_size > 10_000
  assert "dX change" in done.stdout
  results = json.loads((out / "results.json").read_text())
  by = _by(results["runs"])
  layers = {"conv2_d", "conv2_d_1", "linear", "linear_1"}
  assert "dx_change" not in by["plain", 0.01, 0]
  for method in ("a=0", "a=1"):
    for lr in (0.01, 0.02):
      dx = by[method, lr, 0]["dx_change"]
      assert set(dx) == layers
      for values in dx.values():
        assert len(values) == 4
        assert all(math.isfinite(v) and v > 0 for v in values)
  # For SGD, dX_updated - dX_current = -lr * dy (x^T dy) for a dense layer
  # (likewise for a conv): at step 1 under a=0 (plain backprop, so each
  # layer's dy does not depend on lr) the ratio is exactly proportional to
  # lr. Stored to 4 significant digits: rtol 1e-3.
  for layer in layers:
    np.testing.assert_allclose(
      by["a=0", 0.02, 0]["dx_change"][layer][0],
      2 * by["a=0", 0.01, 0]["dx_change"][layer][0],
      rtol=1e-3,
    )
  # The top layer's dy is the loss's at the same parameters for every a:
  # its step-1 ratio is the same under a=0 and a=1.
  np.testing.assert_allclose(
    by["a=1", 0.01, 0]["dx_change"]["linear_1"][0],
    by["a=0", 0.01, 0]["dx_change"]["linear_1"][0],
    rtol=1e-3,
  )
  rows = results["dx_change"]
  assert {(r["method"], r["lr"]) for r in rows} == {
    (m, lr) for m in ("a=0", "a=1") for lr in (0.01, 0.02)
  }


def test_deep_mlp_builds_and_trains(tmp_path):
  done, out = _run(
    tmp_path,
    "--task",
    "deep_mlp",
    "--steps",
    "8",
    "--seeds",
    "0",
    "--modes",
    "0",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Sanity check (a=0 reproduces plain): PASSED" in done.stdout
  results = json.loads((out / "results.json").read_text())
  assert "18 linear layers" in results["task"]
  for r in results["runs"]:
    assert len(r["losses"]) == 8 and all(map(math.isfinite, r["losses"]))
    assert r["losses"][-1] < r["losses"][0]


def test_deep_transformer_stacked_measures_each_layer(tmp_path):
  done, out = _run(
    tmp_path,
    "--task",
    "deep_transformer",
    "--steps",
    "3",
    "--seeds",
    "0",
    "--modes",
    "0",
    "--measure-dx",
    "--text",
    str(TEXT),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((out / "results.json").read_text())
  assert "12 blocks under hk.layer_stack" in results["task"]
  by = _by(results["runs"])
  dx = by["a=0", results["settings"]["lr"], 0]["dx_change"]
  # One entry per layer of each stacked module: blocks/linear[0..11] ...
  stacked = [k for k in dx if k.startswith("blocks/linear[")]
  assert sorted(stacked, key=report.natural_key) == [
    f"blocks/linear[{i}]" for i in range(12)
  ]
  assert "blocks/multi_head_attention/query[11]" in dx
  # hk.Embed's input is integer tokens: no dX, so nothing to change.
  assert "linear" in dx and dx.pop("embed") == [0.0] * 3
  # The position parameter (module "~"), immediate as every parameter is
  # under immgrad.haiku.immediate's default: added to the activations, it
  # leaves dX unchanged.
  assert dx.pop("~") == [0.0] * 3
  for values in dx.values():
    assert len(values) == 3 and all(math.isfinite(v) and v > 0 for v in values)
  first = results["runs"][0]["losses"][0]
  assert 4 < first < 10  # About log2(256) = 8 bits before training.


def _mode_summaries(*values, diverged=None):
  return [
    {"final_smoothed_train_loss": v, "diverged_at": (diverged or {}).get(i)}
    for i, v in enumerate(values)
  ]


T_975_2 = 4.302653  # Student t, 0.975 quantile, 2 degrees of freedom.


def test_compare_modes_verdict_is_the_paired_t_interval():
  per_method = {
    "plain": _mode_summaries(1.0, 1.1, 1.2),
    "a=0": _mode_summaries(1.0, 1.1, 1.2),
    # a=0 minus it: 0.1, 0.15, 0.1. Ranges overlap, the interval is > 0.
    "a=0.5": _mode_summaries(0.9, 0.95, 1.1),
    # 0.5, 0.5, -0.05: the interval holds 0.
    "a=1": _mode_summaries(0.5, 0.6, 1.25),
    # -0.15, -0.15, -0.1: ranges overlap, the interval is < 0.
    "a=-0.5": _mode_summaries(1.15, 1.25, 1.3),
    "a=2": _mode_summaries(0.1, 0.1, math.nan, diverged={2: 5}),
  }
  c = report.compare_modes(per_method)
  # Hand-computed: mean ± t * sd / sqrt(3), sd of the three differences.
  sd = math.sqrt((2 * (0.05 / 3) ** 2 + (0.1 / 3) ** 2) / 2)  # 0.028868.
  half = T_975_2 * sd / math.sqrt(3)  # 0.071711.
  assert c["a=0.5"]["paired_difference"] == pytest.approx(0.35 / 3)
  assert c["a=0.5"]["low"] == pytest.approx(0.35 / 3 - half, abs=1e-6)
  assert c["a=0.5"]["high"] == pytest.approx(0.35 / 3 + half, abs=1e-6)
  assert c["a=0.5"]["verdict"] == "beats"
  sd = math.sqrt((2 * (0.55 / 3) ** 2 + (1.1 / 3) ** 2) / 2)  # 0.317543.
  assert c["a=1"]["low"] == pytest.approx(
    0.95 / 3 - T_975_2 * sd / math.sqrt(3), abs=1e-6
  )  # -0.47215.
  assert c["a=1"]["verdict"] == "no difference shown"
  assert c["a=-0.5"]["high"] == pytest.approx(-0.4 / 3 + half, abs=1e-6)
  assert c["a=-0.5"]["verdict"] == "worse"
  assert "mean" not in c["a=2"] and c["a=2"]["diverged_at"] == [5]
  assert "verdict" not in c["a=2"]
  # The lowest mean, not a verdict; diverged runs (a=2) are not eligible.
  assert report.best_mode(c) == "a=1"
  text, result = report.mode_table(per_method, "nats", "title")
  assert "| +0.12 [+0.045, +0.19] **beats** |" in text
  assert "| -0.13 [-0.21, -0.062] worse |" in text
  assert "| +0.32 [-0.47, +1.1] no difference shown |" in text
  assert result["verdict"]["final_smoothed_train_loss"]["beat_a0"] == ["a=0.5"]
  # One seed: no interval, no verdict.
  c = report.compare_modes(
    {"a=0": _mode_summaries(1.0), "a=1": _mode_summaries(0.5)}
  )
  assert c["a=1"]["paired_difference"] == 0.5 and c["a=1"]["low"] is None
  assert c["a=1"]["verdict"] is None
  c = report.compare_modes(
    {
      "a=0": _mode_summaries(1.0, math.nan, diverged={1: 3}),
      "a=1": _mode_summaries(2.0, 2.0),
    }
  )
  assert c["a=1"]["verdict"] == "beats" and c["a=1"]["baseline_diverged"]


# -- issue 28: the language-model task, split runs; issue 26: devices -----


def test_lm_tiny_quick_end_to_end_on_the_default_devices(tmp_path):
  done, out = _run_command(
    tmp_path, "--task", "lm", "--size", "tiny", "--quick", devices=None
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Sanity check (current reproduces plain): PASSED" in done.stdout
  results = json.loads((out / "results.json").read_text())
  settings = results["settings"]
  # No --devices on the CPU: 4 simulated devices.
  assert settings["devices"] == 4 and len(results["machine"]["devices"]) == 4
  assert settings["optimizer"] == "adamw" and settings["steps"] == 40
  assert "GPT-style byte-level LM 'tiny'" in results["task"]
  assert "float32 compute" in results["task"]
  assert results["loss_unit"] == "bits per byte"
  assert settings["command"] in done.stdout
  by = {r["method"]: r for r in results["runs"]}
  assert set(by) == set(train.METHODS)
  for r in by.values():
    assert len(r["losses"]) == 40 and all(map(math.isfinite, r["losses"]))
    assert 6 < r["losses"][0] < 10  # About log2(256) = 8 bits untrained.
    assert r["losses"][-1] < r["losses"][0] - 2  # It trained.
    assert r["evals"][-1]["step"] == 40
    assert math.isfinite(r["evals"][-1]["heldout_loss"])
  # current is plain training: to the sanity check's 1e-4 relative (float
  # rounding of two differently fused programs; measured ~1e-7).
  np.testing.assert_allclose(
    by["current"]["losses"], by["plain"]["losses"], rtol=1e-4
  )
  assert by["updated"]["losses"][-1] != by["plain"]["losses"][-1]


def test_split_runs_merge_into_the_joint_run(tmp_path):
  common = ("--quick", "--steps", "8", "--seeds", "0", "--modes", "1")
  joint, joint_out = _run(tmp_path, *common, name="joint")
  first, a = _run(tmp_path, *common, "--methods", "plain", "a=0", name="a")
  second, b = _run(tmp_path, *common, "--methods", "a=1", name="b")
  for done in (joint, first, second):
    assert done.returncode == 0, done.stderr[-3000:]
  assert "Sanity check: not run" in second.stdout
  merged, m = _run(
    tmp_path,
    "--merge",
    str(a / "results.json"),
    str(b / "results.json"),
    name="m",
    devices=None,
  )
  assert merged.returncode == 0, merged.stderr[-3000:]
  assert "Sanity check (a=0 reproduces plain): PASSED" in merged.stdout
  together = json.loads((joint_out / "results.json").read_text())
  result = json.loads((m / "results.json").read_text())
  # a=0 is plain, up to rounding: 0 steps behind at every point.
  lags = result["steps_behind_plain"][str(result["settings"]["lr"])]
  assert lags["per_seed"]["a=0"] == [[0] * len(lags["at_steps"])]
  assert "Steps behind plain" in merged.stdout
  assert result["settings"]["methods"] == ["plain", "a=0", "a=1"]
  assert len(result["settings"]["merged_from"]) == 2
  # The repeat commands are each file's, not the first file's as the
  # merge's own.
  assert result["settings"]["command"] is None
  for part in (a, b):
    command = json.loads((part / "results.json").read_text())["settings"]
    assert f"  {command['command']}" in merged.stdout
  # Each method's run is the same whether it trained alone or beside the
  # others: same initialisation, batches and program, bit for bit.
  key = lambda r: (r["method"], r["lr"], r["seed"])
  assert {key(r): r["losses"] for r in result["runs"]} == {
    key(r): r["losses"] for r in together["runs"]
  }
  # The joint run's report, read back as the merge reads (each step's
  # loss to report.LOSS_DIGITS digits), is the merged report.
  joint_read, joint_m = _run(
    tmp_path,
    "--merge",
    str(joint_out / "results.json"),
    name="jm",
    devices=None,
  )
  assert joint_read.returncode == 0, joint_read.stderr[-3000:]
  joint_result = json.loads((joint_m / "results.json").read_text())
  for key in ("mode_sweep", "against_plain"):
    assert result[key] == joint_result[key], key
  # A method trained twice is refused.
  again, _ = _run(
    tmp_path,
    "--merge",
    str(a / "results.json"),
    str(a / "results.json"),
    name="x",
    devices=None,
  )
  assert again.returncode != 0 and "in two of the files" in again.stderr


def test_default_devices_are_the_backends_local_devices(monkeypatch):
  cpus = jax.local_devices()
  assert len(cpus) == 4  # conftest.py's simulated devices.
  assert runner.training_devices() == cpus[: runner.CPU_DEVICES]
  assert runner.training_devices(2) == cpus[:2]
  # An accelerator backend: all its local devices, here one chip.
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  monkeypatch.setattr(jax, "local_devices", lambda: cpus[:1])
  assert runner.training_devices() == cpus[:1]
  with pytest.raises(
    SystemExit,
    match="--devices 4, but the tpu backend has only 1 local devices",
  ):
    runner.training_devices(4)


def _lm_steps(task, opt, n, immediate):
  """n adamw steps of the tiny LM, one device: plain optax or the shim."""
  params = task.init(0)
  if immediate:
    tx = immgrad.shim(opt)
    grad_fn = immgrad.value_and_grad(task.loss_fn, tx, mode="current")
  else:
    tx, grad_fn = opt, jax.value_and_grad(task.loss_fn)

  @jax.jit
  def step(params, state, inputs, targets):
    if immediate:
      _, grads = grad_fn(params, state, inputs, targets)
    else:
      _, grads = grad_fn(params, inputs, targets)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state, out, batches = tx.init(params), [], task.batches(0, 8)
  for _ in range(n):
    params, state = step(params, state, *next(batches))
    out.append(params)
  return out


def _repeat_command(*flags):
  """The repeat command the runner prints for ``--task lm`` and ``flags``."""
  settings = dict(
    optimizer="adamw", lr=3e-3, steps=6, batch_size=8, devices=1, seeds=[0]
  )
  return runner._command(runner.parse(["--task", "lm", *flags]), settings)


def test_lm_blocks_varies_depth_alone():
  two = tasks.lm(str(TEXT), "tiny", blocks=2)
  three = tasks.lm(str(TEXT), "tiny", blocks=3)
  count = lambda task: sum(x.size for x in jax.tree.leaves(task.init(0)))
  # One more block at d_model 64, by hand: two LayerNorms 2 x (64 + 64),
  # q/k/v 64 x 192 + 192, attention out 64 x 64 + 64, MLP up 64 x 256 +
  # 256, MLP down 256 x 64 + 64.
  assert count(three) - count(two) == 49_984
  assert count(two) == 137_216  # tiny's own two blocks (lm.md's table).
  assert "(3 pre-LN blocks, d_model 64," in three.description
  assert "--size tiny --blocks 3 " in _repeat_command("--blocks", "3")
  with pytest.raises(SystemExit, match="--blocks"):
    runner.main(["--task", "digits", "--blocks", "3"])
  with pytest.raises(SystemExit, match="--blocks 0: give at least 1"):
    runner.main(["--task", "lm", "--blocks", "0"])


def test_lm_width_varies_width_alone():
  wide = tasks.lm(str(TEXT), "tiny", width=128)
  count = sum(x.size for x in jax.tree.leaves(wide.init(0)))
  # tiny's two blocks at d_model 128, by hand. A block: two LayerNorms
  # 2 x (128 + 128), q/k/v 128 x 384 + 384, attention out 128 x 128 + 128,
  # MLP up 128 x 512 + 512, down 512 x 128 + 128: 198,272. Around them:
  # embedding 256 x 128, positions 64 x 128, final LayerNorm 2 x 128,
  # output 128 x 256 + 256.
  assert count == 2 * 198_272 + 32_768 + 8_192 + 256 + 33_024
  assert "(2 pre-LN blocks, d_model 128, 4 heads," in wide.description
  assert "--size tiny --width 128 " in _repeat_command("--width", "128")
  with pytest.raises(ValueError, match="width=130: give a positive multiple"):
    tasks.lm(str(TEXT), "tiny", width=130)
  with pytest.raises(SystemExit, match="--width"):
    runner.main(["--task", "digits", "--width", "128"])
  with pytest.raises(
    SystemExit, match="--width 130: give a positive multiple of 4"
  ):
    runner.main(["--task", "lm", "--width", "130"])


def test_lm_adamw_schedule_and_decay_mask_step_as_plain_optax():
  task = tasks.lm(str(TEXT), "tiny", compute_dtype=None)
  init = task.init(0)
  mask = train.decay_mask(init)
  # GPT practice: matrices, embeddings and positions decay; biases and
  # LayerNorm scales and offsets do not.
  assert mask["linear"] == {"w": True, "b": False}
  assert mask["layer_norm"] == {"scale": False, "offset": False}
  assert mask["embed"] == {"embeddings": True} and mask["~"] == {
    "positions": True
  }
  steps = 100  # Warm-up over 5 steps: the 8 below cross it.
  opt = train.optimizer("adamw", 3e-3, steps)
  assert float(train.schedule(3e-3, steps)(0)) == 0.0
  expected = _lm_steps(task, opt, 8, immediate=False)
  got = _lm_steps(task, opt, 8, immediate=True)
  # The schedule starts at 0: step 1 leaves every weight as it was, in both.
  chex.assert_trees_all_equal(got[0], init)
  chex.assert_trees_all_equal(expected[0], init)
  # Then each step agrees with plain optax to 1e-5 absolute: the two
  # gradients are computed by differently fused programs and differ by
  # float32 rounding, which adam turns into a few 1e-6 on weights (3.4e-6
  # measured after 8 steps, growing about 5e-7 a step); a step of the
  # schedule (lr/5 in the warm-up) or a decay on the wrong leaves moves a
  # weight by 1e-4 or more (below).
  for i, (g, e) in enumerate(zip(got, expected)):
    chex.assert_trees_all_close(
      g, e, atol=1e-5, rtol=0, custom_message=f"step {i + 1}"
    )
  # What the tolerance can tell apart: the schedule one step ahead, or
  # weight decay on every leaf, lands far outside it.
  ahead = optax.adamw(
    lambda count: train.schedule(3e-3, steps)(count + 1),
    b1=0.9,
    b2=0.95,
    weight_decay=train.WEIGHT_DECAY,
    mask=train.decay_mask,
  )
  all_decayed = optax.adamw(
    train.schedule(3e-3, steps),
    b1=0.9,
    b2=0.95,
    weight_decay=train.WEIGHT_DECAY,
  )
  for other in (ahead, all_decayed):
    away = _lm_steps(task, other, 8, immediate=False)[-1]
    assert train.max_param_difference(away, expected[-1]) > 1e-4


def test_lm_bfloat16_a0_is_plain_training():
  task = tasks.lm(str(TEXT), "tiny", compute_dtype=jnp.bfloat16)
  assert "bfloat16 compute, float32 weights" in task.description
  runs = train.train(
    task,
    optimizer_name="adamw",
    lr=3e-3,
    steps=10,
    batch_size=8,
    seed=0,
    eval_every=5,
    methods={"plain": None, "a=0": 0.0},
  )
  params = runs["a=0"].final_params
  assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype("float32")}
  # Both run the same bfloat16 arithmetic (immediate(compute_dtype=...)
  # casts inside the layer in plain training too), and from the same state
  # they compute the same gradients, bit for bit, and the same weights to a
  # few float32 ulps (the optimizer's rounding: the test below). Step 1
  # leaves the weights as they were (the schedule starts at 0), so the
  # first two losses are identical. After that bfloat16 amplifies the
  # ulps: a weight an ulp away rounds some activations to the neighbouring
  # bfloat16 (2**-8 relative), the gradients then differ by far more than
  # float32 rounding, and adam turns that into weight differences of the
  # order of lr. Plain training does the same to itself: started from
  # weights one float32 ulp away it ends 1.5e-2 to 1.8e-2 from itself after
  # these 10 steps (losses 3.0e-5 to 7.1e-5 relative; seeds 0 and 1).
  # Measured a=0 against plain on seeds 0-3 (2026-12-07, jax 0.10.2, the
  # suite's XLA settings): losses equal on two seeds, 1.1e-7 and 1.0e-5
  # relative on the others (first differing at step 10 and 8); weights
  # 3.7e-9 to 3.4e-4 apart (lr 3e-3).
  np.testing.assert_array_equal(
    runs["a=0"].losses[:2], runs["plain"].losses[:2]
  )
  np.testing.assert_allclose(
    runs["a=0"].losses, runs["plain"].losses, rtol=1e-4
  )
  assert train.max_param_difference(params, runs["plain"].final_params) < 3e-2
  # And the compute is bfloat16: from the same weights and batch, float32
  # compute gives other gradients. Not the first loss: at initialisation
  # the logits are near zero and the loss near log(256) either way (it
  # moved by 7e-7 to 1.2e-4 bits with the text and seed, under a float32
  # ulp at the smallest). The gradients: 4% to 6% apart (largest relative
  # difference over the leaves, seeds 0-2, this text or README.md, jax
  # 0.7.0 and 0.10.2), where float32 rounding alone would be ~1e-6.
  f32 = tasks.lm(str(TEXT), "tiny", compute_dtype=None)
  weights, batch = f32.init(0), next(f32.batches(0, 8))
  apart = jax.tree.map(
    lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)),
    jax.grad(f32.loss_fn)(weights, *batch),
    jax.grad(task.loss_fn)(weights, *batch),
  )
  assert max(jax.tree.leaves(apart)) > 1e-2


def _ulps_apart(got, expected, old):
  """Largest ``|got - expected|`` in ulps of the largest operand of the step.

  The operands of ``old + update = expected`` (float32): a rounding error of
  the update is an ulp of whichever of the three is largest.
  """
  largest = np.maximum(
    np.maximum(np.abs(old), np.abs(expected)), np.abs(expected - old)
  )
  error = np.abs(got.astype(np.float64) - expected.astype(np.float64))
  return float(np.max(error / np.spacing(largest.astype(np.float32))))


def test_lm_bfloat16_a0_steps_as_plain_from_the_same_state():
  # Where bfloat16 a=0 and plain training part (the test above): from the
  # same weights and state, each step's gradients, loss and new optimizer
  # state are plain's bit for bit; the new weights differ by the
  # optimizer's float32 rounding only.
  task = tasks.lm(str(TEXT), "tiny", compute_dtype=jnp.bfloat16)
  opt = train.optimizer("adamw", 3e-3, 10)
  mesh = jax.make_mesh((1,), (train.AXIS,), devices=jax.devices()[:1])
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  # The runner's own jitted steps (shard_map over one device, donated).
  _, plain_step = train._step_fn(None, task, opt, mesh)
  tx, a0_step = train._step_fn(0.0, task, opt, mesh)
  plain_grad = jax.jit(jax.grad(task.loss_fn))
  a0_grad = jax.jit(immgrad.value_and_grad(task.loss_fn, tx, mode=0.0))
  params = jax.device_get(task.init(0))
  state = jax.device_get(opt.init(params))
  batches = task.batches(0, 8)
  for step in range(1, 7):  # Along plain's path; the lr warms up at step 2.
    batch = next(batches)
    _, grads = a0_grad(params, immgrad.shim_state_from_optax(state), *batch)
    grads = jax.tree.map(
      lambda g: g.grad if isinstance(g, immgrad.ImmediateGrad) else g,
      grads,
      is_leaf=lambda g: isinstance(g, immgrad.ImmediateGrad),
    )
    chex.assert_trees_all_equal(
      grads, plain_grad(params, *batch), custom_message=f"step {step}"
    )
    # One step of each from the same weights and state (fresh buffers:
    # the steps donate theirs).
    new, new_state, loss = jax.device_get(
      plain_step(
        *jax.device_put((params, state), replicated),
        *jax.device_put(batch, split),
      )
    )
    got, got_state, got_loss = jax.device_get(
      a0_step(
        *jax.device_put(
          (params, immgrad.shim_state_from_optax(state)), replicated
        ),
        *jax.device_put(batch, split),
      )
    )
    assert got_loss == loss, step
    chex.assert_trees_all_equal(got_state.inner, new_state)
    # The weights only to the optimizer's rounding. XLA compiles optax's
    # update for the whole tree in plain's step and per parameter in the
    # shim's commit, and rewrites adam's two divisions by the bias
    # corrections c1, c2 differently: on the CPU, m / (c1 * (sqrt(v / c2)
    # + eps)) in plain and (m * (1 / c1)) / (sqrt(v * (1 / c2)) + eps) in
    # the shim (both with fused multiply-adds: so a two-parameter adamw
    # step is reproduced bit for bit in numpy); and the shim hands optax
    # the update ``new - w``, which apply_updates adds back (one more
    # rounding). Measured: at most 5 ulps over these 6 steps; a learning rate
    # 0.1% off gives 1.6e4 ulps.
    for old, g, e in zip(*map(jax.tree.leaves, (params, got, new))):
      ulps = _ulps_apart(g, e, old)
      assert ulps <= 8, (step, ulps)
    params, state = new, new_state


def _tiny_lm(methods: dict, task=None, **options) -> dict:
  """Six steps of the tiny lm (``TEXT``, float32; adamw 3e-3, batch 8,
  seed 0) with ``methods`` and the ``train.train`` ``options``.
  """
  task = task or tasks.lm(str(TEXT), "tiny", compute_dtype=None)
  return train.train(
    task,
    optimizer_name="adamw",
    lr=3e-3,
    steps=6,
    batch_size=8,
    seed=0,
    eval_every=6,
    methods=methods,
    **options,
  )


def test_lm_remat_leaves_training_as_it_was():
  runs = {}
  for remat in (False, True):
    task = tasks.lm(str(TEXT), "tiny", compute_dtype=None, remat=remat)
    runs[remat] = _tiny_lm({"plain": None, "a=1": 1.0}, task)
  assert "blocks under hk.remat" in task.description
  # hk.remat recomputes the blocks' forward pass in the backward pass: the
  # same arithmetic, fused differently. Losses to 1e-6 relative (measured:
  # plain 1.0e-7, a=1 identical); weights to 1e-4 (a=1 measured 2.8e-5 after
  # 6 steps: adam turns rounding in near-zero gradients into weight noise),
  # where a=1 and plain differ by 3.7e-2 in loss (above 1e-2).
  for method in ("plain", "a=1"):
    np.testing.assert_allclose(
      runs[True][method].losses, runs[False][method].losses, rtol=1e-6
    )
    assert (
      train.max_param_difference(
        runs[True][method].final_params, runs[False][method].final_params
      )
      < 1e-4
    )
  assert (
    abs(runs[True]["a=1"].losses[-1] - runs[True]["plain"].losses[-1]) > 1e-2
  )


def test_current_for_trains_current_first_then_the_mode():
  """``current_for=3``: a=1 takes steps 1-3 in mode current, in the same
  shim state, then its own mode. Its losses (each taken before its step)
  are a=0's bit for bit through step 4, the same program from the same
  state; the fifth, after its first a=1 step, differs. Without it a=1
  leaves a=0 at the third loss (the warm-up's first step has rate 0, and
  changes nothing). 1e-6 relative is far below a=1's departure.
  """
  runs = {k: _tiny_lm({"a=0": 0.0, "a=1": 1.0}, current_for=k) for k in (0, 3)}
  a0 = runs[3]["a=0"].losses
  assert a0 == runs[0]["a=0"].losses  # a=0 takes no part in it.
  assert runs[3]["a=1"].losses[:4] == a0[:4]
  gap = lambda losses, k: abs(losses[k] - a0[k]) / a0[k]
  assert gap(runs[3]["a=1"].losses, 4) > 1e-6
  assert gap(runs[0]["a=1"].losses, 2) > 1e-6


def test_current_for_is_repeated_merged_alike_and_refused_out_of_range(
  tmp_path,
):
  """--current-for is in the report and the repeat command; a file of
  plain and a=0 (which it does not change) merges with it, a method with
  another --current-for does not; it must lie in [0, steps).
  """
  common = ("--quick", "--steps", "8", "--seeds", "0", "--modes", "1", "0.5")
  late, late_out = _run(
    tmp_path, *common, "--methods", "a=1", "--current-for", "3", name="l"
  )
  assert late.returncode == 0, late.stderr[-3000:]
  assert "mode current for its first 3 steps" in late.stdout
  assert "--current-for 3" in late.stdout  # "Repeat this run with".
  result = json.loads((late_out / "results.json").read_text())
  assert result["settings"]["current_for"] == 3
  files = {}
  for name, methods in (("p", ("plain", "a=0")), ("h", ("a=0.5",))):
    done, files[name] = _run(
      tmp_path, *common, "--methods", *methods, name=name
    )
    assert done.returncode == 0, done.stderr[-3000:]
  merge = lambda *names, out: _run(
    tmp_path,
    "--merge",
    *(str(files.get(n, late_out) / "results.json") for n in names),
    name=out,
    devices=None,
  )
  alike, alike_out = merge("p", "l", out="m1")
  assert alike.returncode == 0, alike.stderr[-3000:]
  assert "mode current for its first 3 steps" in alike.stdout
  merged = json.loads((alike_out / "results.json").read_text())
  assert merged["settings"]["current_for"] == 3
  mixed, _ = merge("p", "l", "h", out="m2")
  assert mixed.returncode != 0 and "--current-for" in mixed.stderr
  for k in ("-1", "8"):
    wrong, _ = _run(tmp_path, *common, "--current-for", k, name="w")
    assert wrong.returncode != 0 and "--current-for" in wrong.stderr


def test_each_way_of_writing_the_step_trains_alike():
  """``step_kind``: the atomic shim and immgrad.train_step in place train
  each method as the optax loop with ``atomic=False`` does, to float32
  rounding (the programs fuse the optimizer's arithmetic differently;
  measured: bit for bit on jax 0.10.2's CPU): losses to 1e-5 relative
  over 6 steps, where a=1 leaves a=0 by 5e-3 (the test above), and a=0
  stays plain's.
  """
  methods = {"plain": None, "a=0": 0.0, "a=1": 1.0}
  runs = {kind: _tiny_lm(methods, step_kind=kind) for kind in train.STEPS}
  for kind in train.STEPS:
    for method in ("plain", "a=0", "a=1"):
      np.testing.assert_allclose(
        runs[kind][method].losses, runs["optax"][method].losses, rtol=1e-5
      )
    np.testing.assert_allclose(
      runs[kind]["a=0"].losses, runs[kind]["plain"].losses, rtol=1e-5
    )
    assert (
      abs(runs[kind]["a=1"].losses[-1] / runs[kind]["a=0"].losses[-1] - 1)
      > 1e-3
    )


def test_step_kind_is_reported_merged_alike_and_checked(tmp_path):
  common = ("--quick", "--steps", "6", "--seeds", "0", "--modes", "1")
  atomic, atomic_out = _run(
    tmp_path, *common, "--methods", "a=1", "--step", "atomic", name="a"
  )
  assert atomic.returncode == 0, atomic.stderr[-3000:]
  assert (
    "immgrad's step: value_and_grad + tx.update + apply_updates, the atomic shim"
    in atomic.stdout
  )
  assert "--step atomic" in atomic.stdout  # "Repeat this run with".
  files = {}
  for name, extra in (("p", ("--methods", "plain", "a=0")),):
    done, files[name] = _run(tmp_path, *common, *extra, name=name)
    assert done.returncode == 0, done.stderr[-3000:]
  plain_file = str(files["p"] / "results.json")
  mixed, _ = _run(
    tmp_path,
    "--merge",
    plain_file,
    str(atomic_out / "results.json"),
    name="m",
    devices=None,
  )
  # plain's file holds a=0, stepped the optax way: not the atomic shim's.
  assert mixed.returncode != 0 and "--step" in mixed.stderr
  wrong, _ = _run(
    tmp_path, *common, "--step", "in-place", "--measure-dx", name="w"
  )
  assert wrong.returncode != 0 and "--measure-dx" in wrong.stderr
  # train() itself refuses the pair, for its Python callers.
  with pytest.raises(ValueError, match="step_kind='in-place'"):
    _tiny_lm({"a=1": 1.0}, measure_dx=True, step_kind="in-place")


# -- the corpus (immgrad.experiments.corpus) and --data --------------------

_PAGE = """<html><head><title>T</title><style>p {}</style></head><body>
<div class="related" role="navigation"><a href="x">previous</a> | next</div>
<div class="sphinxsidebar" role="navigation"><p>Quick search</p></div>
<div class="body" role="main"><h1>Title<a class="headerlink">&para;</a></h1>
<p>First   paragraph, with <code>code()</code> and
an &amp; entity.</p><pre>for x in y:\n    print(x)</pre>
<div class="highlight-python"><div class="highlight"><pre>z = 1</pre></div></div>
<ul><li>one</li><li>two</li></ul><script>var a = 1;</script>
<div><div><p>Nested.</p></div></div></div>
<div class="footer">Copyright.</div></body></html>"""


def test_corpus_html_text_keeps_the_main_content_prose():
  text = corpus.html_text(_PAGE)
  assert text.split("\n\n") == [
    "Title",
    "First paragraph, with code() and an & entity.",
    "one",
    "two",
    "Nested.",
  ]
  # Without role="main": the body, navigation and code still dropped.
  plain = corpus.html_text(_PAGE.replace('role="main"', ""))
  assert plain.split("\n\n")[0] == "Title" and "Quick" not in plain
  assert "previous" not in plain and "Copyright" not in plain


def _words(seed, n):
  rng = np.random.default_rng(seed)
  vocab = "the a of to in data byte run step model rate loss layer".split()
  return " ".join(rng.choice(vocab, n))


def _documents(n=40):
  boiler = "This paragraph repeats on every page of the doc set, word for word."
  return [
    corpus.Document(
      f"pkg/page{i:02d}.html",
      f"{_words(i, 60)}\n\n{boiler}\n\nShort heading\n\n{_words(100 + i, 40)}",
    )
    for i in range(n)
  ]


def test_corpus_split_dedupes_and_holds_out_whole_documents():
  docs = _documents()
  docs.append(corpus.Document("pkg/tiny.html", "Too short to keep."))
  docs.append(corpus.Document("pkg/zh.html", "\u6587\u6863" * 200))
  docs.append(corpus.Document("pkg/again.html", docs[3].text))  # A copy.
  result = corpus.split(docs, heldout_bytes=2_000)
  dropped = result.dropped
  assert dropped["short_documents"] == 2  # tiny, and the copy once deduped.
  assert dropped["non_ascii_documents"] == 1
  # The boilerplate paragraph (>= 64 characters) is kept once, in page00
  # (the first); a short one repeats.
  everything = result.train + result.heldout
  boiler = "This paragraph repeats"
  assert sum(d.text.count(boiler) for d in everything) == 1
  assert sum(d.text.count("Short heading") for d in everything) == 40
  # The boilerplate in pages 1 to 39; the copy's three long paragraphs.
  assert dropped["repeated_paragraphs"] == 39 + 3
  # Whole documents held out: none in both, no long paragraph in both.
  train_names = {d.name for d in result.train}
  heldout_names = {d.name for d in result.heldout}
  assert not train_names & heldout_names
  assert train_names | heldout_names == {
    f"pkg/page{i:02d}.html" for i in range(40)
  }
  assert 2_000 <= len(corpus.joined(result.heldout)) < 2_000 + 800
  long = lambda ds: {
    p for d in ds for p in d.text.split("\n\n") if len(p) >= 64
  }
  assert not long(result.train) & long(result.heldout)
  # The held-out choice hangs on the names alone, not on the order.
  again = corpus.split(_documents()[::-1][:-1] + _documents()[:1], 2_000)
  assert {d.name for d in again.heldout} == heldout_names
  # The training split keeps the order given.
  assert [d.name for d in result.train] == sorted(train_names)


def _tar_xz(files: dict) -> bytes:
  buffer = io.BytesIO()
  with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
    for name, data in files.items():
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))
  return buffer.getvalue()


def _deb(path, package, version, files):
  """A minimal .deb: ar with debian-binary, control.tar.xz, data.tar.xz."""
  members = [
    ("debian-binary", b"2.0\n"),
    (
      "control.tar.xz",
      _tar_xz(
        {"./control": f"Package: {package}\nVersion: {version}\n".encode()}
      ),
    ),
    ("data.tar.xz", _tar_xz({f"./{k}": v for k, v in files.items()})),
  ]
  with open(path, "wb") as f:
    f.write(b"!<arch>\n")
    for name, data in members:
      f.write(
        f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
      )
      f.write(data + b"\n" * (len(data) % 2))


def _fake_corpus(tmp_path, monkeypatch, pages=60):
  """A corpus built by ``corpus build`` from a fake documentation .deb."""
  debs = tmp_path / "debs"
  debs.mkdir()
  files = {
    f"usr/share/doc/fake/html/p{i:02d}.html": _PAGE.replace(
      "Nested.", _words(i, 120)
    ).encode()
    for i in range(pages)
  }
  files["usr/share/doc/fake/html/genindex.html"] = _PAGE.encode()
  files["usr/share/doc/fake/other.txt"] = b"not a page"
  _deb(debs / "fake-doc_1.0-1_all.deb", "fake-doc", "1.0-1", files)
  source = corpus.Source(
    "fake-doc",
    "1.0-1",
    "CC0",
    "usr/share/doc/fake/html/",
    corpus._SPHINX_PAGES,
  )
  monkeypatch.setattr(corpus, "SOURCES", (source,))
  out = tmp_path / "corpus"
  argv = ["build", "--out", str(out), "--debs", str(debs)]
  assert corpus.main([*argv, "--heldout-bytes", "3000"]) == 0
  return out


def test_corpus_build_writes_splits_and_a_manifest_that_match(
  tmp_path, monkeypatch
):
  out = _fake_corpus(tmp_path, monkeypatch)
  manifest = json.loads((out / "manifest.json").read_text())
  (source,) = manifest["sources"]
  assert (source["package"], source["version"], source["pages"]) == (
    "fake-doc",
    "1.0-1",
    60,  # genindex.html and other.txt left out.
  )
  train_text = lzma.open(out / "train.txt.xz").read()
  heldout_text = lzma.open(out / "heldout.txt.xz").read()
  for name, data in (("train", train_text), ("heldout", heldout_text)):
    split = manifest["splits"][name]
    assert split["bytes"] == len(data)
    assert split["sha256"] == hashlib.sha256(data).hexdigest()
  # "Title" and the list items are short; "First paragraph..." is under 64
  # characters too: every page keeps them; the 120 words are its own.
  assert train_text.count(b"First paragraph, with code()") == 60 - len(
    manifest["heldout_documents"]
  )
  assert b"Quick search" not in train_text and b"print(x)" not in train_text
  assert 3000 <= len(heldout_text) < 3000 + 1200
  # The runner checks the files against the manifest.
  data = tasks.read_corpus(str(out))
  assert data.info["train"]["sha256"] == manifest["splits"]["train"]["sha256"]
  (out / "heldout.txt.xz").write_bytes(lzma.compress(heldout_text + b"!"))
  with pytest.raises(ValueError, match="not the one built"):
    tasks.read_corpus(str(out))


def test_data_windows_are_disjoint_and_each_read_once(tmp_path, monkeypatch):
  out = _fake_corpus(tmp_path, monkeypatch)
  task = tasks.lm(data=str(out))
  seq = tasks.LM_SIZES["tiny"][3]
  n = task.data["train_windows"]
  assert n == task.data["train"]["bytes"] // (seq + 1) > 100
  seen = []
  batches = task.batches(3, 8)
  for _ in range(n // 8):
    inputs, targets = next(batches)
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    seen.append(np.concatenate([inputs, targets[:, -1:]], 1))
  with pytest.raises(ValueError, match="would see a byte twice"):
    next(batches)
  # Every window once: the batches' windows are (as a multiset) among the
  # split's n disjoint windows, n // 8 * 8 of them, none twice.
  seen = np.concatenate(seen).astype(np.uint8)
  split = np.frombuffer(lzma.open(out / "train.txt.xz").read(), np.uint8)
  windows = split[: n * (seq + 1)].reshape(n, seq + 1)
  assert len(seen) == n // 8 * 8
  assert collections.Counter(map(bytes, seen)) <= collections.Counter(
    map(bytes, windows)
  )
  # Another seed, another order, the same windows.
  other = next(task.batches(4, 8))[0]
  assert not np.array_equal(other, seen[:8, :-1])


def test_lm_on_a_corpus_records_its_data_and_refuses_repeats(
  tmp_path, monkeypatch
):
  out = _fake_corpus(tmp_path, monkeypatch)
  manifest = json.loads((out / "manifest.json").read_text())
  common = ("--task", "lm", "--data", str(out), "--seeds", "0")
  done, run = _run(
    tmp_path,
    *common,
    "--steps",
    "3",
    "--batch-size",
    "4",
    "--methods",
    "plain",
    "--eval-every",
    "3",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((run / "results.json").read_text())
  data = results["settings"]["data"]
  assert data["train"]["sha256"] == manifest["splits"]["train"]["sha256"]
  assert data["heldout"]["bytes"] == manifest["splits"]["heldout"]["bytes"]
  assert data["disjoint_windows"] and data["window_bytes"] == 65
  assert data["bytes_seen_per_run"] == 3 * 4 * 65
  assert data["sources"] == ["fake-doc 1.0-1 (CC0)"]
  assert f"--data {out}" in results["settings"]["command"]
  assert "bytes seen a run (each at most once)" in done.stdout
  assert "disjoint windows, each once" in results["task"]
  assert math.isfinite(results["runs"][0]["evals"][-1]["heldout_loss"])
  # One window more than the split has: refused before training.
  steps = data["train_windows"] // 4 + 1
  refused, _ = _run(
    tmp_path,
    *common,
    "--steps",
    str(steps),
    "--batch-size",
    "4",
    name="refused",
  )
  assert refused.returncode != 0
  assert "would see bytes twice" in refused.stderr
  # Runs on other data do not merge.
  other = json.loads((run / "results.json").read_text())
  other["settings"]["data"]["train"]["sha256"] = "0" * 64
  (tmp_path / "other.json").write_text(json.dumps(other))
  merged, _ = _run(
    tmp_path,
    "--merge",
    str(run / "results.json"),
    str(tmp_path / "other.json"),
    name="m",
    devices=None,
  )
  assert merged.returncode != 0 and "same data" in merged.stderr
