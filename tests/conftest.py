"""Test setup: four simulated CPU devices, fast compiling, a compilation cache.

pytest imports this file before any test module, so the flags are in place
before the first ``import jax`` of the run creates a backend.
"""

import atexit
import os
import shutil
import tempfile

import pytest

import xla_flags

_AT_DEFAULTS = xla_flags.at_defaults()
_FLAGS = ("--xla_force_host_platform_device_count=4",) + (
  () if _AT_DEFAULTS else xla_flags.FAST_COMPILE
)
for _FLAG in _FLAGS:
  if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " " + _FLAG
    ).strip()

import jax

# The tests build their models, optimizers and jitted steps afresh (each
# oracle loop jits its own closure), so JAX's in-memory caches miss and the
# same programs are compiled again and again. JAX's persistent cache keys
# a program by its HLO, options and devices, and serves the executable
# compiled before: the same machine code, so the same numbers. Measured:
# cost_analysis() and memory_analysis() of a served executable equal the
# compiled one's, and its as_text() differs only in debug metadata (the
# numbering of source locations), which test_benchmarks does not read.
# One directory per process (each xdist worker imports this file), made
# afresh and removed at exit: JAX writes entries without a lock (it takes
# one only to evict, never here: no size limit), so no two processes may
# share it. Subprocesses that tests start do not inherit jax.config.
_CACHE = tempfile.mkdtemp(prefix="immgrad-test-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# The order xdist hands the modules out in (setup.cfg: --dist loadfile
# --no-loadscope-reorder, so collection order): the slowest first, so that
# the two workers finish together instead of one running a slow module
# alone at the end (xdist's own order, by number of tests, put
# test_properties' one 60 s test and test_real_models' seven last).
# Seconds of test time per module at the fast settings, from a whole run
# on a 2-core machine (2026-12-06, --durations=0); modules not listed
# follow in their usual order. A stale list costs time,
# never a test.
SLOWEST_FIRST = (
  "test_experiments.py",  # 168 s
  "test_catalogue.py",  # 93 (two processes at once)
  "test_xla_defaults.py",  # 65 (a pytest process at XLA's defaults)
  "test_examples.py",  # 122 alone on a busy machine (7 example scripts)
  "test_real_models.py",  # 43
  "test_equinox.py",  # 41
  "test_flax.py",  # 41
  "test_auto.py",  # 40
  "test_haiku_models.py",  # 40
  "test_benchmarks.py",  # 39
  "test_haiku_modules.py",  # 35
  "test_properties.py",  # 26
  "test_scan.py",  # 26
  "test_parallel.py",  # 26
  "test_current.py",  # 20
  "test_reparam.py",  # 17
  "test_orbax.py",  # 17
)


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "xla_defaults: holds only as XLA compiles by default (tests/xla_flags.py)",
  )


def pytest_collection_modifyitems(items):
  """Modules in ``SLOWEST_FIRST`` order; tests within a module as written.

  Tests marked ``xla_defaults`` skip unless this process compiles at XLA's
  defaults; ``test_xla_defaults.py`` runs them in one that does.
  """
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  if not _AT_DEFAULTS:
    skip = pytest.mark.skip(reason=xla_flags.SKIPPED)
    for item in items:
      if item.get_closest_marker("xla_defaults"):
        item.add_marker(skip)


# Run as their own processes by test_multiprocess.py and test_orbax.py,
# never imported here.
collect_ignore = ["multiprocess_worker.py", "orbax_worker.py"]
