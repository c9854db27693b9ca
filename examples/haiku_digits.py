"""Train an unmodified Haiku CNN on scikit-learn's digits with immgrad.

The model is plain Haiku (``hk.Conv2D``, ``hk.Linear``); one line,
``immgrad.haiku.immediate(forward)``, makes its layers update during the
backward pass, and the optimizer becomes ``immgrad.shim(optax.adam(...))``.
The digits (1,797 8x8 images) ship with scikit-learn: no download.

    python -m pip install ".[experiments]"
    python examples/haiku_digits.py --mode updated --epochs 10

Prints the training loss and the held-out accuracy after every epoch.
"""

import argparse

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn import datasets

import immgrad
import immgrad.haiku


def forward(images):
  """A small CNN, written as for any Haiku training loop."""
  x = images[..., None]  # (batch, 8, 8, 1)
  x = jax.nn.relu(hk.Conv2D(16, 3)(x))
  x = jax.nn.relu(hk.Conv2D(32, 3, stride=2)(x))
  x = hk.Flatten()(x)
  x = jax.nn.relu(hk.Linear(64)(x))
  return hk.Linear(10)(x)


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
  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  params = model.init(jax.random.PRNGKey(args.seed), x_train[:1])
  tx = immgrad.shim(optax.adam(args.lr))
  opt_state = tx.init(params)

  def loss_fn(params, images, labels):
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  grad_fn = immgrad.value_and_grad(loss_fn, tx, mode=args.mode)

  @jax.jit
  def train_step(params, opt_state, images, labels):
    loss, grads = grad_fn(params, opt_state, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params, images, labels):
    return jnp.mean(jnp.argmax(model.apply(params, images), -1) == labels)

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
