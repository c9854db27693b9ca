"""Train an unmodified Flax NNX CNN on scikit-learn's digits with immgrad.

The model is plain NNX (``nnx.Conv``, ``nnx.Linear``, ``nnx.Dropout``); one
line, ``immgrad.flax.immediate(loss_fn)``, makes its layers update during
the backward pass, and the optimizer becomes
``immgrad.shim(optax.adam(...))``. The params tree is NNX's own
``nnx.split(model, nnx.Param)`` state. The digits (1,797 8x8 images) ship
with scikit-learn: no download.

    python -m pip install ".[experiments,flax]"
    python examples/flax_digits.py --mode updated --epochs 10

Prints the training loss and the held-out accuracy after every epoch.
"""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn import datasets

import immgrad
import immgrad.flax


class CNN(nnx.Module):
  """A small CNN, written as for any NNX training loop."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.linear1 = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
    self.linear2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, images):
    x = images[..., None]  # (batch, 8, 8, 1)
    x = nnx.relu(self.conv1(x))
    x = nnx.relu(self.conv2(x))
    x = self.dropout(x.reshape(x.shape[0], -1))
    x = nnx.relu(self.linear1(x))
    return self.linear2(x)


def load_digits(seed):
  """Digits scaled to [0, 1], split 80/20 in a fixed random order."""
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(labels))
  split = int(0.8 * len(labels))
  train, test = order[:split], order[split:]
  return (images[train], labels[train]), (images[test], labels[test])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--mode", default="updated", choices=["updated", "current"]
  )
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()

  (x_train, y_train), (x_test, y_test) = load_digits(args.seed)
  model = CNN(nnx.Rngs(args.seed))
  # The parameters are trained; the rest (the dropout rng's key and count)
  # is state, carried through the step as the loss's aux.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = immgrad.shim(optax.adam(args.lr))
  opt_state = tx.init(params)

  def loss_fn(params, rest, images, labels):
    # copy=True: fresh Variables, so dropout can advance its rng in here.
    model = nnx.merge(graphdef, params, rest, copy=True)
    logits = model(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean(), nnx.state(model, nnx.Not(nnx.Param))

  grad_fn = immgrad.value_and_grad(
    immgrad.flax.immediate(loss_fn), tx, mode=args.mode, has_aux=True
  )

  @jax.jit
  def train_step(params, opt_state, rest, images, labels):
    (loss, rest), grads = grad_fn(params, opt_state, rest, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, rest, loss

  @jax.jit
  def accuracy(params, rest, images, labels):
    model = nnx.merge(graphdef, params, rest, copy=True)
    model.eval()
    return jnp.mean(jnp.argmax(model(images), -1) == labels)

  rng = np.random.default_rng(args.seed)
  steps = len(y_train) // args.batch_size
  for epoch in range(1, args.epochs + 1):
    order = rng.permutation(len(y_train))
    losses = []
    for i in range(steps):
      batch = order[i * args.batch_size : (i + 1) * args.batch_size]
      params, opt_state, rest, loss = train_step(
        params, opt_state, rest, x_train[batch], y_train[batch]
      )
      losses.append(float(loss))
    acc = float(accuracy(params, rest, x_test, y_test))
    print(
      f"epoch {epoch:2d}  train loss {np.mean(losses):.4f}  "
      f"test accuracy {acc:.3f}"
    )


if __name__ == "__main__":
  main()
