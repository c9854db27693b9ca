"""Folding a parameter-only loss term (an L2 penalty) into its layer's step."""

import collections
import dataclasses

from jax.extend import core as jex_core

from immgrad._src import auto_program as program_lib

# Where a parameter-only term may meet the activations and still fold into
# its layers' steps: added to the loss, or scaled by a number (a weight
# decay passed as an argument).
_TERM_MEETS = frozenset({"add", "sub", "add_any", "mul", "div"})


@dataclasses.dataclass(eq=False)
class _Fold:
  """A layer that also returns its leaves' parameter-only terms."""

  layer: program_lib.Node
  reads: frozenset  # Its parameter leaves.
  penalised: frozenset  # Those of them in terms.
  terms: list  # The terms' value numbers, computed inside the layer.
  outer: list  # The numbers of the layer's extra outputs, the same values.
  users: list  # (node, input position): the terms' uses, to read outer.


def find(program: program_lib.Program, uses: program_lib.Uses):
  """The layers whose leaves are also in foldable parameter-only terms.

  A leaf's uses besides its one layer must all be parameter-only terms
  meeting the activations as ``_TERM_MEETS`` allows, and the values that
  carry them out of the layer's own parameter-only equations (its terms)
  must be numbers (``sum(w ** 2)``), not arrays that other layers'
  parameters join before they are reduced. Returns ``{id(layer): _Fold}``
  and, for the leaves of terms that cannot fold, why.
  """
  folds, why = {}, {}
  consumers = _consumers(program)
  for layer in uses.layers:
    reads = program_lib.reads(layer, uses)
    others = [
      use for leaf in reads for use in uses.sinks[leaf] if use != (layer, None)
    ]
    meets = [node for node, _ in others if node is not None]
    returned = [why for _, why in others if why == program_lib.RETURNED]
    penalised = frozenset(
      leaf for leaf in reads if uses.sinks[leaf] != [(layer, None)]
    )
    if not meets or len(meets) + len(returned) < len(others):
      continue
    if not all(_meets_as_term(node, uses.taint) for node in meets):
      continue
    first = f"`{meets[0].eqn.primitive.name}` ({meets[0].where})"
    if id(layer) in uses.stacked:
      reason = program_lib.Reason(
        "outside",
        f"stacked under `scan` ({layer.where}) and also in a "
        f"parameter-only term of the loss (meeting it at {first}), which "
        f"is not folded into a loop's steps: move the term into the "
        f"optimizer (optax.add_decayed_weights)",
      )
      why.update((leaf, reason) for leaf in penalised)
      continue
    fold = _fold(layer, reads, penalised, program, uses.taint, consumers)
    if any(
      v not in program.avals or program.avals[v].shape for v in fold.terms
    ):
      reason = program_lib.Reason(
        "outside",
        f"also in a parameter-only term of the loss (meeting it at {first}) "
        f"that joins it with other parameters before reducing it to a "
        f"number, so the term cannot be split among the layers' steps (a "
        f"term such as `sum(w ** 2)` can)",
      )
      why.update((leaf, reason) for leaf in penalised)
      continue
    folds[id(layer)] = fold
  return folds, why


def _consumers(program: program_lib.Program) -> dict:
  """Value number -> the nodes that read it, in program order."""
  consumers = collections.defaultdict(list)
  for node in program.nodes:
    for v in node.ins:
      if not isinstance(v, jex_core.Literal):
        consumers[v].append(node)
  return consumers


def _meets_as_term(node: program_lib.Node, taint: dict) -> bool:
  """Whether ``node`` combines a parameter-only number with activations as
  a loss takes a penalty: added, or scaled by a number.
  """
  name = node.eqn.primitive.name
  if name not in _TERM_MEETS:
    return False
  sides = [
    (program_lib.taint_of(taint, u) is program_lib.ACT, v.aval.shape)
    for v, u in zip(node.eqn.invars, node.ins)
  ]
  if any(shape for act, shape in sides if not act):
    return False  # A parameter array (a bias), not a term.
  return name not in ("mul", "div") or not any(
    shape for act, shape in sides if act
  )


