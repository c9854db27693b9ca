"""Train an unmodified Flax NNX transformer language model with immgrad.

A small decoder-only transformer (``nnx.Embed``, pre-norm blocks of
``nnx.MultiHeadAttention`` with a causal mask and an ``nnx.Linear`` MLP)
learns to predict the next byte of this file's own source: no download.
Flax's own loop, ``nnx.Optimizer`` under ``nnx.jit``, with two changes: the
optimizer is ``immgrad.shim(optax.adamw(...))`` and the step's gradient
comes from ``immgrad.value_and_grad`` of ``immgrad.flax.immediate(loss)``.
First it checks that ``mode="current"`` takes the same step as plain
``nnx.value_and_grad``.

    python -m pip install ".[flax]"
    python examples/nnx_transformer.py --mode updated --steps 300

Prints that check, then the training loss every tenth of the run.
"""

import argparse
import functools
import pathlib

from flax import nnx
import jax.numpy as jnp
import numpy as np
import optax

import immgrad
import immgrad.flax


class Block(nnx.Module):
  """Pre-norm self-attention and MLP, each added to the residual stream."""

  def __init__(self, dim, heads, rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attention(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
  """Bytes in, next-byte logits out."""

  def __init__(self, context, dim, heads, depth, rngs):
    self.embed = nnx.Embed(256, dim, rngs=rngs)
    self.position = nnx.Embed(context, dim, rngs=rngs)
    self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(depth)])
    self.norm = nnx.LayerNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, 256, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[-1]))
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def loss_fn(model, tokens):
  logits = model(tokens[:, :-1])
  labels = tokens[:, 1:]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@functools.partial(nnx.jit, static_argnames="mode")
def train_step(model, optimizer, tokens, mode):
  """One step of ``model`` in place: immgrad's in ``mode``, or "plain"."""
  if mode == "plain":  # Flax's ordinary step, for comparison.
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
  else:
    graphdef, params = nnx.split(model, nnx.Param)
    immediate = immgrad.flax.immediate(
      lambda params, tokens: loss_fn(nnx.merge(graphdef, params), tokens)
    )
    grad_fn = immgrad.value_and_grad(immediate, optimizer.tx, mode=mode)
    loss, grads = grad_fn(params, optimizer.opt_state, tokens)
  optimizer.update(model, grads)
  return loss


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--mode", default="updated", help="current, updated or a number"
  )
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args()
  mode = args.mode if args.mode in ("current", "updated") else float(args.mode)

  text = np.frombuffer(pathlib.Path(__file__).read_bytes(), np.uint8)
  rng = np.random.default_rng(0)

  def batch(context=64):
    start = rng.integers(0, len(text) - context - 1, 16)
    return text[start[:, None] + np.arange(context + 1)].astype(np.int32)

  model = Transformer(context=64, dim=64, heads=4, depth=2, rngs=nnx.Rngs(0))
  adamw = optax.adamw(args.lr, weight_decay=1e-4)

  # mode="current" is ordinary training: one step each way, then the loss.
  # (Not the weights: adam makes full-size steps of the key bias's gradient,
  # zero but for rounding, which change no output.)
  plain, current, tokens = nnx.clone(model), nnx.clone(model), batch()
  tx = immgrad.shim(adamw)
  train_step(plain, nnx.Optimizer(plain, adamw, wrt=nnx.Param), tokens, "plain")
  train_step(
    current, nnx.Optimizer(current, tx, wrt=nnx.Param), tokens, "current"
  )
  tokens = batch()
  after = [float(loss_fn(m, tokens)) for m in (plain, current)]
  gap = abs(after[1] - after[0]) / after[0]
  print(
    f"one step from the same weights, then the loss: plain {after[0]:.6f}, "
    f"current {after[1]:.6f}, relative difference {gap:.1e}"
  )

  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  every = max(1, args.steps // 10)
  for i in range(1, args.steps + 1):
    loss = train_step(model, optimizer, batch(), mode)
    if i == 1 or i % every == 0:
      print(f"step {i:4d}  loss {float(loss):.4f}  (mode {mode})")


if __name__ == "__main__":
  main()
