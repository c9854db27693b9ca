"""The built-in tasks: real data that is on every machine, no download.

Digits (scikit-learn's) and bytes of text (the Python standard library's
source, ``--text`` or a ``--data`` corpus), each model unmodified Haiku in
``immgrad.haiku.immediate``, so that the plain baseline trains the very
same function.
"""

import dataclasses
import functools
import glob
import hashlib
import json
import lzma
import math
import os
import sysconfig
from typing import Any, Callable, Iterator

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
  default_optimizer: str = "adam"
  # Text tasks: what the run reads (:func:`_text_task`); None for the rest.
  data: dict | None = None


def _epochs(n: int, seed: int, size: int) -> Iterator[np.ndarray]:
  """Batches of indices into ``n`` examples, reshuffled every epoch."""
  rng = np.random.default_rng(seed)
  while True:
    order = rng.permutation(n)
    for i in range(n // size):
      yield order[i * size : (i + 1) * size]


# -- digits ---------------------------------------------------------------


def _cnn(images):
  x = images[..., None]
  x = jax.nn.relu(hk.Conv2D(16, 3)(x))
  x = jax.nn.relu(hk.Conv2D(32, 3, stride=2)(x))
  x = jax.nn.relu(hk.Linear(64)(hk.Flatten()(x)))
  return hk.Linear(10)(x)


DEEP_MLP_BLOCKS, DEEP_MLP_WIDTH = 16, 64


def _deep_mlp(images):
  """Linear in, 16 residual blocks ``h + Linear(relu(h))``, linear out."""
  h = hk.Linear(DEEP_MLP_WIDTH)(hk.Flatten()(images))
  for _ in range(DEEP_MLP_BLOCKS):
    # He init scaled by 1/depth: the residual stream's variance grows by
    # about (1 + 1/16)^16 ~ e over the stack, not 2^16.
    h = h + hk.Linear(
      DEEP_MLP_WIDTH,
      w_init=hk.initializers.VarianceScaling(2.0 / DEEP_MLP_BLOCKS),
    )(jax.nn.relu(h))
  return hk.Linear(10)(jax.nn.relu(h))


def _digits_data():
  from sklearn import datasets

  # sklearn's annotations allow the (X, y) pair of return_X_y=True.
  data: Any = datasets.load_digits()
  images = (data.images / 16.0).astype(np.float32)
  labels = data.target.astype(np.int32)
  order = np.random.default_rng(0).permutation(len(labels))
  split = int(0.8 * len(labels))
  train, test = order[:split], order[split:]
  return images[train], labels[train], images[test], labels[test]


def digits() -> Task:
  """scikit-learn's digits, 80/20 split (the split is fixed, seed 0)."""
  return _digits_task(
    "digits",
    _cnn,
    "Haiku CNN (conv 16, conv 32 stride 2, linear 64, linear 10)",
    {"sgd": 0.1, "momentum": 0.03, "adam": 3e-3, "adamw": 3e-3},
  )


def deep_mlp() -> Task:
  """The digits through an 18-layer residual MLP (16 hidden blocks).

  18 immediate layers in a row, unrolled: where a per-layer second-order
  effect can compound.
  """
  return _digits_task(
    "deep_mlp",
    _deep_mlp,
    f"residual Haiku MLP, {DEEP_MLP_BLOCKS + 2} linear layers (in, "
    f"{DEEP_MLP_BLOCKS} blocks h + Linear(relu(h)), out), width "
    f"{DEEP_MLP_WIDTH}",
    {"sgd": 0.0125, "momentum": 0.003, "adam": 1e-3, "adamw": 1e-3},
  )


def _digits_task(name, forward, model_description, default_lr) -> Task:
  x_train, y_train, x_test, y_test = _digits_data()
  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))

  def loss_fn(params, images, labels):
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, labels
    ).mean()

  @jax.jit
  def metrics(params, images, labels):
    logits = model.apply(params, images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return loss.mean(), jnp.mean(jnp.argmax(logits, -1) == labels)

  def evaluate(params):
    train_loss, _ = metrics(params, x_train, y_train)
    loss, accuracy = metrics(params, x_test, y_test)
    return {
      "train_loss": float(train_loss),
      "heldout_loss": float(loss),
      "heldout_accuracy": float(accuracy),
    }

  def batches(seed, size):
    for index in _epochs(len(y_train), seed, size):
      yield x_train[index], y_train[index]

  return Task(
    name=name,
    description=(
      f"scikit-learn digits, {len(y_train)} train / "
      f"{len(y_test)} held-out images, {model_description}"
    ),
    init=lambda seed: model.init(jax.random.PRNGKey(seed), x_train[:1]),
    loss_fn=loss_fn,
    batches=batches,
    evaluate=evaluate,
    loss_unit="nats per example",
    loss_scale=1.0,
    default_lr=default_lr,
  )


# -- chars ----------------------------------------------------------------

SEQ, D_MODEL, HEADS, LAYERS, VOCAB = 64, 64, 4, 2, 256
# deep_transformer: 12 narrow blocks under hk.layer_stack, shorter context.
DEEP_SEQ, DEEP_D_MODEL, DEEP_HEADS, DEEP_LAYERS = 32, 32, 4, 12


def _block(h, mask, d_model, heads, layers):
  a = hk.LayerNorm(-1, True, True)(h)
  a = hk.MultiHeadAttention(
    heads,
    d_model // heads,
    w_init=hk.initializers.VarianceScaling(1.0 / layers),
  )(a, a, a, mask)
  h = h + a
  m = hk.LayerNorm(-1, True, True)(h)
  m = hk.Linear(d_model, w_init=hk.initializers.VarianceScaling(1.0 / layers))(
    jax.nn.gelu(hk.Linear(4 * d_model)(m))
  )
  return h + m


def _lm_of(seq, d_model, heads, layers, stacked):
  """A pre-LayerNorm transformer LM; ``stacked``: blocks in hk.layer_stack."""

  def lm(tokens):
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    h = hk.Embed(VOCAB, d_model)(tokens)
    h = h + hk.get_parameter(
      "positions", (seq, d_model), init=hk.initializers.RandomNormal(0.02)
    )
    block = functools.partial(
      _block, mask=mask, d_model=d_model, heads=heads, layers=layers
    )
    if stacked:
      h = hk.layer_stack(layers, name="blocks")(block)(h)
    else:
      for _ in range(layers):
        h = block(h)
    return hk.Linear(VOCAB)(hk.LayerNorm(-1, True, True)(h))

  return lm


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
      f"no Python source files in {root}; pass --text FILE instead."
    )
  return b"\n".join(parts)[:limit], f"Python standard library ({root})"


