"""`import immgrad` loads no model library; `immgrad.haiku` loads Haiku on use.

Each check runs in a fresh interpreter: this test process has long since
imported Haiku, Flax and Equinox through other test modules.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARIES = ("haiku", "flax", "equinox", "orbax")


def _run(code):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  done = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout.split()


def test_import_immgrad_loads_no_model_library():
  loaded = _run(
    "import sys, immgrad\n"
    f"print(*[m for m in {LIBRARIES!r} if m in sys.modules])"
  )
  assert not loaded, f"import immgrad loaded {loaded}"


@pytest.mark.parametrize(
  "name,library", [("haiku", "haiku"), ("flax", "flax"), ("equinox", "equinox")]
)
def test_the_adapter_loads_its_library_on_use(name, library):
  pytest.importorskip(library)
  loaded = _run(
    "import sys, immgrad\n"
    f"immgrad.{name}.immediate\n"
    f"print({library!r} in sys.modules)"
  )
  assert loaded == ["True"]
