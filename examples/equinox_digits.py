"""Train an unmodified Equinox CNN on scikit-learn's digits with immgrad.

The model is plain Equinox (``eqx.nn.Conv2d``, ``eqx.nn.Linear``), written
per example and called under ``jax.vmap`` as usual; the params are
``eqx.partition(model, eqx.is_inexact_array)``. One line,
``immgrad.equinox.immediate(loss_fn)``, makes its layers update during the
backward pass (once per step, on the whole batch's gradient), and the
optimizer becomes ``immgrad.shim(optax.adam(...))``. The digits (1,797 8x8
images) ship with scikit-learn: no download.

    python -m pip install ".[experiments,equinox]"
    python examples/equinox_digits.py --mode updated --epochs 10

Prints the training loss and the held-out accuracy after every epoch.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn import datasets

import immgrad
import immgrad.equinox


class CNN(eqx.Module):
  """A small CNN on one (1, 8, 8) image, as for any Equinox training loop."""

  conv1: eqx.nn.Conv2d
  conv2: eqx.nn.Conv2d
  linear1: eqx.nn.Linear
  linear2: eqx.nn.Linear

  def __init__(self, key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    self.conv1 = eqx.nn.Conv2d(1, 16, 3, padding=1, key=k1)
    self.conv2 = eqx.nn.Conv2d(16, 32, 3, stride=2, padding=1, key=k2)
    self.linear1 = eqx.nn.Linear(32 * 4 * 4, 64, key=k3)
    self.linear2 = eqx.nn.Linear(64, 10, key=k4)

  def __call__(self, image):
    x = jax.nn.relu(self.conv1(image))
    x = jax.nn.relu(self.conv2(x))
    x = jax.nn.relu(self.linear1(jnp.ravel(x)))
    return self.linear2(x)


def load_digits(seed):
  """Digits scaled to [0, 1], shaped (n, 1, 8, 8), split 80/20."""
  digits = datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[:, None]
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
  model = CNN(jax.random.PRNGKey(args.seed))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  tx = immgrad.shim(optax.adam(args.lr))
  opt_state = tx.init(params)

  def loss_fn(params, images, labels):
    logits = jax.vmap(eqx.combine(params, static))(images)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  grad_fn = immgrad.value_and_grad(
    immgrad.equinox.immediate(loss_fn), tx, mode=args.mode
  )

  @eqx.filter_jit
  def train_step(params, opt_state, images, labels):
    loss, grads = grad_fn(params, opt_state, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @eqx.filter_jit
  def accuracy(params, images, labels):
    logits = jax.vmap(eqx.combine(params, static))(images)
    return jnp.mean(jnp.argmax(logits, -1) == labels)

  rng = np.random.default_rng(args.seed)
  steps = len(y_train) // args.batch_size
  for epoch in range(1, args.epochs + 1):
    order = rng.permutation(len(y_train))
    losses = []
    for i in range(steps):
      batch = order[i * args.batch_size : (i + 1) * args.batch_size]
      params, opt_state, loss = train_step(
        params, opt_state, x_train[batch], y_train[batch]
      )
      losses.append(float(loss))
    acc = float(accuracy(params, x_test, y_test))
    print(
      f"epoch {epoch:2d}  train loss {np.mean(losses):.4f}  "
      f"test accuracy {acc:.3f}"
    )


if __name__ == "__main__":
  main()