def chars(
  text: str | None = None, limit: int = 2_000_000, data: str | None = None
) -> Task:
  """A byte-level transformer LM; the last 10% of the text is held out (or
  the corpus folder ``data``'s held-out split).

  Losses are in bits per byte (per character for ASCII text, as the standard
  library's source nearly all is).
  """
  return _text_task(
    "chars",
    text,
    limit,
    SEQ,
    _lm_of(SEQ, D_MODEL, HEADS, LAYERS, False),
    f"byte-level transformer LM ({LAYERS} blocks, d_model {D_MODEL}, "
    f"{HEADS} heads, context {SEQ})",
    default_lr={"sgd": 0.3, "momentum": 0.1, "adam": 3e-3, "adamw": 3e-3},
    data=data,
  )


def deep_transformer(
  text: str | None = None, limit: int = 2_000_000, data: str | None = None
) -> Task:
  """The chars LM, 12 narrow blocks deep, the blocks under hk.layer_stack."""
  return _text_task(
    "deep_transformer",
    text,
    limit,
    DEEP_SEQ,
    _lm_of(DEEP_SEQ, DEEP_D_MODEL, DEEP_HEADS, DEEP_LAYERS, True),
    f"byte-level transformer LM ({DEEP_LAYERS} blocks under "
    f"hk.layer_stack, d_model {DEEP_D_MODEL}, {DEEP_HEADS} heads, context "
    f"{DEEP_SEQ})",
    default_lr={"sgd": 0.1, "momentum": 0.1, "adam": 3e-3, "adamw": 3e-3},
    data=data,
  )


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A corpus folder's two splits (``immgrad.experiments.corpus``)."""

  train: bytes
  heldout: bytes
  info: dict  # path, bytes and sha256 of each split, the manifest's sources


