"""``python -m benchmarks.memory_floor``: how low a step's peak memory can go.

Hand-written training steps for a stack of ``L`` tanh layers of ``D x D``
under ``lax.scan`` with adam (no immgrad), compiled with the parameters
and state donated, peak memory (XLA's ``memory_analysis``: temp +
arguments + outputs - aliased) in units of the parameters' bytes:

* ``plain``: ``jax.value_and_grad`` + ``optax.adam`` + ``apply_updates``;
* ``update stack``: a backward loop that steps each layer as soon as its
  gradient exists, writes the new adam state in place and the update into
  a stack; then ``params + updates``, as every optax training step ends;
* ``weights in place``: the same loop writing the new weights over the
  old ones, returning them (no ``apply_updates``); and the same loop as
  the backward rule of a ``jax.custom_vjp`` that returns the new weights
  and state through their cotangent slots, as immgrad carries a step.

Only the last can drop below parameters + state + one gradient's worth:
``apply_updates(params, updates)`` reads the old weights after the
backward pass, so they and a stack of updates are alive together. Then
immgrad's own steps on the same stack (``immgrad.scan`` of an immediate
``h @ w``): ``immgrad.train_step`` with ``shim(adam, atomic=False)``,
which is that last step, in ``current`` and ``updated`` mode, and with
the default atomic shim.

``--transformers`` measures docs/memory.md's transformer table instead: ``benchmarks.models``'
transformer (d_model 512, 8 heads, mlp 2048, seq 64, batch 1, adam float32)
with 12 blocks under ``hk.layer_stack``, 12 unrolled and 24 stacked; plain
training's peak in MiB and parameters' bytes, each immgrad method's as a
ratio to plain's, and for the stacked ones issue 44's floor (parameters,
state, plain's activations and one block's gradient) as the same ratio.

``--tpu`` compiles for one TPU v5e chip with no chip (libtpu on the
``PYTHONPATH``, as ``benchmarks.compile_tpu`` says), immgrad's steps as
``benchmarks.compile_tpu`` compiles them (the atomic shim committing by
select, as on the chip).
"""

import argparse
import math
import os

import jax
from jax import lax
import jax.numpy as jnp
import optax

from benchmarks import measure
from benchmarks import models
import immgrad

TRANSFORMERS = (
  ("12 blocks, hk.layer_stack", 12, True),
  ("12 blocks, unrolled", 12, False),
  ("24 blocks, hk.layer_stack", 24, True),
)
IMMGRAD_METHODS = (
  "current (in place)",
  "updated (in place)",
  "current (atomic=False)",
  "updated (atomic=False)",
  "current",
  "updated",
)


def _adam(g, m, v, count, lr=1e-3):
  """One adam step on a slice (optax.adam's arithmetic, by hand)."""
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  mh, vh = m / (1 - 0.9 ** (count + 1)), v / (1 - 0.999 ** (count + 1))
  return -lr * mh / (jnp.sqrt(vh) + 1e-8), m, v


def _loss(p, x):
  return jnp.mean(lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p)[0] ** 2)


def plain(p, opt_state, x):
  tx = optax.adam(1e-3)
  loss, g = jax.value_and_grad(_loss)(p, x)
  u, opt_state = tx.update(g, opt_state, p)
  return optax.apply_updates(p, u), opt_state, loss


def _backward(p, m, v, hs, dy, *, in_place: bool):
  """The backward loop stepping each layer: (dX, new weights or update
  stack, new m, new v).
  """

  def layer(carry, i):
    d, out, m, v = carry
    w, h = (p if not in_place else out)[i], hs[i]
    z = jnp.tanh(h @ w)
    dz = d * (1 - z**2)
    u, m_i, v_i = _adam(h.T @ dz, m[i], v[i], 0)
    out = out.at[i].set(w + u if in_place else u)
    # The state is written after the weights (a data dependence that adds
    # -0.0 unless the new weight is NaN): else XLA CPU fuses the weights'
    # update with reads of the old state and copies the state each time.
    seen = out[i, 0, 0]
    after = jnp.where(jnp.isnan(seen), seen, jnp.asarray(-0.0, seen.dtype))
    return (
      dz @ w.T,
      out,
      m.at[i].set(m_i + after),
      v.at[i].set(v_i + after),
    ), None

  start = p if in_place else jnp.zeros_like(p)
  rows = jnp.arange(p.shape[0])[::-1]
  return lax.scan(layer, (dy, start, m, v), rows)[0]


