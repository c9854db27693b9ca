"""Haiku's frame, through Haiku's private ``haiku._src.stateful``.

``immgrad.haiku`` runs ``fn`` as a JAX function of its parameters: in a
frame holding traced params, state and rng, whose state and rng it then
writes back to the caller's frame. Haiku has no public seam for that
(``hk.transform`` makes a frame only around a whole ``init``/``apply``);
its own ``hk.remat`` and ``hk.vmap`` use these same functions. Every use of
them is here; ``tests/test_haiku_models.py`` checks that they exist.
"""

from typing import Any

import haiku as hk
from haiku._src import stateful

# What this module relies on in ``haiku._src.stateful``.
USED = (
  "InternalState",
  "internal_state",
  "temporary_internal_state",
  "update_internal_state",
)

_MISSING = [name for name in USED if not hasattr(stateful, name)]
if _MISSING:
  raise ImportError(
    f"immgrad.haiku runs models in Haiku's frame through "
    f"haiku._src.stateful.{', '.join(_MISSING)}, which haiku "
    f"{hk.__version__} does not have. Install a dm-haiku release that has "
    "them (0.0.17 does), and report this to immgrad's issues."
  )


def frame(params: bool = True) -> Any:
  """The current frame: its ``params`` (None if not asked for), ``state``
  and ``rng``.
  """
  return stateful.internal_state(params=params)


def running_in(params, state, rng, share_python_state: bool = False) -> Any:
  """Context manager: Haiku code inside runs in a frame holding ``params``,
  ``state`` and ``rng``; with ``share_python_state``, module names and
  counters as in the current frame.
  """
  return stateful.temporary_internal_state(
    stateful.InternalState(params, state, rng),
    share_python_state=share_python_state,
  )


def write_back(state, rng) -> None:
  """Sets the current frame's state and rng (its params stay)."""
  stateful.update_internal_state(stateful.InternalState(None, state, rng))