def _read_split(folder: str, name: str) -> tuple[bytes, str]:
  for file in (f"{name}.txt.xz", f"{name}.txt"):
    path = os.path.join(folder, file)
    if os.path.exists(path):
      if file.endswith(".xz"):
        with lzma.open(path) as f:
          return f.read(), path
      with open(path, "rb") as f:
        return f.read(), path
  raise FileNotFoundError(
    f"--data {folder}: no {name}.txt.xz or {name}.txt in it; build one "
    "with python -m immgrad.experiments.corpus build --out FOLDER."
  )


def read_corpus(folder: str) -> Corpus:
  """``train.txt[.xz]`` and ``heldout.txt[.xz]`` of ``folder``, checked.

  Each split's sha256 is computed here; where the folder has the
  ``manifest.json`` its build wrote, the sizes and sha256 must match it.
  """
  train, train_path = _read_split(folder, "train")
  heldout, heldout_path = _read_split(folder, "heldout")
  info: dict[str, Any] = dict(path=folder, sources=None)
  for name, data, path in (
    ("train", train, train_path),
    ("heldout", heldout, heldout_path),
  ):
    info[name] = dict(
      file=os.path.basename(path),
      bytes=len(data),
      sha256=hashlib.sha256(data).hexdigest(),
    )
  manifest_path = os.path.join(folder, "manifest.json")
  if os.path.exists(manifest_path):
    with open(manifest_path) as f:
      manifest = json.load(f)
    for name in ("train", "heldout"):
      want = manifest["splits"][name]
      if (want["bytes"], want["sha256"]) != (
        info[name]["bytes"],
        info[name]["sha256"],
      ):
        raise ValueError(
          f"--data {folder}: {info[name]['file']} has {info[name]['bytes']:,} "
          f"bytes, sha256 {info[name]['sha256'][:12]}..., but manifest.json "
          f"says {want['bytes']:,} bytes, {want['sha256'][:12]}...: the "
          "file is not the one built; rebuild the corpus."
        )
    info["sources"] = [
      f"{s['package']} {s['version']} ({s['licence']})"
      for s in manifest["sources"]
    ]
  if not train or not heldout:
    raise ValueError(f"--data {folder}: a split is empty.")
  return Corpus(train, heldout, info)


# Held-out windows evaluated with --data (in chunks of EVAL_CHUNK windows):
# 1,024 x 513 bytes, about 0.5 MB of the held-out split.
HELDOUT_EVAL_WINDOWS, EVAL_CHUNK = 1024, 128


