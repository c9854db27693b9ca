"""immgrad.train_step against plain training and the sequential reference.

With ``atomic=False`` each immediate layer returns its new weights and state
through the cotangent slots, written over the old ones in immgrad.scan's
backward loop: ``mode="current"`` must still train as plain
``jax.value_and_grad`` + optax, ``mode="updated"`` (and ``mode=a``) as the
hand-written sequential re-linearization, unrolled, scanned (forwards and
reversed, rematerialised), through ``hk.layer_stack`` and through a
``lax.scan`` found by ``immgrad.immediate``. Tolerance as in test_current.py
(atol=1e-6, rtol=1e-5 over 5 steps: float32 rounding of differently fused
programs); a layer stepped twice, skipped, or a slice written to the wrong
layer moves these models by more than 1e-3.
"""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import optax
import pytest

import immgrad
import immgrad.haiku
import oracles

ATOL, RTOL = 1e-6, 1e-5
LAYERS, WIDTH, STEPS = 4, 5, 5

dense = immgrad.immediate_layer(oracles.dense)

OPTIMIZERS = {
  "sgd": lambda: optax.sgd(0.1),
  "momentum": lambda: optax.sgd(0.05, momentum=0.9),
  "adam": lambda: optax.adam(1e-2),
  "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
  "lion": lambda: optax.lion(1e-3),
}


def _chain():
  return oracles.mlp(
    [WIDTH] * (LAYERS + 1) + [3], jax.random.PRNGKey(0), act=jnp.tanh
  )


def _data():
  return oracles.batches(jax.random.PRNGKey(1), STEPS, (8, WIDTH), (8, 3))


def _expected(mode, opt, chain, unrolled, data, at=1.0):
  if mode == "current":
    return oracles.plain_steps(chain.loss_fn(), opt, unrolled, data)
  return oracles.sequential_steps(chain, opt, unrolled, data, at=at)


def _stacked(run):
  history, losses = run
  return [oracles.stacked(p) for p in history], losses


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["current", "updated"])
def test_unrolled_layers(mode, opt):
  chain, unrolled = _chain()
  data = _data()
  got = oracles.train_steps(
    chain.loss_fn(immgrad.immediate_layer),
    OPTIMIZERS[opt](),
    unrolled,
    data,
    mode=mode,
  )
  expected = _expected(mode, OPTIMIZERS[opt](), chain, unrolled, data)
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["current", "updated", 0.5, -0.5])
def test_immgrad_scan_writes_each_layer_in_place(mode, opt):
  chain, unrolled = _chain()
  data = _data()
  got = oracles.train_steps(
    oracles.scanned_loss(),
    OPTIMIZERS[opt](),
    oracles.stacked(unrolled),
    data,
    mode=mode,
  )
  at = {"current": 0.0, "updated": 1.0}.get(mode, mode)
  expected = _expected(
    "current" if at == 0 else "other",
    OPTIMIZERS[opt](),
    chain,
    unrolled,
    data,
    at=at,
  )
  oracles.assert_runs_close(got, _stacked(expected), atol=ATOL, rtol=RTOL)


def test_reversed_scan():
  chain, unrolled = _chain()
  data = _data()
  flipped = {
    f"layer{i}": unrolled[f"layer{LAYERS - 1 - i}"] for i in range(LAYERS)
  }
  flipped[f"layer{LAYERS}"] = unrolled[f"layer{LAYERS}"]
  history, losses = oracles.sequential_steps(
    chain, optax.adam(1e-2), flipped, data
  )
  expected = []
  for p in history:
    back = {f"layer{i}": p[f"layer{LAYERS - 1 - i}"] for i in range(LAYERS)}
    back[f"layer{LAYERS}"] = p[f"layer{LAYERS}"]
    expected.append(oracles.stacked(back))
  got = oracles.train_steps(
    oracles.scanned_loss(reverse=True),
    optax.adam(1e-2),
    oracles.stacked(unrolled),
    data,
    mode="updated",
  )
  oracles.assert_runs_close(got, (expected, losses), atol=ATOL, rtol=RTOL)


