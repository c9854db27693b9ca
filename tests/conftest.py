"""Test setup: four simulated CPU devices, set before JAX starts its backend.

pytest imports this file before any test module, so the flag is in place
before the first ``import jax`` of the run creates a backend.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + _FLAG
  ).strip()

# Run as their own processes by test_multiprocess.py and test_orbax.py,
# never imported here.
collect_ignore = ["multiprocess_worker.py", "orbax_worker.py"]
