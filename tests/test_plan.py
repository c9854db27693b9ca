"""``plan.py`` directly: ``tx.update`` on a whole params tree, cut into one
program per parameter and one for the state no parameter owns.

The reference is optax itself: ``tx.update`` on the whole tree, restricted
to one leaf.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from immgrad._src import plan

# Adam's state flattened: (count, mu['a'], mu['b'], nu['a'], nu['b']).
_COUNT, _MU_A, _MU_B, _NU_A, _NU_B = range(5)


def _params():
  return {
    "a": jnp.arange(6.0).reshape(2, 3) - 2.5,
    "b": jnp.linspace(-1.0, 1.0, 4),
  }


def _grads():
  return {
    "a": jnp.sin(jnp.arange(6.0)).reshape(2, 3),
    "b": jnp.cos(jnp.arange(4.0)),
  }


@pytest.mark.parametrize("tx", [optax.adam(0.1), optax.adamw(0.1)])
def test_each_parameter_reads_and_writes_its_own_moments_and_the_shared_count(
  tx,
):
  cut = plan.cut(tx, _params())
  a, b = cut.leaves
  assert a.reads == (_COUNT, _MU_A, _NU_A) and a.writes == (_MU_A, _NU_A)
  assert b.reads == (_COUNT, _MU_B, _NU_B) and b.writes == (_MU_B, _NU_B)
  assert cut.shared_positions == (_COUNT,)
  assert a.param_aval == jax.ShapeDtypeStruct((2, 3), jnp.float32)
  assert [r.shape for r in a.read_avals] == [(), (2, 3), (2, 3)]


@pytest.mark.parametrize("tx", [optax.adam(0.1), optax.adamw(0.1, 0.5)])
def test_a_leaf_program_is_optax_s_update_of_the_whole_tree_on_that_leaf(tx):
  """After one step (so the moments and count are not their init), each
  leaf's program on its own state leaves gives optax's update and new state
  of that leaf; the shared program gives optax's new count. Compared to a
  relative 1e-6: the same float32 operations, but XLA may fuse the whole
  tree's update differently from one leaf's.
  """
  params, grads = _params(), _grads()
  state = tx.init(params)
  _, state = tx.update(jax.tree.map(lambda g: -g, grads), state, params)
  updates, new_state = tx.update(grads, state, params)
  old, new = jax.tree.leaves(state), jax.tree.leaves(new_state)

  cut = plan.cut(tx, params)
  for name, leaf in zip(["a", "b"], cut.leaves):
    update, written = leaf(
      grads[name], params[name], [old[k] for k in leaf.reads]
    )
    np.testing.assert_allclose(update, updates[name], rtol=1e-6)
    assert len(written) == len(leaf.writes)
    for k, value in zip(leaf.writes, written):
      np.testing.assert_allclose(value, new[k], rtol=1e-6)
  (count,) = cut.shared(*[old[k] for k in cut.shared_positions])
  assert count == new[_COUNT] == 2


def test_a_rule_that_mixes_parameters_is_refused_naming_it_and_the_fix():
  """Alone, the clip's update of each parameter reads every gradient;
  before adam, adam's moments keep values computed from all of them.
  """
  with pytest.raises(plan.NotSeparable, match="update of one parameter"):
    plan.make(optax.clip_by_global_norm(1.0), _params())
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
  with pytest.raises(plan.NotSeparable, match="several parameters"):
    plan.make(tx, _params())
  with pytest.raises(
    ValueError,
    match=r"shim\(chain: clip_by_global_norm\).*Replace optax\.clip_by_global_norm",
  ):
    plan.cut(tx, _params())


def test_a_state_leaf_that_reads_another_parameter_s_state_is_refused():
  """Each state leaf is owned by one parameter, yet the new state of 'a'
  reads the old state of 'b'.
  """

  def init(params):
    return jax.tree.map(jnp.zeros_like, params)

  def update(updates, state, params=None):
    del params
    return updates, {
      "a": state["a"] + updates["a"] + state["b"].sum(),
      "b": state["b"] + updates["b"],
    }

  tx = optax.GradientTransformation(init, update)
  with pytest.raises(plan.NotSeparable, match="new state of one parameter"):
    plan.make(tx, _params())


def test_check_refuses_a_mixing_rule_early_and_leaves_masks_to_init():
  """``check`` cuts ``tx`` on a probe tree; a ``tx`` whose mask is shaped
  like the real params does not run on the probe and is left to be cut at
  ``init``, where the real tree is known.
  """
  with pytest.raises(ValueError, match="clip_by_global_norm"):
    plan.check(optax.clip_by_global_norm(1.0))
  masked = optax.masked(optax.clip_by_global_norm(1.0), {"w": True, "v": True})
  assert not plan.runs_on(masked, {"a": jnp.ones(2), "b": jnp.ones(2)})
  plan.check(masked)  # Not refused yet: it needs params shaped like its mask.
  with pytest.raises(ValueError, match="clip_by_global_norm"):
    plan.cut(masked, {"w": jnp.ones(2), "v": jnp.ones(3)})
