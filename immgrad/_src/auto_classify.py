"""Which equations of a traced function are immediate layers, and why not others.

Each value is tainted with the parameter leaves it derives from; an
equation where parameter-only values meet activations is a layer, immediate
when its leaves reach nothing else.
"""

import jax
import jax.core
from jax.extend import core as jex_core

from immgrad._src import auto_fold as fold_lib
from immgrad._src import auto_program as program_lib
from immgrad._src import jaxpr as jaxpr_lib

_ONE_LAYER = frozenset(
  {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
)


_REFUSED = {
  "cond": "compute both branches and pick with `jnp.where`, or let the "
  "`cond` choose parameters only, not activations",
  "while": "unroll the loop in Python, or keep the parameters out of it",
}


_BRANCH = (
  "immgrad.immediate: parameter {path} meets activations inside `{prim}` "
  "({where}). A branch or a loop may run a layer zero or many times a "
  "step, and each run would step the weights. To make it immediate, "
  "{fix}."
)


_UNSUPPORTED = (
  "immgrad.immediate: parameter {path} meets activations inside `{prim}` "
  "({where}), which immgrad.immediate does not support yet. Keep "
  "parameters out of a scan's carry (scan over them as xs), or decorate "
  "the layer with immgrad.immediate_layer, or use a library adapter "
  "(immgrad.haiku, immgrad.flax, immgrad.equinox)."
)


def classify(
  program: program_lib.Program, params: dict, paths: list
) -> program_lib.Plan:
  """Follows parameters through ``program``; decides the immediate layers.

  A parameter-only term combined with the loss (an L2 penalty) whose part
  computed from one layer's leaves alone is a number (``sum(w ** 2)``) is
  *folded* into that layer: the layer computes the number from its raw
  leaves and returns it too, and ``program`` is rewired so that the rest
  of the term reads it there. Its gradient then reaches the layer's
  backward rule with ``dy``, and the layer steps on both.
  """
  first = _follow(program, params, paths)
  folds, why = fold_lib.find(program, first)
  while True:
    fold_lib.rewire(program, folds)
    uses = _follow(program, params, paths) if folds else first
    plan, failed = _decide(program, params, paths, uses, folds)
    if not failed:
      break
    for key, reason in failed.items():
      why.update((leaf, reason) for leaf in folds.pop(key).penalised)
  plan.ordinary.update(
    (leaf, reason) for leaf, reason in why.items() if leaf in plan.ordinary
  )
  return plan


def _follow(
  program: program_lib.Program, params: dict, paths: list
) -> program_lib.Uses:
  """Taints every value with the leaves it derives from; finds the layers.

  Values that derive from the parameters alone (a cast, a transpose, a
  broadcast, ``A @ B``, weight standardisation) are *preprocessing*; those
  from the other arguments are *activations*. An equation that combines the
  two (``dot_general``, ``conv_general_dilated``, the ``mul`` of a norm's
  scale, the ``gather`` of an embedding, a ``custom_jvp``/``custom_vjp`` call)
  is a *layer*.
  """
  taint: dict = {n: frozenset() for n in program.consts}
  for n in program.inputs:
    if n is not None:
      taint[n] = program_lib.ACT
  for n, leaf in params.items():
    taint[n] = frozenset({leaf})
  for n, value in program.consts.items():
    if isinstance(value, jax.core.Tracer):  # Closed over from the caller.
      taint[n] = program_lib.ACT
  sinks = {leaf: [] for leaf in params.values()}
  layers, scans, stacked = [], {}, {}
  for node in _in_order(program):
    ins: list = [
      frozenset()
      if isinstance(v, jex_core.Literal)
      else taint.get(v, program_lib.ACT)
      for v in node.ins
    ]
    act = any(t is program_lib.ACT for t in ins)
    reads = frozenset().union(*[t for t in ins if t is not program_lib.ACT])
    if act and reads:
      _check_mixed(node, ins, paths)
      if node.eqn.primitive.name == "scan":
        scans[id(node)], stacked[id(node)] = _plan_scan(
          node, ins, params, paths, program.counter, sinks
        )
        if stacked[id(node)]:
          layers.append(node)
      else:
        layers.append(node)
        for leaf in reads:
          sinks[leaf].append((node, None))
    for n in node.outs:
      taint[n] = program_lib.ACT if act else reads
  for v in program.outs:
    for leaf in program_lib.taint_of(taint, v) or ():
      sinks[leaf].append((None, program_lib.RETURNED))
  return program_lib.Uses(taint, sinks, layers, scans, stacked)


def _in_order(program: program_lib.Program) -> list:
  """``program.nodes``, each after the equations its inputs come from.

  Program order, but for the users of folded layers' terms, which wait
  for their layer. (Those in a cycle come last, unresolved: such a fold is
  undone, see ``auto_fold.out_of_order``.)
  """
  known = set(program.consts) | {n for n in program.inputs if n is not None}
  order, waiting, wanted = [], [], set()

  def missing(node):
    return {
      v
      for v in node.ins
      if not isinstance(v, jex_core.Literal) and v not in known
    }

  for node in program.nodes:
    if missing(node):
      waiting.append(node)
      wanted |= missing(node)
      continue
    order.append(node)
    known.update(node.outs)
    while wanted & known:
      ready = [n for n in waiting if not missing(n)]
      waiting = [n for n in waiting if missing(n)]
      wanted = set().union(*map(missing, waiting))
      for n in ready:
        order.append(n)
        known.update(n.outs)
  return order + waiting


def _decide(
  program, params: dict, paths: list, uses: program_lib.Uses, folds: dict
):
  """The plan ``uses`` gives; and the folds that fail, with why.

  A layer is immediate when every parameter leaf it reads reaches nothing but
  it. A leaf that reaches two layers (tied embeddings), a loop that reuses it
  every iteration (a ``lax.scan`` closing over it), the function's output or a
  term that cannot be folded keeps an ordinary gradient, as does every leaf
  its layer reads with it, and a layer inside a ``jax.checkpoint`` that is
  handed weights computed outside it.
  """
  taint, sinks = uses.taint, uses.sinks
  immediate, ordinary, preprocess, terms = {}, {}, {}, {}
  producer = {n: node for node in program.nodes for n in node.outs}
  raw_of = {leaf: n for n, leaf in params.items()}
  for node in uses.layers:
    reads = program_lib.reads(node, uses)
    shared = [leaf for leaf in reads if sinks[leaf] != [(node, None)]]
    raw = sorted(raw_of[leaf] for leaf in reads)
    pre = _preprocess(node.ins, taint, producer)
    outside = _outside(node, raw, pre)
    for leaf in reads:
      if not shared and not outside:
        immediate[leaf] = node
        fold = folds.get(id(node))
        if fold is None:
          preprocess[id(node)] = raw, pre
        else:  # Its equations compute the terms too.
          terms[id(node)] = fold.terms, fold.outer
          preprocess[id(node)] = (
            raw,
            _preprocess(list(node.ins) + fold.terms, taint, producer),
          )
      elif leaf in shared:
        ordinary[leaf] = _why(sinks[leaf])
      elif shared:
        ordinary[leaf] = program_lib.Reason(
          "shares",
          f"its layer `{node.eqn.primitive.name}` "
          f"({node.where}) also reads {paths[shared[0]]}, "
          f"which is ordinary",
        )
      elif outside:
        ordinary[leaf] = program_lib.Reason(
          "computed",
          f"its layer `{node.eqn.primitive.name}` ({node.where}) is inside "
          f"`{outside.eqn.primitive.name}` ({outside.where}), which gets "
          f"its weights computed, not the parameters themselves",
        )
  for leaf, leaf_uses in sinks.items():
    if leaf not in immediate and leaf not in ordinary:
      ordinary[leaf] = (
        _why(leaf_uses) if leaf_uses else program_lib.Reason("unused", "unused")
      )
  failed = {
    key: ordinary[min(fold.reads & ordinary.keys())]
    for key, fold in folds.items()
    if key not in terms
  }
  failed.update(fold_lib.out_of_order(program, folds, failed))
  plan = program_lib.Plan(
    params, taint, immediate, preprocess, ordinary, uses.scans
  )
  plan.terms = terms
  return plan, failed


def _plan_scan(
  node: program_lib.Node,
  ins: list,
  params: dict,
  paths: list,
  counter,
  sinks: dict,
):
  """Plans a ``scan`` that parameters enter: its body, for stacked ones.

  A parameter closed over by the body (a scan's constant) is reused by
  every iteration: ordinary. A stacked parameter scanned over as it is
  (an ``xs`` of the scan) is planned inside the body, where each iteration
  sees one layer's slice; those the body makes immediate run through
  ``immgrad.scan``. Returns the body and its plan, and those leaves.
  """
  consts = node.eqn.params["num_consts"]
  body = program_lib.build(node.eqn.params["jaxpr"], counter)
  slices = {}
  for i, (v, t) in enumerate(zip(node.ins, ins)):
    if t is program_lib.ACT or not t:
      continue
    if i < consts:
      why = program_lib.Reason(
        "loop", f"reused by every iteration of `scan` ({node.where})"
      )
    elif v in params:
      slices[body.inputs[i]] = params[v]
      continue
    else:
      why = program_lib.Reason(
        "computed",
        f"scanned over by `scan` ({node.where}) after being computed: "
        f"pass the stacked parameter itself as xs",
      )
    for leaf in t:
      sinks[leaf].append((None, why))
  plan = classify(body, slices, paths)
  stepped = frozenset(plan.immediate)
  for leaf in slices.values():
    if leaf in stepped:
      sinks[leaf].append((node, None))
    else:
      inner = plan.ordinary[leaf]
      sinks[leaf].append(
        (
          None,
          program_lib.Reason(
            inner.kind, f"inside `scan` ({node.where}), its slice is {inner}"
          ),
        )
      )
  return (body, plan), stepped


def _preprocess(values: list, taint: dict, producer: dict) -> list:
  """The parameter-only equations the parameter-only ``values`` need."""
  pre, seen = [], set()

  def need(v):
    if isinstance(v, jex_core.Literal) or v in seen or v not in producer:
      return
    node = producer[v]
    seen.update(node.outs)
    for u in node.ins:
      need(u)
    pre.append(node)

  for v in values:
    if isinstance(v, jex_core.Literal) or taint[v] is not program_lib.ACT:
      need(v)
  return pre


def _outside(
  node: program_lib.Node, raw: list, pre: list
) -> program_lib.Region | None:
  """The checkpoint region around ``node`` its weights do not enter raw.

  Inside ``immgrad.checkpoint`` a layer finds its parameters among the
  region's arguments only: each raw leaf must be one, and the weights
  computed from them, inside.
  """
  for region in program_lib.regions(node.region):
    if region.checkpoint and any(n not in region.ins for n in raw):
      return region
  here = program_lib.checkpoint_of(node.region)
  for p in pre:
    if program_lib.checkpoint_of(p.region) is not here:
      return here or program_lib.checkpoint_of(p.region)
  return None


def _why(uses) -> program_lib.Reason:
  """Why a leaf with these uses keeps an ordinary gradient.

  A layer with a scalar output (``loss + penalty``) is a term of the
  parameters combined with the loss: the leaf is read outside its layer.
  """
  layers = [node for node, _ in uses if node is not None]
  others = [why for node, why in uses if node is None]
  if others:
    return program_lib.Reason(
      others[0].kind,
      others[0].text
      + (f", and read by {len(layers)} layer(s)" if layers else ""),
    )
  terms = [n for n in layers if not n.eqn.outvars[0].aval.shape]
  if terms:
    rest = [n for n in layers if n not in terms]
    return program_lib.Reason(
      "outside",
      f"in a term of the parameters combined with the loss by "
      f"{_named(terms[:1])}"
      + (f", and read by {_named(rest)}" if rest else ""),
    )
  return program_lib.Reason(
    "tied", f"read by {len(set(layers))} layers: {_named(layers)}"
  )


def _named(nodes: list) -> str:
  return ", ".join(f"`{n.eqn.primitive.name}` ({n.where})" for n in nodes)


def _check_mixed(node: program_lib.Node, ins: list, paths: list) -> None:
  """Refuses parameters meeting activations where no layer can step once."""
  name = node.eqn.primitive.name
  first = paths[
    min(frozenset().union(*[t for t in ins if t is not program_lib.ACT]))
  ]
  if name in _REFUSED:
    raise ValueError(
      _BRANCH.format(
        path=first, prim=name, where=node.where, fix=_REFUSED[name]
      )
    )
  if name == "scan":
    consts = node.eqn.params["num_consts"]
    carry = ins[consts : consts + node.eqn.params["num_carry"]]
    if any(t is not program_lib.ACT and t for t in carry):
      raise ValueError(
        _UNSUPPORTED.format(path=first, prim=name, where=node.where)
      )
  elif name not in _ONE_LAYER and jaxpr_lib.has_program(node.eqn.params):
    raise ValueError(
      _UNSUPPORTED.format(path=first, prim=name, where=node.where)
    )
