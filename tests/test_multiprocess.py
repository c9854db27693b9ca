"""Data parallel across processes: JAX's multi-process engine, unchanged.

Two local processes with 2 CPU devices each (gloo collectives over
loopback, a free port) train the same model for 3 steps in three ways (see
multiprocess_worker.py): ``shard_map`` with ``axis_name``, plain ``jit``
over the global mesh with a batch-sharded input, and FSDP-style sharded
weights. Each must give the weights of the single-process reference on the
full batch (the sequential re-linearization, ``mode="updated"``), within
test_updated.py's tolerance (atol=1e-6, rtol=1e-5: the mean over 4 devices
sums in another order), and both processes must hold bitwise identical
weights. The new weights come back with the input's sharding: replicated
stays replicated, FSDP-sharded stays sharded, and so does the optimizer
state.
"""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np

import multiprocess_problem as problem
import oracles

HERE = pathlib.Path(__file__).resolve().parent
KINDS = ("axis_name", "jit_mesh", "fsdp")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_equal_one_and_each_other(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # Each worker makes its own 2 devices.
  env["PYTHONPATH"] = os.pathsep.join(
    [str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")]
  )
  port = _free_port()
  outs = [tmp_path / f"process{i}.npz" for i in range(2)]
  workers = [
    subprocess.Popen(
      [
        sys.executable,
        str(HERE / "multiprocess_worker.py"),
        str(i),
        str(port),
        str(out),
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i, out in enumerate(outs)
  ]
  try:
    logs = [w.communicate(timeout=300)[0] for w in workers]
  finally:
    for w in workers:
      w.kill()
  for w, log in zip(workers, logs):
    assert w.returncode == 0, log[-4000:]

  first, second = (np.load(out) for out in outs)
  assert sorted(first.files) == sorted(second.files)
  for key in first.files:  # Bitwise identical across processes.
    np.testing.assert_array_equal(first[key], second[key], err_msg=key)

  history, _ = oracles.sequential_steps(
    problem.CHAIN, problem.optimizer(), problem.params(), problem.batches()
  )
  expected = jax.tree_util.tree_flatten_with_path(history[-1])[0]
  for kind in KINDS:
    for path, leaf in expected:
      np.testing.assert_allclose(
        first[kind + jax.tree_util.keystr(path)],
        np.asarray(leaf),
        atol=1e-6,
        rtol=1e-5,
        err_msg=kind,
      )
    assert bool(first[f"{kind}:same_sharding"]), kind
  # adam's mu and nu of the 3 weight matrices: split like the weights.
  assert list(first["fsdp:state_specs"]) == ["data"] * 6
  assert set(first["jit_mesh:state_specs"]) <= {"", "None"}
