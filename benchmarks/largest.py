"""``python -m benchmarks.largest``: the largest model one TPU v5e chip trains.

For each method, the deepest decoder-only transformer (``hk.layer_stack``
of ``hk.remat`` blocks, adam float32, fixed width, batch and sequence)
whose training step XLA's TPU compiler fits into one v5e chip's memory,
found by bisection on the depth from shapes alone (no parameters are made
and no chip is needed: ``libtpu`` on the ``PYTHONPATH``, as
``benchmarks.compile_tpu`` says). Each probe records the compiled peak
memory and the parameter count, so the results also draw peak memory
against parameter count for each method (``--plot``).

``--check`` runs a few real steps of each method's largest model on the
chip the process sees (the TPU machine), to confirm that it fits, and
times every method at one depth that they all fit (``--time-at``, plain
training's largest by default): each method's median step over 10 steps,
plain training timed first and again last, so that the ratios say how much
the chip's own speed drifted between them.
"""

import argparse
import functools
import json
import os
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import models
import immgrad
import immgrad.haiku

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = (
  "plain",
  "current (atomic=False)",
  "updated (atomic=False)",
  "current",
  "updated",
  "current (in place)",
  "updated (in place)",
)


@functools.cache
def _model(blocks: int, d_model: int, seq: int, vocab: int):
  heads, mlp = d_model // 64, 4 * d_model

  def forward(tokens):
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    h = hk.Embed(vocab, d_model)(tokens)
    block = hk.remat(lambda h: models._block(h, mask, heads, mlp))
    h = hk.layer_stack(blocks)(block)(h)
    return hk.Linear(vocab)(hk.LayerNorm(-1, True, True)(h))

  return hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))


def step_for(method: str, blocks: int, d_model: int, seq: int, vocab: int):
  """``(step, tx)``: ``method``'s training step for the model (donate 0, 1)."""
  model = _model(blocks, d_model, seq, vocab)

  def loss_fn(params, tokens):
    logits = model.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, tokens[:, 1:]
    ).mean()

  return models.step_for(method, loss_fn, optax.adam(1e-3))


def shapes(method, blocks, d_model, seq, vocab, batch, sharding=None):
  """The step's arguments as shapes: params, optimizer state, tokens."""
  model = _model(blocks, d_model, seq, vocab)
  tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
  params = jax.eval_shape(
    lambda t: model.init(jax.random.PRNGKey(0), t[:, :-1]), tokens
  )
  _, tx = step_for(method, blocks, d_model, seq, vocab)
  opt_state = jax.eval_shape(tx.init, params)
  place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  return jax.tree.map(place, (params, opt_state, tokens))


def probe(method, blocks, d_model, seq, vocab, batch, sharding) -> dict:
  """Whether the step compiles for ``sharding``'s chip; its peak and size."""
  from benchmarks import compile_tpu  # Sets libtpu's environment first.
  from benchmarks import measure

  step, _ = step_for(method, blocks, d_model, seq, vocab)
  args = shapes(method, blocks, d_model, seq, vocab, batch)
  count = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(args[0]))
  candidate = measure.Candidate(method, step, *args[:2], args[2:])
  out = {"blocks": blocks, "parameters": count}
  try:
    compiled, figures = compile_tpu.compile_for(candidate, sharding)
  except Exception as e:  # XLA says the program does not fit.
    if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
      raise
    return {**out, "fits": False, "error": str(e).splitlines()[0][:300]}
  del compiled
  return {**out, "fits": True, "peak_bytes": figures["peak_bytes"]}


def largest(method, d_model, seq, vocab, batch, sharding, lo, hi) -> dict:
  """The deepest model that fits, by bisection between ``lo`` blocks
  (taken to fit) and ``hi`` (taken not to); every probe made.
  """
  probes = []
  while hi - lo > 1:
    mid = (lo + hi) // 2
    start = time.perf_counter()
    p = probe(method, mid, d_model, seq, vocab, batch, sharding)
    p["seconds"] = time.perf_counter() - start
    print(f"{method}: {mid} blocks {p['fits']}", file=sys.stderr, flush=True)
    probes.append(p)
    lo, hi = (mid, hi) if p["fits"] else (lo, mid)
  fitting = [p for p in probes if p["fits"]]
  if not fitting:
    raise SystemExit(f"{method}: {lo} blocks (--min-blocks) do not fit.")
  return {"largest": max(fitting, key=lambda p: p["blocks"]), "probes": probes}