def test_rematerialised_scan_body():
  """immgrad.checkpoint inside immgrad.scan: the state's new values come
  back through jax.checkpoint's cotangents.
  """
  chain, unrolled = _chain()
  data = _data()

  @immgrad.checkpoint
  def block(h, p):
    return jnp.tanh(dense(h, p))

  def loss_fn(params, x, y):
    h, _ = immgrad.scan(lambda h, p: (block(h, p), None), x, params["blocks"])
    return oracles.mse(dense(h, params["head"]), y)

  got = oracles.train_steps(
    loss_fn, optax.adam(1e-2), oracles.stacked(unrolled), data, mode="updated"
  )
  expected = oracles.sequential_steps(chain, optax.adam(1e-2), unrolled, data)
  oracles.assert_runs_close(got, _stacked(expected), atol=ATOL, rtol=RTOL)


def test_optimizer_state_equals_plain_optax():
  """The new moments written in place, and adam's shared count stepped
  once a step, are plain optax's state.
  """
  chain, unrolled = _chain()
  data = _data()
  opt = optax.adam(1e-2)
  tx = immgrad.shim(opt, atomic=False)
  step = jax.jit(immgrad.train_step(oracles.scanned_loss(), tx, mode="current"))
  params, state = oracles.stacked(unrolled), tx.init(oracles.stacked(unrolled))

  @jax.jit
  def plain(params, state, x, y):
    grads = jax.grad(chain.loss_fn())(params, x, y)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  plain_params, plain_state = unrolled, opt.init(unrolled)
  for x, y in data:
    _, params, state = step(params, state, x, y)
    plain_params, plain_state = plain(plain_params, plain_state, x, y)
  mu, nu = plain_state[0].mu, plain_state[0].nu
  chex.assert_trees_all_close(
    (state.inner[0].mu, state.inner[0].nu),
    (oracles.stacked(mu), oracles.stacked(nu)),
    atol=ATOL,
    rtol=RTOL,
  )
  assert int(state.inner[0].count) == STEPS == int(plain_state[0].count)
  assert int(state.rejected) == 0


def test_atomic_shim_is_value_and_grad_then_update():
  """With the default shim, train_step is the optax step, bit for bit."""
  _, unrolled = _chain()
  data = _data()
  params = oracles.stacked(unrolled)
  got = oracles.train_steps(
    oracles.scanned_loss(), optax.adam(1e-2), params, data, atomic=True
  )
  expected = oracles.immediate_steps(
    oracles.scanned_loss(), optax.adam(1e-2), params, data
  )
  chex.assert_trees_all_equal(got, expected)


def _stack_forward(x):
  block = lambda h: jnp.tanh(hk.Linear(WIDTH)(h))
  return hk.Linear(3)(hk.layer_stack(LAYERS)(block)(x))


def test_haiku_layer_stack_and_immgrad_immediate():
  """hk.layer_stack through the adapter, and the same model's plain apply
  through immgrad.immediate (its scan found in the program), equal plain
  training in "current" and the value_and_grad step in "updated".
  """
  data = _data()
  plain = hk.without_apply_rng(hk.transform(_stack_forward))
  adapted = hk.without_apply_rng(
    hk.transform(immgrad.haiku.immediate(_stack_forward))
  )
  params = plain.init(jax.random.PRNGKey(0), data[0][0])
  loss = lambda apply: lambda p, x, y: oracles.mse(apply(p, x), y)
  opt = optax.adam(1e-2)
  expected = oracles.plain_steps(loss(plain.apply), opt, params, data)
  for fun in (adapted.apply, immgrad.immediate(plain.apply)):
    got = oracles.train_steps(loss(fun), opt, params, data, mode="current")
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
    got = oracles.train_steps(loss(fun), opt, params, data, mode="updated")
    reference = oracles.immediate_steps(
      loss(fun), opt, params, data, mode="updated", atomic=False
    )
    oracles.assert_runs_close(got, reference, atol=ATOL, rtol=RTOL)
    assert oracles.max_abs_diff(got[0][-1], expected[0][-1]) > 1e-3


