"""The example scripts (docs/examples.md) run as documented and do what they
print: each is run as a user would, in a subprocess, in a short setting.

Tolerances: an example that compares two runs prints the largest weight
difference, held to 1e-6, or the relative loss difference, held to 1e-5:
float32 rounding (its ulp at 1 is 1.2e-7) of weights and losses of size
about 1, compounded over the steps, where a wrong step (dX at the new
weights, a gradient summed over devices instead of averaged) moves the
weights by about the learning rate (1e-3 and more) and the loss by more.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*args):
  env = dict(os.environ)
  # One device, as a user's process has (the suite simulates 4); the
  # suite's fast-compile flags kept.
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
  )
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [sys.executable, *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  return done.stdout


def _needs(library):
  """Skips the test when ``library`` (a package extra) is not installed."""
  if importlib.util.find_spec(library) is None:
    pytest.skip(f"the example needs {library}, which is not installed")


def _difference(out, what):
  return float(re.search(rf"{what} difference (\S+)", out).group(1))


def _losses(out):
  return [float(v) for v in re.findall(r"loss ([\d.]+)", out)]


def test_train_mlp_current_is_plain_and_learns():
  out = _run("examples/train_mlp.py", "--steps", "30")
  rows = re.findall(r"^\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
  assert len(rows) >= 5, out
  first, last = rows[0], rows[-1]
  for method in range(3):  # plain, current, updated
    assert float(last[method]) < 0.5 * float(first[method]), out
  assert _difference(out, "relative loss") <= 1e-5, out


def test_nnx_transformer_current_is_plain_and_learns():
  _needs("flax")
  out = _run("examples/nnx_transformer.py", "--steps", "20")
  assert _difference(out, "relative") <= 1e-5, out
  losses = _losses(out)
  assert len(losses) >= 5 and losses[-1] < 0.7 * losses[0], out


def test_data_parallel_equals_one_device():
  out = _run("examples/data_parallel.py", "--steps", "30")
  assert "(4 devices)" in out, out
  assert _difference(out, "largest weight") <= 1e-6, out
  losses = _losses(out)
  assert len(losses) >= 5 and losses[-1] < 0.5 * losses[0], out


@pytest.mark.parametrize(
  "example, library",
  [
    ("haiku_digits.py", "haiku"),
    ("flax_digits.py", "flax"),
    ("equinox_digits.py", "equinox"),
  ],
)
def test_digits_example_learns(example, library):
  _needs(library)
  out = _run(f"examples/{example}", "--epochs", "2")
  accuracy = [float(a) for a in re.findall(r"test accuracy ([\d.]+)", out)]
  assert len(accuracy) == 2 and accuracy[-1] > 0.8, out


def test_multiprocess_example_agrees_across_processes():
  out = _run("examples/multiprocess.py", "--launch", "2")
  sums = re.findall(r"process (\d): sum of l1.w (\S+)", out)
  assert sorted(p for p, _ in sums) == ["0", "1"], out
  assert sums[0][1] == sums[1][1], out