def plot(results: dict, path: str) -> None:
  """Peak memory against parameter count, one line per method: each
  point a depth the chip's compiler accepted, the last its largest.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  methods = results["methods"]
  for i, (method, r) in enumerate(methods.items()):
    fits = sorted(
      (p["parameters"] / 1e6, p["peak_bytes"] / 2**30)
      for p in r["probes"]
      if p["fits"]
    )
    # Each line narrower than the ones before it: a line that coincides
    # with an earlier one is drawn inside it.
    lw = 1.5 * (len(methods) - i)
    ax.plot(*zip(*fits), marker="o", ms=lw + 3, label=method, lw=lw)
  ax.set_xlabel("parameters (millions)")
  ax.set_ylabel("compiled peak memory (GiB, XLA's memory analysis)")
  s = results["settings"]
  ax.set_title(
    f"TPU v5e, d_model {s['d_model']}, seq {s['seq']}, batch {s['batch']}, "
    "adam f32, remat"
  )
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def check_on_chip(method, blocks, d_model, seq, vocab, batch, steps=3):
  """Median seconds of ``steps`` real steps of the model on this chip
  (after one step of warm-up, which compiles it), and the last loss.
  """
  step, tx = step_for(method, blocks, d_model, seq, vocab)
  model = _model(blocks, d_model, seq, vocab)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, vocab)
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[:, :-1])
  opt_state = jax.jit(tx.init)(params)
  step = jax.jit(step, donate_argnums=(0, 1))
  times = []
  for _ in range(steps + 1):
    start = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, tokens)
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - start)
  return {
    "median_step_seconds": float(np.median(times[1:])),
    "loss": float(loss),
  }


def time_at(blocks, methods, size, steps=10) -> dict:
  """Each method's median step at ``blocks`` blocks on this chip, over
  plain training's: plain timed first and again last (``plain_again``).
  """
  d_model, seq, vocab, batch = size
  order = ["plain", *(m for m in methods if m != "plain"), "plain"]
  seconds = {}
  for i, method in enumerate(order):
    r = check_on_chip(method, blocks, d_model, seq, vocab, batch, steps)
    key = "plain_again" if i == len(order) - 1 else method
    seconds[key] = r["median_step_seconds"]
    print(f"{key} at {blocks} blocks: {seconds[key]:.4f} s", flush=True)
  return {
    "blocks": blocks,
    "steps": steps,
    "median_step_seconds": seconds,
    "over_plain": {m: t / seconds["plain"] for m, t in seconds.items()},
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.largest", description=__doc__.splitlines()[0]
  )
  parser.add_argument("--methods", nargs="*", default=list(METHODS))
  parser.add_argument("--d-model", type=int, default=1024)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--min-blocks", type=int, default=0)
  parser.add_argument("--max-blocks", type=int, default=128)
  parser.add_argument("--check", action="store_true")
  parser.add_argument(
    "--time-at",
    type=int,
    help="with --check: the depth every method is timed at (default: "
    "plain training's largest)",
  )
  parser.add_argument(
    "--plot", help="draw the results file's probes into this PNG and stop"
  )
  parser.add_argument(
    "--out", default=os.path.join(HERE, "results_largest_tpu_v5e.json")
  )
  args = parser.parse_args(argv)
  size = (args.d_model, args.seq, args.vocab, args.batch)
  if args.plot:
    with open(args.out) as f:
      plot(json.load(f), args.plot)
    return 0
  if args.check:
    with open(args.out) as f:
      results = json.load(f)
    for method in args.methods:
      blocks = results["methods"][method]["largest"]["blocks"]
      results["methods"][method]["chip"] = check_on_chip(
        method, blocks, *size[:3], args.batch
      )
      print(method, blocks, results["methods"][method]["chip"], flush=True)
    results["step_time"] = time_at(
      args.time_at or results["methods"]["plain"]["largest"]["blocks"],
      args.methods,
      size,
    )
  else:
    from benchmarks import compile_tpu

    sharding = compile_tpu.tpu_sharding()
    results = {
      "settings": {
        "d_model": args.d_model,
        "seq": args.seq,
        "batch": args.batch,
        "vocab": args.vocab,
        "optimizer": "adam(1e-3), float32",
        "model": "hk.layer_stack of hk.remat pre-LN blocks",
        "chip": "TPU v5e (one chip), compiled with no chip",
        "searched_blocks": [args.min_blocks, args.max_blocks],
      },
      "methods": {},
    }
    for method in args.methods:
      results["methods"][method] = largest(
        method, *size, sharding, args.min_blocks, args.max_blocks + 1
      )
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)
  for method, r in results["methods"].items():
    best = r["largest"]
    print(
      f"{method}: {best['blocks']} blocks, {best['parameters']:,} parameters"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
