"""``axes.py`` directly: averaging over a data-parallel axis, under
``jax.vmap(axis_name=...)`` and ``jax.shard_map`` over the suite's four
simulated CPU devices (``conftest.py``), against means computed by hand.

All values are small multiples of powers of two, so every sum and mean is
exact in float32 and the checks are exact.
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from immgrad._src import axes
from immgrad._src import compat

_N = 4  # Devices, and the size of the vmapped axis.
# One row per device: the local values.
_X = np.array(
  [[1.0, -2.0, 0.5], [3.0, 0.0, 0.25], [-1.0, 4.0, 1.0], [5.0, 2.0, -0.75]],
  np.float32,
)


def _mesh():
  return Mesh(np.array(jax.devices()[:_N]), ("d",))


def _shard_map(fun, in_specs, out_specs, check_vma):
  return jax.jit(
    jax.shard_map(
      fun,
      mesh=_mesh(),
      in_specs=in_specs,
      out_specs=out_specs,
      check_vma=check_vma,
    )
  )


def test_mean_averages_every_leaf_over_the_axis():
  tree = {"x": _X, "y": 2.0 * _X[:, :2]}
  got = jax.vmap(lambda t: axes.mean(t, "i"), axis_name="i")(tree)
  np.testing.assert_array_equal(got["x"], np.broadcast_to(_X.mean(0), _X.shape))
  np.testing.assert_array_equal(
    got["y"], np.broadcast_to(2.0 * _X[:, :2].mean(0), (_N, 2))
  )


def test_mean_over_no_axis_is_the_identity():
  assert axes.mean(_X, None) is _X


def test_mean_in_a_reduce_dtype_averages_in_it_and_returns_the_own_dtype():
  """1 + 2**-10 is exact in float32 and rounds to 1 in bfloat16 (8 bits of
  mantissa): averaged in bfloat16, the mean of four copies is 1.
  """
  x = np.full((_N, 3), 1.0 + 2.0**-10, np.float32)
  in_f32 = jax.vmap(lambda v: axes.mean(v, "i"), axis_name="i")(x)
  in_bf16 = jax.vmap(lambda v: axes.mean(v, "i", jnp.bfloat16), axis_name="i")(
    x
  )
  np.testing.assert_array_equal(in_f32, x)
  assert in_bf16.dtype == jnp.float32
  np.testing.assert_array_equal(in_bf16, np.ones_like(x))


@pytest.mark.parametrize("check_vma", [True, False])
def test_local_keeps_an_invariant_weight_s_gradient_on_each_device(check_vma):
  """``w`` is replicated, ``x`` one row per device. The gradient of
  ``sum(v * x)`` with respect to ``v = local(w)`` is the device's own row;
  with respect to ``w`` itself, under ``check_vma``, JAX sums it over the
  devices (the trap ``local`` avoids).
  """
  w = np.ones(3, np.float32)

  def grads(w, x):
    v = axes.local(w, "d")
    own = jax.grad(lambda v: jnp.sum(v * x[0]))(v)
    plain = jax.grad(lambda w: jnp.sum(w * x[0]))(w)
    return own[None], plain[None]

  own, plain = _shard_map(grads, (P(), P("d")), P("d"), check_vma)(w, _X)
  np.testing.assert_array_equal(own, _X)
  summed = np.broadcast_to(_X.sum(0), _X.shape)
  np.testing.assert_array_equal(plain, summed if check_vma else _X)


def test_tracks_vma_only_under_shard_map_with_check_vma():
  def tracks(x):
    return jnp.full((1,), axes.tracks_vma("d")), x[:1]

  for check_vma in (True, False):
    tracked, _ = _shard_map(tracks, (P("d"),), P("d"), check_vma)(_X[:, 0])
    assert tracked.tolist() == [check_vma] * _N
  assert not jax.vmap(lambda x: axes.tracks_vma("i"), axis_name="i")(_X).any()


def test_mean_of_cotangent_of_a_replicated_weight_divides_jax_s_sum():
  """Under ``check_vma`` the cotangent of an invariant weight arrives
  summed (here: ``psum`` of the rows): the mean divides it by the axis
  size, and a varying weight's cotangent is averaged.
  """

  def means(w, x):
    summed = jax.lax.psum(x[0], "d")
    invariant = axes.mean_of_cotangent(summed, w, "d")
    varying = axes.mean_of_cotangent(x[0], x[0], "d")
    assert "d" not in compat.varying_axes(invariant)
    return invariant[None], varying[None]

  w = np.ones(3, np.float32)
  invariant, varying = _shard_map(means, (P(), P("d")), P("d"), True)(w, _X)
  expected = np.broadcast_to(_X.mean(0), _X.shape)
  np.testing.assert_array_equal(invariant, expected)
  np.testing.assert_array_equal(varying, expected)


def test_mean_of_cotangent_without_tracking_averages():
  got = jax.vmap(
    lambda c: axes.mean_of_cotangent(c, jnp.ones(3), "i"), axis_name="i"
  )(_X)
  np.testing.assert_array_equal(got, np.broadcast_to(_X.mean(0), _X.shape))


def test_an_unbound_axis_is_refused_naming_it_and_the_front():
  front = "immgrad.train_step"
  with pytest.raises(
    ValueError, match=r"train_step\(axis_name='d'\): axis 'd' is not"
  ):
    axes.check_bound("d", front)
  jax.vmap(lambda x: axes.check_bound("i", front), axis_name="i")(_X)


def test_reduce_dtype_must_be_floating_and_needs_an_axis():
  front = "immgrad.value_and_grad"
  assert axes.reduce_dtype_of("bfloat16", "d", front) == jnp.bfloat16
  assert axes.reduce_dtype_of(None, None, front) is None
  with pytest.raises(ValueError, match=r"expected a floating dtype.*int32"):
    axes.reduce_dtype_of(jnp.int32, "d", front)
  with pytest.raises(ValueError, match=r"reduce_dtype=bfloat16\) needs an"):
    axes.reduce_dtype_of(jnp.bfloat16, None, front)
