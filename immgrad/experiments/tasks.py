"""The built-in tasks: real data that is on every machine, no download.

* ``digits``: scikit-learn's 8x8 handwritten digits (1,797 images, shipped
  with the package), a small Haiku CNN; held-out loss and accuracy.
* ``chars``: a byte-level Haiku transformer language model on text: the
  Python standard library's own source files (found with ``sysconfig``), or
  any file given with ``--text``; losses in bits per byte (per character
  for ASCII text, as the standard library's source nearly all is).

Both models are unmodified Haiku wrapped in ``immgrad.haiku.immediate``,
which leaves them plain Haiku outside ``immgrad.value_and_grad``: the plain
baseline trains the very same function.
"""

import dataclasses
import glob
import math
import os
import sysconfig
from typing import Any, Callable, Iterator, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import immgrad.haiku


@dataclasses.dataclass(frozen=True)
class Task:
  """What the runner needs to know about a task."""
  name: str
  description: str
  init: Callable[[int], Any]  # seed -> params
  loss_fn: Callable[..., jax.Array]  # (params, inputs, targets) -> loss
  batches: Callable[[int, int], Iterator[tuple]]  # (seed, size) -> batches
  evaluate: Callable[[Any], dict]  # params -> {"train_loss", "heldout_..."}
  loss_unit: str  # What reported losses are measured in.
  loss_scale: float  # Training loss (nats) x loss_scale = reported loss.
  default_lr: dict  # optimizer name -> learning rate