def _text_task(
  name,
  text,
  limit,
  seq,
  forward,
  model_description,
  default_lr,
  compute_dtype=None,
  default_optimizer="adam",
  data=None,
) -> Task:
  """A byte-level LM task on ``text`` (default: the standard library), or
  on the corpus folder ``data`` (:func:`read_corpus`).

  From ``text``, the last 10% is held out and batches are windows of the
  training part at random offsets: a run may see a byte many times. From
  ``data``, the training split is cut into disjoint windows of ``seq + 1``
  bytes, each seed's run reads them in its own random order, each once,
  and asks for no more (:func:`_disjoint_batches`); held-out loss is over
  ``HELDOUT_EVAL_WINDOWS`` disjoint windows of the held-out split.
  """
  if data is not None and text is not None:
    raise ValueError("give a text or a corpus folder (data), not both.")
  if data is not None:
    corpus = read_corpus(data)
    train = np.frombuffer(corpus.train, np.uint8)
    heldout = np.frombuffer(corpus.heldout, np.uint8)
    source = f"the corpus {data}"
    info: dict[str, Any] = dict(corpus.info, disjoint_windows=True)
  else:
    if text is None:
      raw, source = _stdlib_text(limit)
    else:
      with open(text, "rb") as f:
        raw, source = f.read()[:limit], text
    tokens = np.frombuffer(raw, np.uint8)
    split = int(0.9 * len(tokens))
    train, heldout = tokens[:split], tokens[split:]
    info = dict(
      path=text or source,
      train=dict(
        bytes=len(train), sha256=hashlib.sha256(train.tobytes()).hexdigest()
      ),
      heldout=dict(
        bytes=len(heldout), sha256=hashlib.sha256(heldout.tobytes()).hexdigest()
      ),
      disjoint_windows=False,
    )
  if len(train) + len(heldout) < 20 * (seq + 1) or len(heldout) <= seq + 1:
    raise ValueError(
      f"the text {source!r} is too short: {len(train) + len(heldout)} "
      f"bytes ({len(heldout)} held out), need at least {20 * (seq + 1)} "
      f"({seq + 2} held out)."
    )
  info.update(window_bytes=seq + 1, train_windows=len(train) // (seq + 1))
  model = hk.without_apply_rng(
    hk.transform(immgrad.haiku.immediate(forward, compute_dtype=compute_dtype))
  )

  def windows(stream, starts):
    index = starts[:, None] + np.arange(seq + 1)[None]
    chunk = stream[index].astype(np.int32)
    return chunk[:, :-1], chunk[:, 1:]

  def loss_fn(params, inputs, targets):
    logits = model.apply(params, inputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, targets
    ).mean()

  eval_loss = jax.jit(loss_fn)
  fixed = np.random.default_rng(0)
  train_eval = windows(train, fixed.integers(0, len(train) - seq - 1, 128))
  if data is None:
    heldout_eval = [
      windows(heldout, fixed.integers(0, len(heldout) - seq - 1, 128))
    ]
  else:
    n = len(heldout) // (seq + 1)
    n = min(HELDOUT_EVAL_WINDOWS, n - n % EVAL_CHUNK) or n
    starts = np.sort(fixed.permutation(len(heldout) // (seq + 1))[:n])
    heldout_eval = [
      windows(heldout, starts[i : i + EVAL_CHUNK] * (seq + 1))
      for i in range(0, n, EVAL_CHUNK)
    ]
    info["heldout_eval_windows"] = n
  bits = 1 / math.log(2)

  def evaluate(params):
    heldout_loss = np.mean([float(eval_loss(params, *w)) for w in heldout_eval])
    return {
      "train_loss": float(eval_loss(params, *train_eval)) * bits,
      "heldout_loss": float(heldout_loss) * bits,
    }

  def batches(seed, size):
    if data is not None:
      yield from _disjoint_batches(train, seq, seed, size, windows)
      return
    rng = np.random.default_rng(seed)
    while True:
      yield windows(train, rng.integers(0, len(train) - seq - 1, size))

  if data is None:
    description = (
      f"{model_description} on {len(train) + len(heldout):,} bytes of "
      f"{source}, last 10% held out"
    )
  else:
    description = (
      f"{model_description} on {source} ({len(train):,} training bytes, "
      f"{len(heldout):,} held out, sha256 {info['train']['sha256'][:12]} "
      f"and {info['heldout']['sha256'][:12]}), disjoint windows, each once"
    )
  return Task(
    name=name,
    description=description,
    init=lambda seed: model.init(jax.random.PRNGKey(seed), train_eval[0]),
    loss_fn=loss_fn,
    batches=batches,
    evaluate=evaluate,
    loss_unit="bits per byte",
    loss_scale=bits,
    default_lr=default_lr,
    default_optimizer=default_optimizer,
    data=info,
  )


def _disjoint_batches(train, seq, seed, size, windows) -> Iterator[tuple]:
  """Batches of ``size`` disjoint ``seq + 1``-byte windows of ``train``,
  in the seed's order, each window once; then an error, not a repeat.
  """
  n = len(train) // (seq + 1)
  order = np.random.default_rng(seed).permutation(n)
  for i in range(n // size):
    yield windows(train, order[i * size : (i + 1) * size] * (seq + 1))
  raise ValueError(
    f"the corpus' training split has {n:,} windows of {seq + 1} bytes, "
    f"{n // size:,} batches of {size}: one more would see a byte twice."
  )


# -- lm: a GPT-style decoder ----------------------------------------------

# size -> (blocks, d_model, heads, context). small: ~10.9M parameters,
# base: GPT-2 small's 85M non-embedding parameters (a byte vocabulary).
LM_SIZES = {
  "tiny": (2, 64, 4, 64),
  "small": (6, 384, 6, 512),
  "base": (12, 768, 12, 512),
}
LM_DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "base": 6e-4}  # adam(w).


def _gpt(blocks: int, d_model: int, heads: int, seq: int, remat: bool):
  """GPT-2's decoder: pre-LN blocks, causal attention, learned positions.

  Initialised as GPT-2 (weights N(0, 0.02), the two residual projections
  of each block N(0, 0.02 / sqrt(2 * blocks)), biases zero); the output
  layer is its own (untied: one weight may reach one immediate layer).
  Attention logits and softmax in float32 whatever the compute dtype.
  ``remat``: each block under ``hk.remat`` (its activations recomputed in
  the backward pass: one more forward pass, far less memory).
  """
  w = hk.initializers.RandomNormal(0.02)
  w_out = hk.initializers.RandomNormal(0.02 / math.sqrt(2 * blocks))
  head = d_model // heads

  def attention(x, mask):
    qkv = hk.Linear(3 * d_model, w_init=w)(x)
    q, k, v = jnp.split(qkv.reshape(*x.shape[:-1], 3 * heads, head), 3, -2)
    logits = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32)
    logits = jnp.where(mask, logits / math.sqrt(head), -1e30)
    weights = jax.nn.softmax(logits).astype(v.dtype)
    out = jnp.einsum("bhts,bshd->bthd", weights, v)
    return hk.Linear(d_model, w_init=w_out)(out.reshape(x.shape))

  def block(h):  # The residual stream stays float32.
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    h = h + attention(hk.LayerNorm(-1, True, True)(h), mask)
    m = hk.Linear(4 * d_model, w_init=w)(hk.LayerNorm(-1, True, True)(h))
    return h + hk.Linear(d_model, w_init=w_out)(jax.nn.gelu(m))

  def lm(tokens):
    h = hk.Embed(VOCAB, d_model, w_init=w)(tokens)
    h = h + hk.get_parameter("positions", (seq, d_model), init=w)
    for _ in range(blocks):
      h = (hk.remat(block) if remat else block)(h)
    return hk.Linear(VOCAB, w_init=w)(hk.LayerNorm(-1, True, True)(h))

  return lm


def lm(
  text: str | None = None,
  size: str = "tiny",
  compute_dtype: Any | None = "auto",
  remat: bool = False,
  data: str | None = None,
  blocks: int | None = None,
  width: int | None = None,
) -> Task:
  """A GPT-style byte-level LM (``LM_SIZES``); last 10% of the text held out.

  ``compute_dtype``: ``"auto"`` is bfloat16 for ``small`` and ``base`` on an
  accelerator (float32 weights and optimizer state), else float32; or
  ``None`` (float32) or a dtype. Every method trains the same arithmetic.
  Default optimizer adamw (see ``train.optimizer``). ``tiny`` reads 2 MB
  of the standard library, the others all its top-level source files;
  ``data``: a corpus folder instead (:func:`read_corpus`), each byte once.
  ``remat``: every block under ``hk.remat`` (less memory, ~23% more FLOPs).
  ``blocks``: that many blocks instead of the size's, all else as the size
  (to vary depth alone); ``width``: that d_model, with the size's number of
  heads (to vary width alone).
  """
  if size not in LM_SIZES:
    raise ValueError(
      f"unknown lm size {size!r}: choose one of {', '.join(LM_SIZES)}."
    )
  if blocks is not None and blocks < 1:
    raise ValueError(f"lm blocks={blocks}: give at least 1 block.")
  own, own_width, heads, seq = LM_SIZES[size]
  if width is not None and (width < 1 or width % heads):
    raise ValueError(
      f"lm width={width}: give a positive multiple of the {heads} heads "
      f"of '{size}'."
    )
  blocks, d_model = blocks or own, width or own_width
  if compute_dtype == "auto":
    compute_dtype = (
      jnp.bfloat16
      if size != "tiny" and jax.default_backend() != "cpu"
      else None
    )
  dtype = jnp.dtype(compute_dtype or jnp.float32).name
  lr = LM_DEFAULT_LR[size]
  return _text_task(
    f"lm_{size}",
    text,
    2_000_000 if size == "tiny" else 100_000_000,
    seq,
    _gpt(blocks, d_model, heads, seq, remat),
    f"GPT-style byte-level LM '{size}' ({blocks} pre-LN blocks, d_model "
    f"{d_model}, {heads} heads, context {seq}, learned positions, "
    f"{dtype} compute, float32 weights"
    f"{', blocks under hk.remat' if remat else ''})",
    default_lr={"sgd": 0.3, "momentum": 0.1, "adam": lr, "adamw": lr},
    compute_dtype=compute_dtype,
    default_optimizer="adamw",
    data=data,
  )


TASKS = {
  "digits": digits,
  "chars": chars,
  "deep_mlp": deep_mlp,
  "deep_transformer": deep_transformer,
  "lm": lm,
}
TEXT_TASKS = ("chars", "deep_transformer", "lm")  # Those that take --text.
