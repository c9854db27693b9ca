"""The user's line: outside JAX, the model libraries and immgrad.

For messages only: where an equation was traced from, where a warning
points, and which transformation a refusal names.
"""

import functools
import importlib.util
import os
import re
import sys
import traceback

from jax.extend import source_info_util

# (file under jax/_src, function) -> the public name of the transformation.
_TRANSFORMATIONS = {
  ("loops.py", "scan"): "lax.scan",
  ("loops.py", "fori_loop"): "lax.fori_loop",
  ("loops.py", "map"): "lax.map",
  ("loops.py", "while_loop"): "lax.while_loop",
  ("conditionals.py", "cond"): "lax.cond",
  ("conditionals.py", "switch"): "lax.switch",
  ("pjit.py", "cache_miss"): "jax.jit",
  ("api.py", "vmap_f"): "jax.vmap",
  ("ad_checkpoint.py", "fun_remat"): "jax.checkpoint",
}
# A layer under vmap is lifted out of it by this batching rule (layer.py).
_LAYER_FILE, _LIFTING_RULE = os.path.join("immgrad", "_src", "layer.py"), "rule"
# Built on lax.scan: reported as themselves when they are the caller.
_BUILT_ON_SCAN = ("lax.fori_loop", "lax.map")
# Libraries whose frames are not the user's line.
_LIBRARIES = (
  "jax",
  "jaxlib",
  "haiku",
  "flax",
  "equinox",
  "immgrad",
  "optax",
  "chex",
)
# One frame of source_info_util.summarize: "file:line[:column] (function)".
_FRAME = re.compile(r"^(?P<file>.*?):\d+(?::\d+)? \(.*\)$")
_FRAMES = 100  # How many of an equation's user frames to look through.


@functools.cache
def _library_dirs() -> tuple[str, ...]:
  """The installed folders of ``_LIBRARIES`` and of Python's own modules."""
  dirs = [os.path.dirname(os.__file__)]
  for name in _LIBRARIES:
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations:
      dirs.extend(spec.submodule_search_locations)
  return tuple(os.path.join(os.path.abspath(d), "") for d in dirs)


@functools.lru_cache(maxsize=4096)
def in_library(filename: str) -> bool:
  """Whether ``filename`` belongs to JAX, a model library, immgrad or Python."""
  return os.path.abspath(filename).startswith(_library_dirs())


def user_line(source_info) -> str:
  """Where an equation was traced from: the innermost frame of the user's.

  As ``source_info_util.summarize``, ``"file:line:column (function)"``, but
  past frames in Flax, Haiku, Equinox, optax and immgrad too (JAX skips
  only its own); if every frame is theirs, the innermost; if JAX kept
  none (an equation of an inlined inner program), ``"source unknown"``.
  """
  frames = source_info_util.summarize(source_info, num_frames=_FRAMES)
  lines = frames.split("\n")[::-1]  # Innermost first.
  for line in lines:
    match = _FRAME.match(line)
    if match and not in_library(match["file"]):
      return line
  return lines[0] or "source unknown"


def user_stacklevel() -> int:
  """The ``stacklevel`` at which the caller's ``warnings.warn`` names the
  user's line: the innermost frame outside the libraries (1: the caller).
  """
  frame, level = sys._getframe(1), 1
  while frame is not None and in_library(frame.f_code.co_filename):
    frame, level = frame.f_back, level + 1
  return level if frame is not None else 1


def enclosing_transformation() -> tuple[str | None, str | None]:
  """``(name, "file:line")`` of the innermost transformation around us.

  ``name`` is e.g. ``"lax.scan"``; the location is the user's line that
  called it (the innermost frame outside JAX and the model libraries).
  ``(None, None)`` if none is recognised.

  It reads the Python call stack, innermost frame first, for the public
  transformations' own functions in ``jax/_src``. If a JAX release renames
  them, the messages fall back to a generic wording; nothing else depends on
  this.
  """
  frames = traceback.extract_stack()[::-1]  # Innermost first.
  lifted = 0  # vmaps that a layer's batching rule lifted us out of.
  for i, frame in enumerate(frames):
    if frame.name == _LIFTING_RULE and frame.filename.endswith(_LAYER_FILE):
      lifted += 1
    name = _transformation_at(frame)
    if name == "jax.vmap" and lifted:  # Handled: the layer left this vmap.
      lifted -= 1
      continue
    if name is None:
      continue
    if name == "lax.scan":  # fori_loop and map call scan: name the caller.
      outer = [_transformation_at(f) for f in frames[i + 1 : i + 4]]
      name = next((n for n in outer if n in _BUILT_ON_SCAN), name)
    user = next(
      (f for f in frames[i + 1 :] if not _library_or_generated(f.filename)),
      None,
    )
    return name, (
      None
      if user is None
      else f"{os.path.basename(user.filename)}:{user.lineno}"
    )
  return None, None


def _transformation_at(frame) -> str | None:
  if os.sep + "jax" + os.sep + "_src" + os.sep not in frame.filename:
    return None
  return _TRANSFORMATIONS.get((os.path.basename(frame.filename), frame.name))


def _library_or_generated(filename: str) -> bool:
  return in_library(filename) or filename.startswith("<")
