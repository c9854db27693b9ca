"""The example scripts run as the README says and do what they print."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*args):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
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


def test_haiku_digits_learns():
  out = _run("examples/haiku_digits.py", "--epochs", "2")
  accuracy = [float(a) for a in re.findall(r"test accuracy ([\d.]+)", out)]
  assert len(accuracy) == 2 and accuracy[-1] > 0.8, out


def test_multiprocess_example_agrees_across_processes():
  out = _run("examples/multiprocess.py", "--launch", "2")
  sums = re.findall(r"process (\d): sum of l1.w (\S+)", out)
  assert sorted(p for p, _ in sums) == ["0", "1"], out
  assert sums[0][1] == sums[1][1], out