def test_ordinary_and_unused_parameters():
  """An undecorated parameter trains as plain optax; an unused one (and its
  adam moments) is kept bit for bit, as value_and_grad keeps it.
  """
  chain, unrolled = _chain()
  data = _data()
  params = dict(
    oracles.stacked(unrolled), scale=jnp.ones(()), unused=jnp.ones(3)
  )

  def loss_fn(params, x, y):
    return params["scale"] * oracles.scanned_loss()(params, x, y)

  def plain_loss(params, x, y):
    return params["scale"] * chain.loss_fn()(
      {**unstack(params), f"layer{LAYERS}": params["head"]}, x, y
    )

  def unstack(params):
    return {
      f"layer{i}": jax.tree.map(lambda a, i=i: a[i], params["blocks"])
      for i in range(LAYERS)
    }

  opt = optax.adam(1e-2)
  got = oracles.train_steps(loss_fn, opt, params, data, mode="current")
  expected = oracles.plain_steps(plain_loss, opt, params, data)
  for a, b in zip(got[0], expected[0]):
    chex.assert_trees_all_close(
      {k: v for k, v in a.items() if k != "unused"},
      {k: v for k, v in b.items() if k != "unused"},
      atol=ATOL,
      rtol=RTOL,
    )
    chex.assert_trees_all_equal(a["unused"], params["unused"])


def test_has_aux():
  chain, unrolled = _chain()
  data = _data()

  def loss_fn(params, x, y):
    loss = oracles.scanned_loss()(params, x, y)
    return loss, {"twice": 2 * loss}

  tx = immgrad.shim(optax.adam(1e-2), atomic=False)
  step = jax.jit(immgrad.train_step(loss_fn, tx, has_aux=True))
  params = oracles.stacked(unrolled)
  (loss, aux), _, _ = step(params, tx.init(params), *data[0])
  assert float(aux["twice"]) == 2 * float(loss)


def test_data_parallel_current_equals_plain():
  """Under pmap over the 4 simulated CPU devices, each layer's gradient is
  averaged over the replicas before its in-place step.
  """
  chain, unrolled = _chain()
  n = jax.local_device_count()
  data = oracles.batches(jax.random.PRNGKey(1), 3, (4 * n, WIDTH), (4 * n, 3))
  opt = optax.adam(1e-2)
  expected = oracles.plain_steps(chain.loss_fn(), opt, unrolled, data)
  tx = immgrad.shim(opt, atomic=False)
  step = jax.pmap(
    immgrad.train_step(
      oracles.scanned_loss(), tx, mode="current", axis_name="d"
    ),
    axis_name="d",
  )
  copies = lambda tree: jax.tree.map(lambda a: jnp.stack([a] * n), tree)
  params = copies(oracles.stacked(unrolled))
  state = copies(tx.init(oracles.stacked(unrolled)))
  for (x, y), want in zip(data, expected[0]):
    shard = lambda a: a.reshape((n, -1) + a.shape[1:])
    _, params, state = step(params, state, shard(x), shard(y))
    chex.assert_trees_all_close(
      jax.tree.map(lambda a: a[0], params),
      oracles.stacked(want),
      atol=ATOL,
      rtol=RTOL,
    )


def test_state_written_without_being_read_is_refused():
  """optax.zero_nans writes a per-parameter flag it never reads, which has
  no cotangent to come back through: refused in place, by name; the
  atomic shim takes it.
  """
  chain, params = _chain()
  loss_fn = chain.loss_fn(immgrad.immediate_layer)
  opt = optax.chain(optax.zero_nans(), optax.adam(1e-2))
  tx = immgrad.shim(opt, atomic=False)
  step = immgrad.train_step(loss_fn, tx)
  with pytest.raises(ValueError, match=r"immgrad.train_step: .*found_nan"):
    step(params, tx.init(params), *_data()[0])
  atomic = immgrad.shim(opt)
  loss, _, _ = immgrad.train_step(loss_fn, atomic)(
    params, atomic.init(params), *_data()[0]
  )
  assert jnp.isfinite(loss)


def test_errors_name_train_step():
  """Each refusal names immgrad.train_step, not value_and_grad, which it
  is built on (the mode, tx, reduce_dtype and axis_name checks).
  """
  _, unrolled = _chain()
  tx = immgrad.shim(optax.adam(1e-2), atomic=False)
  with pytest.raises(ValueError, match=r"^immgrad.train_step: mode must be"):
    immgrad.train_step(oracles.scanned_loss(), tx, mode="newest")
  with pytest.raises(TypeError, match=r"^immgrad.train_step: tx must be"):
    immgrad.train_step(oracles.scanned_loss(), optax.adam(1e-2))
  bf16 = r"^immgrad.train_step\(reduce_dtype=bfloat16\) needs an axis_name"
  with pytest.raises(ValueError, match=bf16):
    immgrad.train_step(oracles.scanned_loss(), tx, reduce_dtype=jnp.bfloat16)
  params = oracles.stacked(unrolled)
  step = immgrad.train_step(oracles.scanned_loss(), tx, axis_name="d")
  unbound = r"^immgrad.train_step\(axis_name='d'\): axis 'd' is not bound"
  with pytest.raises(ValueError, match=unbound):
    step(params, tx.init(params), *_data()[0])


