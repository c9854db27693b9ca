"""Models and independent references for the tests.

The references never call immgrad: they are plain ``jax`` + ``optax``.
:func:`immediate_steps` runs immgrad in the same loop, for comparison.

* :func:`plain_steps` - ordinary training, ``jax.value_and_grad`` then the
  optax update, jitted as a user would.
* :func:`sequential_steps` - the sequential re-linearization of a chain of
  layers: walk from the last layer to the first; at each layer take ``dW``
  from ``jax.vjp`` at the old weights, step the layer with its own optax
  state, then take ``dX`` with ``jax.vjp`` at the *new* weights and pass it
  through the previous activation.
"""

from typing import Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import immgrad


class Chain(NamedTuple):
  """``x -> act_L(layer_L(... act_1(layer_1(x, p_1)) ..., p_L))``, then loss.

  ``layers[i]`` is an undecorated ``fun(x, params)``; ``names[i]`` its key
  in the params dict; ``acts[i]`` an elementwise activation.
  """

  layers: tuple
  names: tuple
  acts: tuple
  loss: Callable  # loss(output, target) -> scalar

  def apply(self, params, x, layer_wrap=lambda f: f):
    for fun, name, act in zip(self.layers, self.names, self.acts):
      x = act(layer_wrap(fun)(x, params[name]))
    return x

  def loss_fn(self, layer_wrap=lambda f: f):
    def loss_fn(params, x, y):
      return self.loss(self.apply(params, x, layer_wrap), y)

    return loss_fn


def dense(x, p):
  return x @ p["w"] + p["b"]


def identity(x):
  return x


def mse(out, y):
  return jnp.mean((out - y) ** 2)


def mlp(sizes, key, act=jax.nn.relu):
  """A Chain of dense layers and its params, scaled like a real init."""
  keys = jax.random.split(key, len(sizes) - 1)
  params, names = {}, []
  for i, (a, b, k) in enumerate(zip(sizes[:-1], sizes[1:], keys)):
    kw, kb = jax.random.split(k)
    names.append(f"layer{i}")
    params[names[-1]] = {
      "w": jax.random.normal(kw, (a, b)) / np.sqrt(a),
      "b": 0.1 * jax.random.normal(kb, (b,)),
    }
  acts = (act,) * (len(names) - 1) + (identity,)
  return Chain((dense,) * len(names), tuple(names), acts, mse), params


def _same(tree):
  return tree


