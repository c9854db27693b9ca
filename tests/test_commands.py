"""Every command the docs name prints its ``--help`` and exits 0.

argparse formats a help text only when asked, so a stray ``%`` in one
(``"95% t interval"``) breaks ``--help`` and nothing else: the runner's
``--help`` once failed with "unsupported format character". One
subprocess (a user's process, no simulated devices) imports each command
and asks it for its help; a command whose optional package is missing
(flax, equinox at the minimum versions) is skipped.
"""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMMANDS = (
  "immgrad.experiments.__main__",
  "immgrad.experiments.corpus",
  "benchmarks.__main__",
  "benchmarks.compile_tpu",
  "benchmarks.dp_estimate",
  "benchmarks.largest",
  "benchmarks.memory_floor",
  "benchmarks.multisteps",
  "examples.data_parallel",
  "examples.equinox_digits",
  "examples.flax_digits",
  "examples.haiku_digits",
  "examples.multiprocess",
  "examples.nnx_transformer",
  "examples.train_mlp",
)
SCRIPT = """
import importlib, sys
for name in sys.argv[1:]:
  try:
    module = importlib.import_module(name)
  except ModuleNotFoundError as e:
    if e.name.split(".")[0] in ("flax", "equinox"):
      print("@@", name, "skipped"); continue
    raise
  sys.argv = [name, "--help"]
  try:
    module.main()
  except SystemExit as e:
    print("@@", name, "exit", e.code)
  else:
    print("@@", name, "returned")
"""


def test_every_command_prints_its_help():
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(
    f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
  )
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  done = subprocess.run(
    [sys.executable, "-c", SCRIPT, *COMMANDS],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  said = dict(
    line.split(" ", 2)[1:]
    for line in done.stdout.splitlines()
    if line[:3] == "@@ "
  )
  wrong = {c: said.get(c) for c in COMMANDS if said.get(c) != "exit 0"}
  skipped = {c for c, r in wrong.items() if r == "skipped"}
  assert skipped <= {
    c for c in COMMANDS if "flax" in c or "nnx" in c or "equinox" in c
  }, wrong
  assert not {c: r for c, r in wrong.items() if c not in skipped}, wrong
