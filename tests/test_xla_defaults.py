"""The tests marked ``xla_defaults``, compiled at XLA's defaults.

The suite compiles at XLA's cheapest CPU settings (``xla_flags.py``), under
which two different programs may round the same arithmetic an ulp apart;
the properties that say they do not are tested here, in a pytest process of
their own that compiles as XLA does by default.
"""

import os
import subprocess
import sys

import pytest

import xla_flags


@pytest.mark.skipif(
  xla_flags.at_defaults(), reason="this run compiles at XLA's defaults"
)
def test_marked_tests_pass_at_xla_default_compilation():
  env = dict(os.environ)
  env[xla_flags.DEFAULTS_ENV] = "1"
  env["XLA_FLAGS"] = xla_flags.without_fast_compile(env.get("XLA_FLAGS", ""))
  env.pop("PYTEST_XDIST_WORKER", None)
  tests = os.path.dirname(os.path.abspath(__file__))
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-m", "xla_defaults", "-n", "0"]
    + ["-o", "addopts=", "-p", "no:cacheprovider", "-q", "-rs", tests],
    env=env,
    cwd=os.path.dirname(tests),
    capture_output=True,
    text=True,
    check=False,
  )
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
  # Run, not skipped as at the fast settings (-rs lists skip reasons).
  assert xla_flags.SKIPPED not in proc.stdout, proc.stdout[-6000:]