def test_nested_scans_and_multisteps():
  """A stack of stacks (two immgrad.scan levels, the state split twice)
  trains as the same layers unrolled; optax.MultiSteps' accumulated
  gradient is state each layer owns, written in place like adam's moments.
  """
  data = _data()
  keys = jax.random.split(jax.random.PRNGKey(3), 2)
  params = {
    "s": {
      "w": jax.random.normal(keys[0], (2, 3, WIDTH, WIDTH)) / WIDTH**0.5,
      "b": jnp.zeros((2, 3, WIDTH)),
    },
    "head": {"w": jax.random.normal(keys[1], (WIDTH, 3)), "b": jnp.zeros(3)},
  }

  def nested(p, x, y):
    def outer(h, po):
      inner = lambda h, pi: (jnp.tanh(dense(h, pi)), None)
      return immgrad.scan(inner, h, po)[0], None

    h, _ = immgrad.scan(outer, x, p["s"])
    return oracles.mse(dense(h, p["head"]), y)

  def unrolled(p, x, y):
    h = x
    for i in range(2):
      for j in range(3):
        h = jnp.tanh(
          oracles.dense(h, jax.tree.map(lambda a, i=i, j=j: a[i, j], p["s"]))
        )
    return oracles.mse(oracles.dense(h, p["head"]), y)

  for opt in (
    optax.adam(1e-2),
    optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
  ):
    expected = oracles.plain_steps(unrolled, opt, params, data)
    got = oracles.train_steps(nested, opt, params, data, mode="current")
    oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
  opt = optax.adam(1e-2)
  got = oracles.train_steps(nested, opt, params, data, mode="updated")
  reference = oracles.immediate_steps(
    nested, opt, params, data, mode="updated", atomic=False
  )
  oracles.assert_runs_close(got, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("library", ["flax", "equinox"])
def test_flax_nnx_and_equinox(library):
  """An NNX model split into its params, and an Equinox MLP partitioned,
  through their adapters: "current" in place is plain training.
  """
  pytest.importorskip(library)
  data = _data()
  if library == "flax":
    from flax import nnx

    import immgrad.flax

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.a = nnx.Linear(WIDTH, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.b = nnx.Linear(16, 3, rngs=rngs)

      def __call__(self, x):
        return self.b(jax.nn.relu(self.norm(self.a(x))))

    graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
    loss = lambda p, x, y: oracles.mse(nnx.merge(graphdef, p)(x), y)
    adapted = immgrad.flax.immediate(loss)
  else:
    import equinox as eqx

    import immgrad.equinox

    mlp = eqx.nn.MLP(WIDTH, 3, 16, 2, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(mlp, eqx.is_array)
    loss = lambda p, x, y: oracles.mse(jax.vmap(eqx.combine(p, static))(x), y)
    adapted = immgrad.equinox.immediate(loss)
  opt = optax.adam(1e-2)
  expected = oracles.plain_steps(loss, opt, params, data)
  got = oracles.train_steps(adapted, opt, params, data, mode="current")
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)


def test_nnx_scan_over_a_vmapped_stack():
  """Flax's scan-over-layers idiom (blocks made by nnx.vmap, applied by
  nnx.scan), found by immgrad.flax.immediate as a scan over stacked
  parameters, written in place: "current" is plain training.
  """
  pytest.importorskip("flax")
  from flax import nnx

  import immgrad.flax

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
      return jnp.tanh(self.linear(x))

  class Model(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=LAYERS)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def blocks(rngs):
        return Block(rngs)

      self.blocks = blocks(rngs)
      self.head = nnx.Linear(WIDTH, 3, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return block(x)

      return self.head(body(x, self.blocks))

  graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
  loss = lambda p, x, y: oracles.mse(nnx.merge(graphdef, p)(x), y)
  data = _data()
  opt = optax.adam(1e-2)
  expected = oracles.plain_steps(loss, opt, params, data)
  got = oracles.train_steps(
    immgrad.flax.immediate(loss), opt, params, data, mode="current"
  )
  oracles.assert_runs_close(got, expected, atol=ATOL, rtol=RTOL)