def in_loop(p, m, v, x, *, in_place: bool):
  """The step with each layer stepped in the backward loop."""
  y, hs = lax.scan(lambda h, w: (jnp.tanh(h @ w), h), x, p)
  _, out, m, v = _backward(p, m, v, hs, 2 * y / y.size, in_place=in_place)
  return (out if in_place else p + out), m, v, jnp.mean(y**2)


@jax.custom_vjp
def _stack(x, p, m, v):
  del m, v
  return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p)[0]


def _stack_fwd(x, p, m, v):
  y, hs = lax.scan(lambda h, w: (jnp.tanh(h @ w), h), x, p)
  return y, (p, m, v, hs)


def _stack_bwd(residuals, dy):
  p, m, v, hs = residuals
  return _backward(p, m, v, hs, dy, in_place=True)  # New p, m, v as cotangents.


_stack.defvjp(_stack_fwd, _stack_bwd)


def through_vjp(p, m, v, x):
  """``in_loop(in_place=True)`` as immgrad would carry it: a custom_vjp
  whose backward rule returns the new weights and state in their
  cotangent slots.
  """
  loss, vjp = jax.vjp(
    lambda p, m, v: jnp.mean(_stack(x, p, m, v) ** 2), p, m, v
  )
  return (*vjp(jnp.ones_like(loss)), loss)


@immgrad.immediate_layer
def _matmul(h, w):
  return h @ w


def _immgrad_loss(p, x):
  return jnp.mean(
    immgrad.scan(lambda h, w: (jnp.tanh(_matmul(h, w)), None), x, p)[0] ** 2
  )


def immgrad_step(mode: str, atomic: bool):
  """``(step, tx)``: immgrad's step of the same stack, in place (the
  ``(in place)`` method of ``benchmarks.models``) or atomic.
  """
  method = mode if atomic else f"{mode} (in place)"
  return models.step_for(method, _immgrad_loss, optax.adam(1e-3))


def peak(step, args, donate, sharding=None) -> float:
  """Peak bytes of ``jit(step)`` on ``args`` over the first arg's bytes."""
  shapes = jax.tree.map(
    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args
  )
  compiled = jax.jit(step, donate_argnums=donate).lower(*shapes).compile()
  return measure._peak_bytes(compiled) / _bytes(args[0])


def _bytes(tree) -> int:
  return sum(
    math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(tree)
  )


def candidate_peak(candidate: measure.Candidate, sharding=None) -> int:
  """Peak bytes of ``candidate``'s step compiled with the parameters and
  state donated: for the CPU, or as ``benchmarks.compile_tpu`` compiles it
  for ``sharding``'s chip.
  """
  if sharding is None:
    step = jax.jit(candidate.step, donate_argnums=(0, 1))
    compiled = step.lower(*measure.abstract_inputs(candidate)).compile()
    return measure._peak_bytes(compiled)
  from benchmarks import compile_tpu

  return compile_tpu.compile_for(candidate, sharding)[1]["peak_bytes"]


