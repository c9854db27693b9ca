"""The benchmarked models, each trained by every method.

Methods (all with ``optax.adam(1e-3)``, jitted, params and state donated):

* ``plain``: ``jax.value_and_grad`` + optax;
* ``plain + apply_if_finite``: the same with ``optax.apply_if_finite``, the
  all-or-nothing peer of the atomic shim (it checks the gradients only);
* ``current`` / ``updated``: ``immgrad.value_and_grad`` with
  ``immgrad.shim(adam)`` (atomic, the default);
* ``current (atomic=False)`` / ``updated (atomic=False)``: the same without
  the all-or-nothing check;
* ``current (in place)`` / ``updated (in place)``: ``immgrad.train_step``
  with ``immgrad.shim(adam, atomic=False)``, each layer's new weights and
  state written over the old ones in the backward pass;
* ``current (immediate)`` / ``updated (immediate)`` and their
  ``atomic=False`` variants: the same steps with the model's layers found
  by ``immgrad.immediate`` on the undecorated model (the plain Haiku
  ``apply``, the MLP with ``_dense``) instead of ``immgrad.immediate_layer``
  or ``immgrad.haiku.immediate`` (``IMMEDIATE_METHODS``: both fronts);
* ``naive`` (depth sweep only): what a user would write without immgrad to
  get "updated" gradients: the sequential re-linearization with one vjp
  chain per layer. For layer l it backpropagates from the loss through the
  already-updated layers above l (their vjps at the new weights, on the
  stored activations), takes dW_l, and steps layer l; nothing is reused
  between layers, so the work grows with the square of the depth.
"""

from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.measure import Candidate
import immgrad
import immgrad.haiku

METHODS = (
  "plain",
  "plain + apply_if_finite",
  "current",
  "updated",
  "current (atomic=False)",
  "updated (atomic=False)",
  "current (in place)",
  "updated (in place)",
)
# Each model's immgrad methods with its adapter and with immgrad.immediate.
IMMEDIATE_METHODS = (
  "plain",
  "current",
  "current (immediate)",
  "updated",
  "updated (immediate)",
  "current (atomic=False)",
  "current (immediate, atomic=False)",
  "updated (atomic=False)",
  "updated (immediate, atomic=False)",
)


def _host(tree):
  """A candidate's own copy on the host (its measurement puts it on the
  device, where the step donates it).
  """
  return jax.tree.map(np.asarray, tree)


def _adam():
  return optax.adam(1e-3)


