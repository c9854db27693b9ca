"""The study's statistics and figures (``immgrad.experiments.stats``,
``--merge``), on tiny synthetic runs whose answers are worked out by hand.
"""

import contextlib
import gzip
import hashlib
import io
import json
import math
import pathlib
import time

import pytest

from immgrad.experiments import __main__ as runner
from immgrad.experiments import report
from immgrad.experiments import stats
from immgrad.experiments import train

# Student t's 0.975 quantiles: dof 1 and 2 in closed form (tan(0.475 pi);
# 0.95 sqrt(2 / (1 - 0.95^2))), the rest from printed tables (Abramowitz
# and Stegun table 26.10, to the 6 digits given there).
T975 = {
  1: math.tan(0.475 * math.pi),
  2: 0.95 * math.sqrt(2 / (1 - 0.95**2)),
  3: 3.182446,
  4: 2.776445,
  5: 2.570582,
  10: 2.228139,
  19: 2.093024,
  30: 2.042272,
}


@pytest.mark.parametrize("dof", sorted(T975))
def test_t_quantile_is_students(dof):
  # 5e-7: the tables' rounding (6 decimals); the closed forms agree to 1e-9.
  assert stats.t_quantile(0.975, dof) == pytest.approx(T975[dof], abs=5e-7)


def test_t_quantile_matches_scipy_for_every_small_dof():
  scipy_stats = pytest.importorskip("scipy.stats")
  for dof in range(1, 31):
    for q in (0.9, 0.975, 0.995):
      # Bisection to float resolution: 1e-9 relative.
      assert stats.t_quantile(q, dof) == pytest.approx(
        scipy_stats.t.ppf(q, dof), rel=1e-9
      )


# Synthetic runs of 20 steps (smoothing window 2). Plain's loss on step i
# (from 1) is 21 - i, so its smoothed loss at step i >= 2 is 21.5 - i and
# ends at 1.5. a=1 is plain shifted up by c (seed 0: 1, seed 1: 2, seed 2:
# 4): it ends at 1.5 + c, the higher final, so that is the target, which
# plain reaches at step 20 - c and a=1 at step 20: a=1 needs c more steps.
# Differences 1, 2, 4: mean 7/3, sd sqrt((16 + 1 + 25) / 9 / 2) =
# sqrt(7/3) = 1.527525, interval 7/3 +- 4.302653 x 1.527525 / sqrt(3) =
# 7/3 +- 3.794583: [-1.461250, 6.127916]. The final smoothed training
# losses differ by the same c. Held-out: plain ends at 2.0, a=1 at 2.1,
# 2.2, 2.3 (differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, 0.2 +-
# 4.302653 x 0.1 / sqrt(3) = 0.2 +- 0.248414); a=1's best held-out, 1.9
# at step 10, is 0.1 below plain's best (its final 2.0) on every seed: sd
# 0, an interval of width 0.
STEPS, SHIFT, HELDOUT = 20, {0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.1, 1: 0.2, 2: 0.3}
PLAIN = [21.0 - i for i in range(1, STEPS + 1)]


def _runs(seed):
  plain = train.Run(
    "plain",
    losses=PLAIN,
    seconds=[1.0] * STEPS,
    evals=[
      {"step": 0, "heldout_loss": 5.0},
      {"step": 10, "heldout_loss": 3.0},
      {"step": 20, "heldout_loss": 2.0},
    ],
  )
  a1 = train.Run(
    "a=1",
    losses=[x + SHIFT[seed] for x in PLAIN],
    seconds=[1.0] * STEPS,
    evals=[
      {"step": 0, "heldout_loss": 5.0},
      {"step": 10, "heldout_loss": 1.9},
      {"step": 20, "heldout_loss": 2.0 + HELDOUT[seed]},
    ],
  )
  return {"plain": plain, "a=1": a1}


def _by_seed(runs_of=_runs):
  out = {}
  for seed in SHIFT:
    runs = runs_of(seed)
    out[seed] = {
      m: (r, report.summarise(r, runs["plain"], STEPS, None))
      for m, r in runs.items()
    }
  return out


def test_against_plain_pairs_seeds_with_t_intervals():
  row = stats.against_plain(_by_seed(), STEPS, None)["a=1"]
  steps = row["steps_to_target"]
  assert steps["differences"] == [1.0, 2.0, 4.0]
  assert [steps["per_seed"][s]["plain"] for s in SHIFT] == [19, 18, 16]
  assert steps["mean"] == pytest.approx(7 / 3)
  assert steps["sd"] == pytest.approx(math.sqrt(7 / 3))
  # 1e-6: the hand computation's 7 digits.
  assert steps["low"] == pytest.approx(-1.461250, abs=1e-6)
  assert steps["high"] == pytest.approx(6.127916, abs=1e-6)
  assert steps["never"] == []
  train_loss = row["final_smoothed_train_loss"]
  assert train_loss["differences"] == pytest.approx([1.0, 2.0, 4.0])
  held = row["final_heldout_loss"]
  assert held["mean"] == pytest.approx(0.2)
  assert held["low"] == pytest.approx(0.2 - 0.248414, abs=1e-6)
  assert held["high"] == pytest.approx(0.2 + 0.248414, abs=1e-6)
  best = row["best_heldout_loss"]
  assert best["mean"] == pytest.approx(-0.1)
  assert best["high"] - best["low"] == pytest.approx(0.0, abs=1e-12)


