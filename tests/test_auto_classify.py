"""``auto_classify.py`` and ``auto_fold.py`` directly: on the traced loss of
a two-layer MLP, which equations are layers, which parameter leaves they
step, and which weight uses (an L2 term) fold into their layer's step.

Flattened, the arguments are ``b1, b2, w1, w2`` (the params dict, keys
sorted) and then ``x``; ``_plan`` numbers them 0 to 4 as ``auto.py`` does.
"""

import jax
import jax.numpy as jnp

from immgrad._src import auto_classify as classify_lib
from immgrad._src import auto_program as program_lib

_X = jnp.ones((5, 3))


def _params(*names):
  shapes = {"w1": (3, 4), "b1": (4,), "w2": (4, 2), "b2": (2,)}
  return {name: jnp.ones(shapes[name]) for name in names}


def _plan(loss, params):
  """``loss(params, x)`` traced and classified; the program, the plan,
  and the plan's immediate layers and ordinary leaves by parameter path.
  """
  keyed, _ = jax.tree_util.tree_flatten_with_path(params)
  paths = [jax.tree_util.keystr(k) for k, _ in keyed]
  leaves, treedef = jax.tree.flatten((params, _X))
  program = program_lib.trace(loss, leaves, treedef, list(range(len(leaves))))
  raw = {program.inputs[i]: i for i in range(len(paths))}
  plan = classify_lib.classify(program, raw, paths)
  immediate = {paths[leaf]: node for leaf, node in plan.immediate.items()}
  ordinary = {paths[leaf]: why for leaf, why in plan.ordinary.items()}
  return program, plan, immediate, ordinary


def _mlp(p, x):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return h @ p["w2"] + p["b2"]


def _with_l2(p, x):
  l2 = jnp.sum(p["w1"] ** 2) + jnp.sum(p["w2"] ** 2)
  return jnp.mean(_mlp(p, x) ** 2) + 0.01 * l2


def test_each_weight_and_bias_is_stepped_by_its_own_layer():
  program, plan, immediate, ordinary = _plan(
    _with_l2, _params("w1", "b1", "w2", "b2")
  )
  b1, b2, w1, w2, x = program.inputs
  assert ordinary == {}
  names = {path: node.eqn.primitive.name for path, node in immediate.items()}
  assert names == {
    "['w1']": "dot_general",
    "['b1']": "add",
    "['w2']": "dot_general",
    "['b2']": "add",
  }
  assert immediate["['w1']"].ins == [x, w1]  # x @ w1.
  assert w2 in immediate["['w2']"].ins and x not in immediate["['w2']"].ins
  # The bias layers add the broadcast bias: preprocessing of the raw leaf.
  raw, pre = plan.preprocess[id(immediate["['b1']"])]
  assert raw == [b1] and [n.eqn.primitive.name for n in pre] == [
    "broadcast_in_dim"
  ]
  assert plan.preprocess[id(immediate["['b2']"])][0] == [b2]


def test_an_l2_term_of_each_weight_folds_into_that_weight_s_layer():
  """Each layer computes ``sum(w ** 2)`` of its own raw weight, and the
  loss reads the term from the layer's extra output, not from the
  equations it was traced as.
  """
  program, plan, immediate, _ = _plan(_with_l2, _params("w1", "b1", "w2", "b2"))
  producer = {n: node for node in program.nodes for n in node.outs}
  readers = {
    v for node in program.nodes for v in node.ins if isinstance(v, int)
  }
  for name, number in (("w1", program.inputs[2]), ("w2", program.inputs[3])):
    layer = immediate[f"['{name}']"]
    (term,), (outer,) = plan.terms[id(layer)]
    reduce = producer[term]
    assert reduce.eqn.primitive.name == "reduce_sum"
    assert reduce.eqn.outvars[0].aval.shape == ()
    (square,) = [producer[v] for v in reduce.ins]
    assert square.eqn.primitive.name == "integer_pow" and square.ins == [number]
    assert outer in readers and term not in readers
  for name in ("b1", "b2"):
    assert id(immediate[f"['{name}']"]) not in plan.terms


def test_a_term_that_joins_two_weights_before_reducing_does_not_fold():
  def joined(p, x):
    return jnp.mean(_mlp(p, x) ** 2) + 0.01 * jnp.sum(p["w1"] @ p["w2"])

  _, plan, immediate, ordinary = _plan(joined, _params("w1", "b1", "w2", "b2"))
  assert set(immediate) == {"['b1']", "['b2']"} and plan.terms == {}
  for path in ("['w1']", "['w2']"):
    assert ordinary[path].kind == "outside"
    assert "joins it with other parameters" in ordinary[path].text


def test_a_weight_read_by_two_layers_keeps_an_ordinary_gradient():
  def tied(p, x):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w1"].T) ** 2)

  _, _, immediate, ordinary = _plan(tied, _params("w1", "b1"))
  assert set(immediate) == {"['b1']"}
  assert ordinary["['w1']"].kind == "tied"
  assert ordinary["['w1']"].text.startswith("read by 2 layers: `dot_general`")