def floors(layers: int, width: int, batch: int, sharding=None) -> dict:
  """Each step's peak memory in parameters' bytes."""
  p = jax.ShapeDtypeStruct((layers, width, width), jnp.float32)
  x = jax.ShapeDtypeStruct((batch, width), jnp.float32)
  opt_state = jax.eval_shape(optax.adam(1e-3).init, p)
  out = {
    "plain": peak(plain, (p, opt_state, x), (0, 1), sharding),
    "update stack": peak(
      lambda p, m, v, x: in_loop(p, m, v, x, in_place=False),
      (p, p, p, x),
      (0, 1, 2),
      sharding,
    ),
    "weights in place": peak(
      lambda p, m, v, x: in_loop(p, m, v, x, in_place=True),
      (p, p, p, x),
      (0, 1, 2),
      sharding,
    ),
    "the same, a custom_vjp": peak(
      through_vjp, (p, p, p, x), (0, 1, 2), sharding
    ),
  }
  for mode in ("current", "updated"):
    for atomic in (False, True):
      step, tx = immgrad_step(mode, atomic)
      name = f"immgrad {mode}" + (" (in place)" if not atomic else "")
      state = jax.eval_shape(tx.init, p)
      candidate = measure.Candidate(name, step, p, state, (x,))
      out[name] = candidate_peak(candidate, sharding) / _bytes(p)
  return out


def transformer_peaks(blocks: int, stacked: bool, sharding=None) -> dict:
  """The transformer of docs/memory.md: plain's peak bytes, the
  parameters' bytes, and each immgrad method's peak as a ratio to plain's.

  Stacked, also issue 44's floor as a ratio to plain's peak: the
  parameters and state, plain training's activations and temporaries, and
  one block's gradient. Under the scan plain training's peak holds the
  whole gradient stack (as many bytes as the parameters) besides the rest,
  so the floor is plain's peak less the parameters' bytes plus one
  block's parameters' bytes.
  """
  candidates = models.transformer(
    blocks=blocks,
    d_model=512,
    heads=8,
    mlp_size=2048,
    seq=64,
    batch=1,
    stacked=stacked,
    methods=("plain", *IMMGRAD_METHODS),
  )
  plain_peak = candidate_peak(candidates[0], sharding)
  params = candidates[0].params
  floor = None
  if stacked:
    stacks = [a for a in jax.tree.leaves(params) if a.shape[:1] == (blocks,)]
    block = _bytes(stacks) // blocks
    floor = (plain_peak - _bytes(params) + block) / plain_peak
  return {
    "plain_bytes": plain_peak,
    "parameters_bytes": _bytes(params),
    "floor": floor,
    **{
      c.name: candidate_peak(c, sharding) / plain_peak for c in candidates[1:]
    },
  }


def print_transformers(sharding=None) -> None:
  """Prints :func:`transformer_peaks` for each of ``TRANSFORMERS``."""
  header = (f"{'model':26s} {'plain peak':>23s}", "floor", *IMMGRAD_METHODS)
  print(*header, sep=" | ")
  for name, blocks, stacked in TRANSFORMERS:
    r = transformer_peaks(blocks, stacked, sharding)
    plain_peak = (
      f"{r['plain_bytes'] / 2**20:.0f} MiB "
      f"({r['plain_bytes'] / r['parameters_bytes']:.2f}x params)"
    )
    floor = f"{r['floor']:.3f}x" if r["floor"] else "  -   "
    ratios = [f"{r[m]:.3f}x".center(len(m)) for m in IMMGRAD_METHODS]
    print(
      f"{name:26s} {plain_peak:>23s}", floor, *ratios, sep=" | ", flush=True
    )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--tpu", action="store_true")
  parser.add_argument(
    "--transformers", action="store_true", help="docs/memory.md's transformers"
  )
  args = parser.parse_args(argv)
  sharding = None
  if args.tpu:
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    from benchmarks.compile_tpu import tpu_sharding

    sharding = tpu_sharding()
  if args.transformers:
    print_transformers(sharding)
    return
  for name, ratio in floors(
    args.layers, args.width, args.batch, sharding
  ).items():
    print(f"{name:24s} {ratio:.3f}x the parameters' bytes")


if __name__ == "__main__":
  main()
