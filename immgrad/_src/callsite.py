"""Which JAX transformation a layer was called inside, and from where.

For error messages only: a refusal names the one transformation it found
and the user's line that called it, rather than listing every candidate.
It reads the Python call stack, innermost frame first, for the public
transformations' own functions in ``jax/_src``. If a JAX release renames
them, the messages fall back to a generic wording; nothing else depends on
this.
"""

import os
import traceback

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
_LIBRARIES = tuple(
  os.sep + name + os.sep
  for name in (
    "jax",
    "jaxlib",
    "haiku",
    "flax",
    "equinox",
    "immgrad",
    "optax",
    "chex",
  )
)


def enclosing_transformation() -> tuple[str | None, str | None]:
  """``(name, "file:line")`` of the innermost transformation around us.

  ``name`` is e.g. ``"lax.scan"``; the location is the user's line that
  called it (the innermost frame outside JAX and the model libraries).
  ``(None, None)`` if none is recognised.
  """
  frames = traceback.extract_stack()[::-1]  # Innermost first.
  lifted = 0  # vmaps that a layer's batching rule lifted us out of.
  for i, frame in enumerate(frames):
    if frame.name == _LIFTING_RULE and frame.filename.endswith(_LAYER_FILE):
      lifted += 1
    name = _match(frame)
    if name == "jax.vmap" and lifted:  # Handled: the layer left this vmap.
      lifted -= 1
      continue
    if name is None:
      continue
    if name == "lax.scan":  # fori_loop and map call scan: name the caller.
      outer = [_match(f) for f in frames[i + 1 : i + 4]]
      name = next((n for n in outer if n in _BUILT_ON_SCAN), name)
    user = next(
      (f for f in frames[i + 1 :] if not _in_library(f.filename)), None
    )
    return name, (
      None
      if user is None
      else f"{os.path.basename(user.filename)}:{user.lineno}"
    )
  return None, None


def _match(frame) -> str | None:
  if os.sep + "jax" + os.sep + "_src" + os.sep not in frame.filename:
    return None
  return _TRANSFORMATIONS.get((os.path.basename(frame.filename), frame.name))


def _in_library(filename: str) -> bool:
  return any(part in filename for part in _LIBRARIES) or filename.startswith(
    "<"
  )