def test_a_fixed_target_never_reached_is_reported_not_dropped():
  # Target 1.8: plain's smoothed loss 21.5 - i reaches it at step 20; a=1
  # (at least 1 higher) never does, on any seed.
  row = stats.against_plain(_by_seed(), STEPS, 1.8)["a=1"]
  steps = row["steps_to_target"]
  assert steps["n"] == 0 and steps["never"] == [0, 1, 2]
  assert [steps["per_seed"][s] for s in SHIFT] == [
    {"target": 1.8, "method": None, "plain": 20}
  ] * 3
  table = stats.table({"a=1": row}, "lr 0.1")
  assert "| a=1 | 3 |" in table and table.rstrip().endswith("| - |")


def test_a_diverged_run_is_named_with_its_seeds():
  def diverging(seed):
    runs = _runs(seed)
    if seed == 1:
      runs["a=1"].losses = runs["a=1"].losses[:5] + [math.nan]
      runs["a=1"].diverged_at = 6
    return runs

  row = stats.against_plain(_by_seed(diverging), STEPS, None)["a=1"]
  assert row["diverged"] == {"a=1": [1]} and "final_heldout_loss" not in row
  assert "a=1 diverged on seeds [1] |" in stats.table({"a=1": row}, "lr 0.1")


def _results_json(
  path, lr, methods=("plain", "a=1"), seeds=tuple(SHIFT), runs_of=_runs
):
  """A results.json as the runner writes one, with ``runs_of``' runs at lr."""
  records = []
  for seed in seeds:
    for method, r in runs_of(seed).items():
      if method in methods:
        records.append(
          dict(
            lr=lr,
            seed=seed,
            method=method,
            losses=r.losses,
            seconds=r.seconds,
            evals=r.evals,
            summary={"diverged_at": None, "compile_seconds": 1.0},
          )
        )
  settings = dict(
    task="synthetic",
    optimizer="sgd",
    lr=lr,
    steps=STEPS,
    batch_size=4,
    devices=1,
    seeds=list(seeds),
    lrs=[lr],
    eval_every=10,
    target=None,
    quick=False,
    modes=[0.0, 1.0],
    methods=list(methods),
    measure_dx=False,
    lr_sweep=False,
  )
  report.write_json(
    str(path),
    dict(
      settings=settings,
      task="synthetic runs",
      loss_unit="nats",
      machine={},
      runs=records,
    ),
  )
  return str(path)


def _merge(files, out, *flags) -> str:
  """What ``--merge files --out out flags`` prints."""
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout):
    runner.main(["--merge", *files, "--out", str(out), *flags])
  return stdout.getvalue()


def test_merge_prints_and_writes_the_paired_table_and_figures(tmp_path):
  pytest.importorskip("matplotlib")
  files = [
    _results_json(tmp_path / "a.json", 0.1),
    _results_json(tmp_path / "b.json.gz", 0.2),  # Read compressed too.
  ]
  out = tmp_path / "merged"
  printed = _merge(files, out, "--lr", "0.1")
  # The hand numbers above, as the table prints them (4 digits).
  assert (
    "| a=1 | 3 | +2.333 [-1.461, +6.128] | +0.2 [-0.04841, +0.4484] | "
    "-0.1 [-0.1, -0.1] | +2 [-1, +6] |" in printed
  )
  assert "Against plain, lr 0.2" in printed and stats.TARGET_RULE in printed
  # Both rates alike: each method's best is the first, 0.1.
  assert "each at its own best lr (plain 0.1, a=1 0.1;" in printed
  merged = report.read_json(str(out / "results.json"))
  steps = merged["against_plain"]["0.1"]["a=1"]["steps_to_target"]
  assert merged["against_plain_tuned"]["best_lr"] == {"plain": 0.1, "a=1": 0.1}
  assert steps["differences"] == [1.0, 2.0, 4.0]
  for name in ("heldout_curves", "heldout_against_lr", "steps_to_target"):
    assert (out / f"{name}.png").stat().st_size > 10_000, name


