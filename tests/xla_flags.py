"""XLA's CPU compiler at its cheapest settings, for the test suite.

The suite compiles thousands of small programs and runs each for
milliseconds, so compiling is most of its time. These flags turn off
LLVM's optimisation passes and select XLA CPU's older elemental emitters
over its fusion emitters: the suite's test time on 2 cores fell from
1,582 s to 809 s (2026-12-06, jax 0.10.2). The HLO XLA optimises, which
is where immgrad's programs differ from plain training's, is the same;
every comparison compiles both of its programs alike.

They are not XLA's defaults, and a few properties are statements about
how XLA compiles by default: that two different programs (plain training
and ``current``; a layer's backward rule and the shim's commit) round the
same arithmetic bit for bit. At these settings they differ by an ulp
(XLA contracts a multiply and an add into one fused multiply-add in one
program and not in the other). Tests of such a property carry the
``xla_defaults`` mark: the suite skips them and ``test_xla_defaults.py``
runs them in a process compiling at XLA's defaults. On a machine with an
accelerator the suite compiles at the defaults throughout.
"""

import importlib.util
import os

FAST_COMPILE = (
  "--xla_backend_optimization_level=0",
  "--xla_llvm_disable_expensive_passes=true",
  "--xla_cpu_use_fusion_emitters=false",
)

# Set to "1": compile at XLA's defaults and run every test, the marked ones
# too.
DEFAULTS_ENV = "IMMGRAD_TEST_XLA_DEFAULTS"

# Why a marked test skips at the fast settings.
SKIPPED = (
  "bit for bit only at XLA's default compilation: run by test_xla_defaults.py"
)

ACCELERATOR_MODULES = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin")


def at_defaults() -> bool:
  """Whether this process compiles at XLA's defaults."""
  return os.environ.get(DEFAULTS_ENV) == "1" or any(
    importlib.util.find_spec(name) for name in ACCELERATOR_MODULES
  )


def without_fast_compile(xla_flags: str) -> str:
  """``xla_flags`` (an ``XLA_FLAGS`` value) less :data:`FAST_COMPILE`."""
  return " ".join(f for f in xla_flags.split() if f not in FAST_COMPILE)