def plain_steps(
  loss_fn, opt, params, batches, reduce=_same, compile_step=jax.jit
):
  """Ordinary training; returns the params after each step and the losses.

  ``reduce(grads)`` is applied to the gradient before the optimizer (a
  data-parallel average), ``compile_step(step)`` makes the step (``jit``,
  or ``jit`` of a ``shard_map``).
  """

  @compile_step
  def step(params, state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, state = opt.update(reduce(grads), state, params)
    return optax.apply_updates(params, updates), state, loss

  state = opt.init(params)
  history, losses = [], []
  for batch in batches:
    params, state, loss = step(params, state, *batch)
    history.append(params)
    losses.append(loss)
  return history, losses


def immediate_steps(loss_fn, opt, params, batches, atomic=True, **kwargs):
  """The same loop with immgrad; returns params after each step, losses."""
  tx = immgrad.shim(opt, atomic=atomic)

  @jax.jit
  def step(params, state, *batch):
    loss, grads = immgrad.value_and_grad(loss_fn, tx, **kwargs)(
      params, state, *batch
    )
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  state = tx.init(params)
  history, losses = [], []
  for batch in batches:
    params, state, loss = step(params, state, *batch)
    history.append(params)
    losses.append(loss)
  return history, losses


def train_steps(loss_fn, opt, params, batches, atomic=False, **kwargs):
  """The same loop with ``immgrad.train_step`` (parameters and state
  donated, as a user would); returns params after each step, losses.
  """
  tx = immgrad.shim(opt, atomic=atomic)
  step = jax.jit(
    immgrad.train_step(loss_fn, tx, **kwargs), donate_argnums=(0, 1)
  )
  params, state = jax.tree.map(jnp.copy, (params, tx.init(params)))
  history, losses = [], []
  for batch in batches:
    loss, params, state = step(params, state, *batch)
    history.append(jax.tree.map(jnp.copy, params))  # Donated next step.
    losses.append(loss)
  return history, losses


def sequential_steps(
  chain: Chain,
  opt,
  params,
  batches,
  at=1.0,
  measure=False,
  penalty=None,
  reduce=_same,
  compile_step=jax.jit,
):
  """The hand-written re-linearization reference for ``mode="updated"``.

  With ``at``, dX is taken at ``W + at * (W_new - W)`` (``mode=at``). With
  ``measure``, also returns, per step, each layer's
  ``|dX(W_new) - dX(W)| / |dX(W)|`` on the ``dz`` it received. With
  ``penalty(layer_params) -> scalar`` (an L2 term), the loss is
  ``chain.loss + sum(penalty(params[name]) for each layer)``, and each
  layer's ``dW`` includes the penalty's gradient at its old weights.
  ``reduce`` and ``compile_step`` as in :func:`plain_steps` (``reduce``
  applied to each layer's ``dW``).
  """

  def norm(tree):
    return jnp.sqrt(sum(jnp.sum(a**2) for a in jax.tree.leaves(tree)))

  @compile_step
  def step(params, states, x, y):
    inputs, pre = [], []
    h = x
    for fun, name, act in zip(chain.layers, chain.names, chain.acts):
      inputs.append(h)
      z = fun(h, params[name])
      pre.append(z)
      h = act(z)
    loss, loss_vjp = jax.vjp(lambda out: chain.loss(out, y), h)
    if penalty is not None:
      loss = loss + sum(penalty(params[name]) for name in chain.names)
    (dh,) = loss_vjp(jnp.ones_like(loss))
    new_params, new_states, changes = dict(params), dict(states), {}
    for i in reversed(range(len(chain.layers))):
      fun, name, act = chain.layers[i], chain.names[i], chain.acts[i]
      _, act_vjp = jax.vjp(act, pre[i])
      (dz,) = act_vjp(dh)
      _, w_vjp = jax.vjp(lambda w, f=fun, x=inputs[i]: f(x, w), params[name])
      (dw,) = w_vjp(dz)
      dw = reduce(dw)
      if penalty is not None:
        dw = jax.tree.map(jnp.add, dw, jax.grad(penalty)(params[name]))
      updates, new_states[name] = opt.update(dw, states[name], params[name])
      new_params[name] = optax.apply_updates(params[name], updates)

      def dx_at(w, f=fun, x=inputs[i], dz=dz):
        return jax.vjp(lambda x: f(x, w), x)[1](dz)[0]

      old, new = params[name], new_params[name]
      dh = dx_at(jax.tree.map(lambda o, n: o + at * (n - o), old, new))
      if jnp.issubdtype(inputs[i].dtype, jnp.inexact):
        changes[name] = norm(dx_at(new) - dx_at(old)) / norm(dx_at(old))
      else:  # integer input (token ids): no dX to change
        changes[name] = jnp.zeros(())
    return new_params, new_states, loss, changes

  states = {name: opt.init(params[name]) for name in chain.names}
  history, losses, measured = [], [], []
  for x, y in batches:
    params, states, loss, changes = step(params, states, x, y)
    history.append(params)
    losses.append(loss)
    measured.append(changes)
  if measure:
    return history, losses, measured
  return history, losses


def batches(key, n, x_shape, y_shape):
  keys = jax.random.split(key, 2 * n)
  return [
    (
      jax.random.normal(keys[2 * i], x_shape),
      jax.random.normal(keys[2 * i + 1], y_shape),
    )
    for i in range(n)
  ]


def max_abs_diff(a, b):
  return max(
    float(jnp.max(jnp.abs(x - y)))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def assert_runs_close(got, expected, atol, rtol):
  """``got`` and ``expected`` are ``(params after each step, losses)``."""
  (got_params, got_losses), (expected_params, expected_losses) = got, expected
  assert len(got_params) == len(expected_params)
  for step, (a, b) in enumerate(zip(got_params, expected_params)):
    chex.assert_trees_all_close(
      a, b, atol=atol, rtol=rtol, custom_message=f"after step {step + 1}"
    )
  chex.assert_trees_all_close(got_losses, expected_losses, atol=atol, rtol=rtol)


def equations(jaxpr):
  """Every equation of ``jaxpr``, those of nested programs included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():  # Nested programs (jax >= 0.7.0).
      for inner in param if isinstance(param, tuple | list) else (param,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns"):
          yield from equations(inner)


def stacked(unrolled):
  """An ``mlp``'s params with its hidden layers stacked for ``scanned_loss``:
  ``{"blocks": layer0..layer{n-2} stacked, "head": the last layer}``.
  """
  names = sorted(unrolled, key=lambda name: int(name.removeprefix("layer")))
  return {
    "blocks": jax.tree.map(
      lambda *a: jnp.stack(a), *[unrolled[n] for n in names[:-1]]
    ),
    "head": unrolled[names[-1]],
  }


def scanned_loss(reverse=False):
  """MSE loss of ``stacked`` params: the blocks as immediate dense layers
  under ``immgrad.scan``, tanh after each, then the immediate head.
  """
  layer = immgrad.immediate_layer(dense)

  def loss_fn(params, x, y):
    def block(h, p):
      return jnp.tanh(layer(h, p)), None

    h, _ = immgrad.scan(block, x, params["blocks"], reverse=reverse)
    return mse(layer(h, params["head"]), y)

  return loss_fn


def layers_agree(table, grads) -> set:
  """``immgrad.layers``' table lists as immediate exactly the leaves the
  step returned as ``ImmediateGrad`` (by path); returns those paths.
  """
  is_grad = lambda g: isinstance(g, immgrad.ImmediateGrad)
  stepped = {
    jax.tree_util.keystr(path): is_grad(g)
    for path, g in jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_grad)[
      0
    ]
  }
  assert {row.path: row.layer is not None for row in table} == stepped
  return {path for path, s in stepped.items() if s}