def test_write_json_rounds_nothing_and_puts_number_lists_on_one_line(
  tmp_path, monkeypatch
):
  payload = {"a": [1.25, 2.0, None], "b": {"c": ["x", "y"]}}
  report.write_json(str(tmp_path / "r.json"), payload)
  text = (tmp_path / "r.json").read_text()
  assert '"a": [1.25,2.0,null]' in text and json.loads(text) == payload
  # The same bytes each time, whatever the time (gzip records it unless
  # told not to).
  report.write_json(str(tmp_path / "1.json.gz"), payload)
  monkeypatch.setattr(time, "time", lambda: 2e9)
  report.write_json(str(tmp_path / "2.json.gz"), payload)
  first = (tmp_path / "1.json.gz").read_bytes()
  assert first == (tmp_path / "2.json.gz").read_bytes()
  assert json.loads(gzip.decompress(first)) == payload
  assert report.read_json(str(tmp_path / "1.json.gz")) == payload


def test_heldout_against_lr_is_the_seed_mean_with_its_t_interval():
  records = [
    dict(
      lr=lr, seed=seed, method=m, evals=r.evals, summary={"diverged_at": None}
    )
    for lr in (0.1, 0.2)
    for seed in SHIFT
    for m, r in _runs(seed).items()
  ]
  records[-1]["summary"] = {"diverged_at": 3}  # lr 0.2, seed 2, a=1: out.
  points = stats.against_lr(records)
  assert points["plain"] == [(0.1, 2.0, 0.0), (0.2, 2.0, 0.0)]
  (lr, mean, half), (lr2, mean2, half2) = points["a=1"]
  # Held-out 2.1, 2.2, 2.3: 2.2 +- 0.248414 (above); at 0.2 seeds 0 and
  # 1 only: 2.15 +- t(0.975, 1) x 0.070711 / sqrt(2) = 2.15 +- 0.635310.
  assert (lr, lr2) == (0.1, 0.2)
  assert mean == pytest.approx(2.2) and half == pytest.approx(
    0.248414, abs=1e-6
  )
  assert mean2 == pytest.approx(2.15) and half2 == pytest.approx(
    0.635310, abs=1e-6
  )


RESULTS = pathlib.Path(__file__).parent.parent / "docs" / "results"


def test_did_not_learn_is_a_run_that_ends_where_others_were_early():
  """Committed runs. The corpus at 4e-3 (seed 0): a=1 and a=0.5 end at
  3.88 and 3.87 bits, above the 2.31 a=-0.5 had a fifth of the way in
  (held-out, step 600 of 3,000): did not learn; plain (1.51) and a=-0.5
  learned. Digits with adam at 3e-3: updated ends 1.6x above plain in
  training loss (0.000868 against 0.000533 nats, three seeds), far below
  every method's loss a fifth of the way in: learned. A run that
  diverged is left out (chars with sgd at 0.3: a=1 on every seed).
  """
  lm = report.read_json(
    str(RESULTS / "lm_corpus_runs/corpus_small_4e-3_s0/results.json.gz")
  )["runs"]
  assert report.did_not_learn(lm, report.heldout) == {
    ("a=1", 4e-3),
    ("a=0.5", 4e-3),
  }
  digits = report.read_json(
    str(RESULTS / "faster/digits_adam/results.json.gz")
  )["runs"]
  assert report.did_not_learn(digits) == set()
  chars = report.read_json(
    str(RESULTS / "between_modes/chars_sgd/results.json.gz")
  )["runs"]
  assert all(r["summary"]["diverged_at"] for r in chars if r["method"] == "a=1")
  assert ("a=1", 0.3) not in report.did_not_learn(chars)


def _at_02(seed):
  """``_runs`` with the held-out losses of lr 0.2: plain ends 0.1 higher
  (2.1) and a=1 0.25 lower (1.85, 1.95, 2.05: mean 1.95, below its 2.2 at
  0.1): plain's best lr is 0.1, a=1's 0.2.
  """
  runs = _runs(seed)
  runs["plain"].evals = runs["plain"].evals[:2] + [
    {"step": 20, "heldout_loss": 2.1}
  ]
  runs["a=1"].evals = runs["a=1"].evals[:2] + [
    {"step": 20, "heldout_loss": 1.75 + HELDOUT[seed]}
  ]
  return runs


def test_each_method_at_its_own_best_lr_pairs_across_rates():
  # _at_02: a=1 at 0.2 against plain at 0.1, paired by seed: 1.85, 1.95,
  # 2.05 minus 2.0: -0.15, -0.05, +0.05, mean -0.05, sd 0.1, interval
  # -0.05 +- 0.248414 (as above).
  by_lr = {0.1: _by_seed(), 0.2: _by_seed(_at_02)}
  best, per_seed = stats.tuned(by_lr)
  assert best == {"plain": 0.1, "a=1": 0.2}
  assert list(per_seed) == [0, 1, 2]
  held = stats.against_plain(per_seed, STEPS, None)["a=1"]["final_heldout_loss"]
  assert held["differences"] == pytest.approx([-0.15, -0.05, 0.05])
  assert held["low"] == pytest.approx(-0.05 - 0.248414, abs=1e-6)
  assert held["high"] == pytest.approx(-0.05 + 0.248414, abs=1e-6)