def step_for(method: str, loss_fn: Callable, opt) -> tuple:
  """``(step, tx)``: ``method``'s jitted-to-be training step
  ``step(params, opt_state, *batch) -> (params, opt_state, loss)`` for
  ``loss_fn(params, *batch)`` with optimizer ``opt``, and the transformation
  whose ``init`` makes its state.
  """
  if method.startswith("plain"):
    tx = opt if method == "plain" else optax.apply_if_finite(opt, 10)
    grad_fn = lambda params, opt_state, *batch: jax.value_and_grad(loss_fn)(
      params, *batch
    )
  elif "in place" in method:
    tx = immgrad.shim(opt, atomic=False)
    train = immgrad.train_step(loss_fn, tx, mode=method.split()[0])

    def in_place(params, opt_state, *batch):
      loss, params, opt_state = train(params, opt_state, *batch)
      return params, opt_state, loss

    return in_place, tx
  else:
    tx = immgrad.shim(opt, atomic="atomic=False" not in method)
    grad_fn = immgrad.value_and_grad(loss_fn, tx, mode=method.split()[0])

  def step(params, opt_state, *batch):
    loss, grads = grad_fn(params, opt_state, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, tx


def candidates_for(
  loss_fn: Callable,
  params,
  batch,
  methods=METHODS,
  auto_loss_fn=None,
  make_opt: Callable = _adam,
) -> list[Candidate]:
  """The training step of each method for ``loss_fn(params, *batch)``;
  ``auto_loss_fn``, the same loss through ``immgrad.immediate``, for the
  methods marked ``(immediate``; ``make_opt()`` the optimizer of each.
  """
  out = []
  for method in methods:
    fn = auto_loss_fn if "(immediate" in method else loss_fn
    step, tx = step_for(method, fn, make_opt())
    p = _host(params)
    out.append(Candidate(method, step, p, _host(tx.init(p)), batch))
  return out


# -- MLP: affine layers, ReLU outside --------------------------------------


def _dense(x, p):
  return x @ p["w"] + p["b"]


dense = immgrad.immediate_layer(_dense)


def mlp(depth: int, width: int, batch: int, *, methods=METHODS, make_opt=_adam):
  """``depth`` affine layers of ``width``, ReLU between, MSE to a target.

  ``methods`` may include ``"naive"``; ``make_opt()`` makes the optimizer.
  """
  keys = jax.random.split(jax.random.PRNGKey(0), depth + 2)
  params = {
    f"layer{i}": {
      "w": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
      "b": jnp.zeros(width),
    }
    for i in range(depth)
  }
  x = jax.random.normal(keys[-2], (batch, width))
  y = jax.random.normal(keys[-1], (batch, width))

  def losses(layer):
    def forward(params, x):
      h = x
      for i in range(depth):
        h = layer(h, params[f"layer{i}"])
        if i < depth - 1:
          h = jax.nn.relu(h)
      return h

    auto = immgrad.immediate(forward)
    mse = lambda f: lambda params, x, y: jnp.mean((f(params, x) - y) ** 2)
    return mse(forward), mse(auto)

  loss_fn, _ = losses(dense)
  _, auto_loss_fn = losses(_dense)
  out = candidates_for(
    loss_fn,
    params,
    (x, y),
    [m for m in methods if m != "naive"],
    auto_loss_fn,
    make_opt,
  )
  if "naive" in methods:
    opt = optax.adam(1e-3)
    p = _host(params)
    out.append(
      Candidate(
        "naive",
        _naive_step(depth, opt),
        p,
        _host({k: opt.init(v) for k, v in p.items()}),
        (x, y),
      )
    )
  return out


def scanned_mlp(depth: int, width: int, batch: int, *, methods=METHODS):
  """The MLP's layers stacked and run under ``immgrad.scan`` (plain: the
  same loss, where ``immgrad.scan`` is ``jax.lax.scan``; ``immediate``:
  undecorated layers under ``jax.lax.scan``).
  """
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {
    "blocks": {
      "w": jax.random.normal(k1, (depth, width, width)) / np.sqrt(width),
      "b": jnp.zeros((depth, width)),
    }
  }
  x = jax.random.normal(k2, (batch, width))
  y = jax.random.normal(k3, (batch, width))

  def loss_fn(params, x, y):
    def block(h, p):
      return jax.nn.relu(dense(h, p)), None

    h, _ = immgrad.scan(block, x, params["blocks"])
    return jnp.mean((h - y) ** 2)

  @immgrad.immediate
  def forward(params, x):
    block = lambda h, p: (jax.nn.relu(_dense(h, p)), None)
    return jax.lax.scan(block, x, params["blocks"])[0]

  def auto_loss_fn(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2)

  return candidates_for(loss_fn, params, (x, y), methods, auto_loss_fn)


def _naive_step(depth: int, opt):
  """Sequential re-linearization, one vjp chain per layer (no immgrad)."""

  def step(params, states, x, y):
    names = [f"layer{i}" for i in range(depth)]
    inputs, pre = [], []
    h = x
    for i, name in enumerate(names):
      inputs.append(h)
      pre.append(_dense(h, params[name]))
      h = jax.nn.relu(pre[-1]) if i < depth - 1 else pre[-1]
    loss, loss_vjp = jax.vjp(lambda out: jnp.mean((out - y) ** 2), h)
    (top,) = loss_vjp(jnp.ones_like(loss))
    new, new_states = dict(params), dict(states)
    for j in reversed(range(depth)):
      d = top  # Down from the loss through the updated layers above j.
      for k in range(depth - 1, j, -1):
        if k < depth - 1:
          d = jnp.where(pre[k] > 0, d, 0.0)
        (d,) = jax.vjp(lambda x, k=k: _dense(x, new[names[k]]), inputs[k])[1](d)
      if j < depth - 1:
        d = jnp.where(pre[j] > 0, d, 0.0)
      (dw,) = jax.vjp(lambda w, j=j: _dense(inputs[j], w), params[names[j]])[1](
        d
      )
      updates, new_states[names[j]] = opt.update(
        dw, states[names[j]], params[names[j]]
      )
      new[names[j]] = optax.apply_updates(params[names[j]], updates)
    return new, new_states, loss

  return step


# -- Transformer LM, built with immgrad.haiku ------------------------------


def _block(h, mask, heads, mlp_size):
  d_model = h.shape[-1]
  a = hk.LayerNorm(-1, True, True)(h)
  a = hk.MultiHeadAttention(
    heads, d_model // heads, w_init=hk.initializers.VarianceScaling(1.0)
  )(a, a, a, mask)
  h = h + a
  m = hk.LayerNorm(-1, True, True)(h)
  return h + hk.Linear(d_model)(jax.nn.gelu(hk.Linear(mlp_size)(m)))


def transformer(
  *,
  blocks=4,
  d_model=256,
  heads=4,
  mlp_size=1024,
  seq=128,
  batch=16,
  vocab=256,
  stacked=False,
  methods=METHODS,
):
  """A decoder-only LM; ``stacked`` puts the blocks under hk.layer_stack."""

  def forward(tokens):
    mask = jnp.tril(jnp.ones((seq, seq), bool))[None, None]
    h = hk.Embed(vocab, d_model)(tokens)
    h = h + hk.get_parameter(
      "positions", (seq, d_model), init=hk.initializers.RandomNormal(0.02)
    )
    block = lambda h: _block(h, mask, heads, mlp_size)
    if stacked:
      h = hk.layer_stack(blocks)(block)(h)
    else:
      for _ in range(blocks):
        h = block(h)
    return hk.Linear(vocab)(hk.LayerNorm(-1, True, True)(h))

  model = hk.without_apply_rng(hk.transform(immgrad.haiku.immediate(forward)))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, vocab)
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  params = model.init(jax.random.PRNGKey(0), inputs)

  def lm_loss(apply):
    def loss_fn(params, inputs, targets):
      logits = apply(params, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets
      ).mean()

    return loss_fn

  auto = immgrad.immediate(hk.without_apply_rng(hk.transform(forward)).apply)
  return candidates_for(
    lm_loss(model.apply), params, (inputs, targets), methods, lm_loss(auto)
  )
