"""Checkpoints of params and shim state: one ``.npz`` file, bit-exact.

For small single-host runs, with no dependency beyond NumPy; sharded,
multi-host or asynchronous checkpoints are orbax-checkpoint's, on the same
pytrees (docs/checkpoints.md).
"""

import json
import os
import tempfile
from typing import Any

import jax
import numpy as np

_MANIFEST = "__immgrad_manifest__"
_FORMAT = 1


def save_checkpoint(path: str, tree: Any) -> None:
  """Writes ``tree`` (params, shim state, or a dict of both) to ``path``.

  Each leaf is stored as its raw bits (so bfloat16 and int32 counts round-trip
  exactly) under its key path (``['params']['linear']['w']``), with a small
  JSON manifest of dtypes and shapes. Keys are paths, not positions, so params
  saved from a plain Haiku model load into the same model made immediate, and
  back. Every array is gathered onto one host and written synchronously, to a
  temporary file renamed over ``path``, so that a crash never leaves a torn
  file.

  Args:
    path: the file to write (conventionally ``*.npz``); replaced atomically.
    tree: a pytree of arrays.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, optax
    >>> import immgrad
    >>> params = {"w": jnp.ones(3)}
    >>> tx = immgrad.shim(optax.adam(1e-3))
    >>> path = os.path.join(tempfile.mkdtemp(), "step_100.npz")
    >>> immgrad.save_checkpoint(path, {"params": params,
    ...                              "opt_state": tx.init(params)})
    >>> like = {"params": params, "opt_state": tx.init(params)}
    >>> restored = immgrad.restore_checkpoint(path, like)
    >>> restored["params"]["w"]
    Array([1., 1., 1.], dtype=float32)
  """
  arrays, manifest = {}, {"format": _FORMAT, "leaves": {}}
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = jax.tree_util.keystr(keypath)
    array = np.asarray(leaf)
    manifest["leaves"][key] = {
      "dtype": array.dtype.name,
      "shape": list(array.shape),
    }
    arrays[key] = (
      np.ascontiguousarray(array)
      .reshape(-1)
      .view(np.dtype(f"u{array.dtype.itemsize}"))
    )
  arrays[_MANIFEST] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
  folder = os.path.dirname(os.path.abspath(path))
  handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
  try:
    with os.fdopen(handle, "wb") as f:
      np.savez(f, **arrays)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
  except BaseException:
    os.unlink(temporary)
    raise


def restore_checkpoint(path: str, like: Any) -> Any:
  """Reads a checkpoint from ``path`` into the structure of ``like``.

  Args:
    path: a file written by :func:`save_checkpoint`.
    like: a pytree with the structure, shapes and dtypes to restore (for
      example fresh ``params`` and ``tx.init(params)``); its values are not
      used. Leaves that are ``jax.Array``s give their sharding too.

  Returns:
    A pytree like ``like`` holding the saved values, bit for bit.

  Raises:
    ValueError: if a key is missing from the file, or stored with another
      shape or dtype; the message names the key.
  """
  with np.load(path) as archive:
    manifest = json.loads(archive[_MANIFEST].tobytes())
    if manifest.get("format") != _FORMAT:
      raise ValueError(
        f"immgrad.restore_checkpoint: {path} has format "
        f"{manifest.get('format')!r}, expected {_FORMAT}."
      )
    stored = manifest["leaves"]
    keyed, treedef = jax.tree_util.tree_flatten_with_path(like)
    missing = [
      jax.tree_util.keystr(k)
      for k, _ in keyed
      if jax.tree_util.keystr(k) not in stored
    ]
    if missing:
      raise ValueError(
        f"immgrad.restore_checkpoint: {path} has no {missing[:5]} "
        f"({len(missing)} missing); it holds {sorted(stored)[:5]}..."
      )
    leaves = []
    for keypath, template in keyed:
      key = jax.tree_util.keystr(keypath)
      dtype = np.dtype(getattr(template, "dtype", np.asarray(template).dtype))
      shape = tuple(np.shape(template))
      if (
        stored[key]["dtype"] != dtype.name
        or tuple(stored[key]["shape"]) != shape
      ):
        raise ValueError(
          f"immgrad.restore_checkpoint: {key} is stored as "
          f"{stored[key]['dtype']}{stored[key]['shape']} but expected "
          f"{dtype.name}{list(shape)}."
        )
      value = archive[key].view(dtype).reshape(shape)
      sharding = getattr(template, "sharding", None)
      leaves.append(jax.device_put(value, sharding))
  return treedef.unflatten(leaves)