def test_a_merge_of_runs_made_apart_pairs_the_seeds_both_ran(tmp_path):
  """Each method on its own grid, as a study tunes it on the chip: plain
  and a=1 at 0.1 (three seeds), a=1 at 0.2 (three seeds, its best) and
  plain at 0.2 on seed 0 only, a=1 alone at 0.05 (seed 0).
  """
  pytest.importorskip("matplotlib")
  files = [
    _results_json(tmp_path / "both.json", 0.1),
    _results_json(tmp_path / "a1.json", 0.2, ("a=1",), runs_of=_at_02),
    _results_json(tmp_path / "p.json", 0.2, ("plain",), (0,), _at_02),
    _results_json(tmp_path / "low.json", 0.05, ("a=1",), (0,)),
  ]
  out = tmp_path / "merged"
  printed = _merge(files, out, "--lr", "0.1")
  assert (
    "runs, not every method at every lr and seed (comparisons pair seeds):\n"
    "  lr 0.05: a=1 seed 0\n"
    "  lr 0.1: plain seeds 0, 1, 2; a=1 seeds 0, 1, 2\n"
    "  lr 0.2: plain seed 0; a=1 seeds 0, 1, 2\n" in printed
  )
  merged = report.read_json(str(out / "results.json"))
  # At 0.2 a=1 pairs with plain on seed 0 alone: 1.85 - 2.1 = -0.25, no
  # interval. At 0.05 nothing pairs: no comparison.
  at_02 = merged["against_plain"]["0.2"]["a=1"]
  assert at_02["seeds"] == [0]
  held = at_02["final_heldout_loss"]
  assert held["n"] == 1 and held["low"] is None
  assert held["mean"] == pytest.approx(-0.25)
  assert merged["against_plain"]["0.05"] == {}
  assert "Against plain, lr 0.05" not in printed
  # Each at its best: a=1's mean over its three seeds at 0.2 (1.95) is
  # below 0.1's (2.2) and 0.05's (2.1, one seed); plain's one seed at 0.2
  # (2.1) above its 2.0 at 0.1. Paired on all three seeds, as in
  # test_each_method_at_its_own_best_lr_pairs_across_rates.
  tuned = merged["against_plain_tuned"]
  assert tuned["best_lr"] == {"plain": 0.1, "a=1": 0.2}
  held = tuned["comparison"]["a=1"]["final_heldout_loss"]
  assert held["differences"] == pytest.approx([-0.15, -0.05, 0.05])
  assert "| 0.05 | not run |" in printed
  assert (out / "heldout_curves_tuned.png").stat().st_size > 10_000


def test_the_mode_sweep_is_not_run_on_runs_made_apart(tmp_path):
  """The mode sweep pairs each method's seeds with a=0's by position: on
  runs where a method lacks a seed it would pair the wrong seeds, so it
  says why it did not run.
  """
  pytest.importorskip("matplotlib")

  def with_a0(seed):
    runs = _runs(seed)
    return {
      **runs,
      "a=0": train.Run(
        "a=0",
        **{
          k: getattr(runs["plain"], k) for k in ("losses", "seconds", "evals")
        },
      ),
    }

  files = [
    _results_json(tmp_path / "a.json", 0.1, ("plain", "a=0"), runs_of=with_a0),
    _results_json(tmp_path / "b.json", 0.1, ("a=1",), (0, 1)),
  ]
  printed = _merge(files, tmp_path / "m")
  assert "Mode sweep: not run (it pairs every method with a=0" in printed
  assert (
    report.read_json(str(tmp_path / "m/results.json"))["mode_sweep"] is None
  )
  # The same runs with a=1 on every seed: the sweep runs.
  files[1] = _results_json(tmp_path / "c.json", 0.1, ("a=1",))
  assert "Mode sweep, " in _merge(files, tmp_path / "n")


def test_source_sha256_names_each_python_file_by_path_and_bytes(tmp_path):
  (tmp_path / "b.py").write_text("y = 2")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "a.py").write_text("x = 1")
  (tmp_path / "notes.txt").write_text("not source")
  by_hand = hashlib.sha256(b"b.py\0y = 2\0sub/a.py\0x = 1\0").hexdigest()
  assert report.source_sha256(str(tmp_path)) == by_hand
  (tmp_path / "b.py").rename(tmp_path / "c.py")  # Same bytes, new name.
  assert report.source_sha256(str(tmp_path)) != by_hand
  assert report.machine()["immgrad_source_sha256"] == report.source_sha256()
