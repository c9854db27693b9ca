"""Test setup: four simulated CPU devices, and a compilation cache.

pytest imports this file before any test module, so the flag is in place
before the first ``import jax`` of the run creates a backend.
"""

import atexit
import os
import shutil
import tempfile

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + _FLAG
  ).strip()

import jax  # pylint: disable=g-import-not-at-top  # noqa: E402

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
# test_properties' one 60 s test and test_real_models' seven last). CPU
# seconds per module, measured alone on a 2-core machine (issue 25);
# modules not listed follow in their usual order. A stale list costs time,
# never a test.
SLOWEST_FIRST = (
  "test_experiments.py",  # 235 s
  "test_auto.py",  # 157
  "test_catalogue.py",  # 110 (two processes at once)
  "test_haiku_modules.py",  # 98
  "test_haiku_models.py",  # 98
  "test_flax.py",  # 89
  "test_real_models.py",  # 79
  "test_equinox.py",  # 71
  "test_current.py",  # 64
  "test_properties.py",  # 61
  "test_parallel.py",  # 43
  "test_optax_options.py",  # 41
  "test_between_modes.py",  # 40
  "test_scan.py",  # 36
  "test_orbax.py",  # 33
  "test_reparam.py",  # 31
  "test_vmap.py",  # 28
)


def pytest_collection_modifyitems(items):
  """Modules in ``SLOWEST_FIRST`` order; tests within a module as written."""
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Run as their own processes by test_multiprocess.py and test_orbax.py,
# never imported here.
collect_ignore = ["multiprocess_worker.py", "orbax_worker.py"]