def _epochs(n: int, seed: int, size: int) -> Iterator[np.ndarray]:
  """Batches of indices into ``n`` examples, reshuffled every epoch."""
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(n)
    for i in range(n // size):
      yield order[i * size:(i + 1) * size]


# -- digits ---------------------------------------------------------------

def _cnn(images):
  x = images[..., None]
  x = jax.nn.relu(hk.Conv2D(16, 3)(x))
  x = jax.nn.relu(hk.Conv2D(32, 3, stride=2)(x))
  x = jax.nn.relu(hk.Linear(64)(hk.Flatten()(x)))
  return hk.Linear(10)(x)


def digits() -> Task:
  """scikit-learn's digits, 80/20 split (the split is fixed, seed 0)."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  data = datasets.load_digits()
  images = (data.images / 16.0).astype(np.float32)
  labels = data.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(labels))
  split = int(0.8 * len(labels))
  train, test = order[:split], order[split:]
  x_train, y_train = images[train], labels[train]
  x_test, y_test = images[test], labels[test]
  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(_cnn)))

  def loss_fn(params, images, labels):
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()

  @jax.jit
  def metrics(params, images, labels):
    logits = model.apply(params, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == labels)

  def evaluate(params):
    train_loss, _ = metrics(params, x_train, y_train)
    loss, accuracy = metrics(params, x_test, y_test)
    return {"train_loss": float(train_loss), "heldout_loss": float(loss),
            "heldout_accuracy": float(accuracy)}

  def batches(seed, size):
    for index in _epochs(len(y_train), seed, size):
      yield x_train[index], y_train[index]

  return Task(
      name="digits",
      description=(f"scikit-learn digits, {len(y_train)} train / "
                   f"{len(y_test)} held-out images, Haiku CNN "
                   "(conv 16, conv 32 stride 2, linear 64, linear 10)"),
      init=lambda seed: model.init(jax.random.PRNGKey(seed), x_train[:1]),
      loss_fn=loss_fn, batches=batches, evaluate=evaluate,
      loss_unit="nats per example", loss_scale=1.0,
      default_lr={"sgd": 0.1, "momentum": 0.03, "adam": 3e-3,
                  "adamw": 3e-3})


# -- chars ----------------------------------------------------------------

SEQ, D_MODEL, HEADS, LAYERS, VOCAB = 64, 64, 4, 2, 256


def _block(h, mask):
  a = hk.LayerNorm(-1, True, True)(h)
  a = hk.MultiHeadAttention(
      HEADS, D_MODEL // HEADS,
      w_init=hk.initializers.VarianceScaling(1.0 / LAYERS))(a, a, a, mask)
  h = h + a
  m = hk.LayerNorm(-1, True, True)(h)
  m = hk.Linear(D_MODEL, w_init=hk.initializers.VarianceScaling(
      1.0 / LAYERS))(jax.nn.gelu(hk.Linear(4 * D_MODEL)(m)))
  return h + m


def _lm(tokens):
  mask = jnp.tril(jnp.ones((SEQ, SEQ), bool))[None, None]
  h = hk.Embed(VOCAB, D_MODEL)(tokens)
  h = h + hk.get_parameter("positions", (SEQ, D_MODEL),
                           init=hk.initializers.RandomNormal(0.02))
  for _ in range(LAYERS):
    h = _block(h, mask)
  return hk.Linear(VOCAB)(hk.LayerNorm(-1, True, True)(h))


def _stdlib_text(limit: int) -> tuple[bytes, str]:
  """The standard library's ``*.py`` files, sorted by name, up to ``limit``."""
  root = sysconfig.get_paths()["stdlib"]
  parts, size = [], 0
  for path in sorted(glob.glob(os.path.join(root, "*.py"))):
    with open(path, "rb") as f:
      parts.append(f.read())
    size += len(parts[-1])
    if size >= limit:
      break
  if not parts:
    raise FileNotFoundError(
        f"no Python source files in {root}; pass --text FILE instead.")
  return b"\n".join(parts)[:limit], f"Python standard library ({root})"


def chars(text: Optional[str] = None, limit: int = 2_000_000) -> Task:
  """A byte-level transformer LM; the last 10% of the text is held out."""
  if text is None:
    data, source = _stdlib_text(limit)
  else:
    with open(text, "rb") as f:
      data, source = f.read()[:limit], text
  tokens = np.frombuffer(data, np.uint8).astype(np.int32)
  if len(tokens) < 20 * (SEQ + 1):
    raise ValueError(f"the text {source!r} is too short: {len(tokens)} "
                     f"bytes, need at least {20 * (SEQ + 1)}.")
  split = int(0.9 * len(tokens))
  train, heldout = tokens[:split], tokens[split:]
  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(_lm)))

  def windows(stream, starts):
    index = starts[:, None] + np.arange(SEQ + 1)[None]
    chunk = stream[index]
    return chunk[:, :-1], chunk[:, 1:]

  def loss_fn(params, inputs, targets):
    logits = model.apply(params, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets).mean()

  eval_loss = jax.jit(loss_fn)
  fixed = np.random.default_rng(0)
  train_eval = windows(train, fixed.integers(0, len(train) - SEQ - 1, 128))
  heldout_eval = windows(heldout,
                         fixed.integers(0, len(heldout) - SEQ - 1, 128))
  bits = 1 / math.log(2)

  def evaluate(params):
    return {"train_loss": float(eval_loss(params, *train_eval)) * bits,
            "heldout_loss": float(eval_loss(params, *heldout_eval)) * bits}

  def batches(seed, size):
    rng = np.random.default_rng(seed)
    while True:
      yield windows(train, rng.integers(0, len(train) - SEQ - 1, size))

  return Task(
      name="chars",
      description=(f"byte-level transformer LM ({LAYERS} blocks, d_model "
                   f"{D_MODEL}, {HEADS} heads, context {SEQ}) on "
                   f"{len(tokens):,} bytes of {source}, last 10% held out"),
      init=lambda seed: model.init(jax.random.PRNGKey(seed), train_eval[0]),
      loss_fn=loss_fn, batches=batches, evaluate=evaluate,
      loss_unit="bits per byte", loss_scale=bits,
      default_lr={"sgd": 0.3, "momentum": 0.1, "adam": 3e-3,
                  "adamw": 3e-3})


TASKS = {"digits": digits, "chars": chars}