def _fold(
  layer: program_lib.Node, reads, penalised, program, taint: dict, consumers
):
  """``layer``'s terms: values from ``reads`` alone that other nodes use."""
  inside = {n for n, t in taint.items() if t and t <= reads}

  def own(node):  # One of the equations computing from ``reads`` alone.
    return node is layer or all(
      isinstance(v, jex_core.Literal) or v in inside or taint[v] == frozenset()
      for v in node.ins
    )

  terms, users = [], []
  for v in sorted(inside):
    found = [
      (node, i)
      for node in consumers[v]
      if not own(node)
      for i, u in enumerate(node.ins)
      if not isinstance(u, jex_core.Literal) and u == v
    ] + [  # Returned too (an aux output): the program's outputs.
      (None, i)
      for i, u in enumerate(program.outs)
      if not isinstance(u, jex_core.Literal) and u == v
    ]
    if found:
      terms.append(v)
      users.extend(found)
  outer = [next(program.counter) for _ in terms]
  return _Fold(layer, reads, penalised, terms, outer, users)


def rewire(program: program_lib.Program, folds: dict) -> None:
  """Makes the terms' users read each folded layer's extra outputs.

  Undoes the rewiring of the layers no longer folded.
  """
  if program.wired is None:
    program.wired = list(program.outs)
  program.outs = list(program.wired)
  regions = {}
  for node in program.nodes:
    if node.wired is None:
      node.wired = list(node.ins), list(node.outs)
    node.ins, node.outs = list(node.wired[0]), list(node.wired[1])
    regions.update((id(r), r) for r in program_lib.regions(node.region))
  for region in regions.values():
    if region.wired is None:
      region.wired = list(region.ins)
    region.ins = list(region.wired)
  for fold in folds.values():
    fold.layer.outs += fold.outer
    outer = dict(zip(fold.terms, fold.outer))
    program.avals.update((outer[v], program.avals[v]) for v in fold.terms)
    for node, i in fold.users:
      if node is None:
        program.outs[i] = outer[program.wired[i]]
        continue
      v = node.wired[0][i]
      node.ins[i] = outer[v]
      for region in program_lib.regions(
        node.region
      ):  # Regions read it from outside.
        region.ins = [
          outer[v] if not isinstance(u, jex_core.Literal) and u == v else u
          for u in region.ins
        ]


def out_of_order(
  program: program_lib.Program, folds: dict, failed: dict
) -> dict:
  """The folds whose terms' users cannot run after their layer.

  Those users are evaluated once the layer has run (``auto_interpret`` defers
  them), which fails if the layer's own input depends on them, or if one
  is inside a ``jax.checkpoint`` that runs before the layer.
  """
  consumers = _consumers(program)
  position = {id(node): i for i, node in enumerate(program.nodes)}
  out = {}
  for key, fold in folds.items():
    if key in failed:
      continue
    seen, todo = set(), list(fold.outer)
    while todo:
      for node in consumers[todo.pop()]:
        if id(node) in seen:
          continue
        seen.add(id(node))
        late = position[id(node)] < position[id(fold.layer)]
        if node is fold.layer or (
          late and program_lib.checkpoint_of(node.region)
        ):
          user = fold.users[0][0] or node
          out[key] = program_lib.Reason(
            "outside",
            f"also in a parameter-only term that meets the activations at "
            f"`{user.eqn.primitive.name}` ({user.where}), "
            + (
              "which its layer's own input depends on"
              if node is fold.layer
              else "inside a `jax.checkpoint` that runs before its layer"
            )
            + ", so the layer cannot compute the term",
          )
          todo = []
          break
        todo.extend(node.outs)
  return out
