"""``immediate`` and ``layers``: immediate layers found in the traced program.

``immediate(fun)`` needs no adapter and no decorated layer: it traces
``fun`` to a jaxpr and runs each equation that combines parameter-only
values with activations as an ``immediate_layer``, where its parameter
leaves reach nothing else (``docs/auto.md``).
"""

import collections
import dataclasses
import functools
import threading
from typing import Any, Callable, Mapping, MutableMapping, Optional

import jax
import jax.core
from jax.extend import core as jex_core
from jax.extend import source_info_util
import jax.numpy as jnp
import numpy as np

from immgrad._src import callsite
from immgrad._src import compat
from immgrad._src import context
from immgrad._src import ordinary as ordinary_lib
from immgrad._src import remat as remat_lib
from immgrad._src import scan as scan_lib
from immgrad._src.layer import immediate_layer

_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})
_REMAT = frozenset({"remat2", "checkpoint"})
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

_ARGUMENT_NOT_A_PARAMETER = (
  "immgrad.immediate: params{path} (argument {argnums}) is not a parameter "
  "leaf given to immgrad.value_and_grad. Pass the params tree the step "
  "hands the loss, unchanged; cast or transform it inside `fun`."
)
_CLOSED_OVER = (
  "immgrad.immediate: {fun} closes over the parameter params{path} instead of "
  "taking it in its params tree (argument {argnums}), so it would keep an "
  "ordinary gradient unnoticed. Pass it in the params tree."
)


@dataclasses.dataclass(eq=False)
class _Region:
  """A ``jax.checkpoint`` or ``jit`` call, inlined: nodes[start:end]."""

  eqn: Any
  ins: list
  outs: list
  start: int
  end: int
  parent: Optional["_Region"]
  checkpoint: bool = True  # False: a ``jit`` call.
  wired: Any = None  # ins as traced, before folding rewires them.

  @property
  def where(self) -> str:
    return callsite.user_line(self.eqn.source_info)


@dataclasses.dataclass(eq=False)
class _Node:
  """One equation, with inputs and outputs renamed to program-wide ints."""

  eqn: Any
  ins: list  # An int (a value of the program) or a Literal.
  outs: list
  region: _Region | None = None  # The innermost checkpoint around it.
  wired: Any = None  # (ins, outs) as traced, before folding rewires them.

  @property
  def where(self) -> str:
    return callsite.user_line(self.eqn.source_info)


def _regions(region: _Region | None) -> list:
  """``region`` and the regions around it, innermost first."""
  chain = []
  while region is not None:
    chain.append(region)
    region = region.parent
  return chain


def _checkpoint_of(region: _Region | None) -> _Region | None:
  """The innermost checkpoint region at or around ``region``."""
  return next((r for r in _regions(region) if r.checkpoint), None)


@dataclasses.dataclass
class _Program:
  """``fun`` as a flat list of equations over numbered values."""

  nodes: list
  inputs: list  # The numbers of the traced arguments, in order.
  consts: dict  # number -> value (the jaxpr's constants).
  outs: list  # Numbers (or Literals) of the outputs.
  out_tree: Any
  avals: dict  # number -> abstract value, for the equations' outputs.
  counter: Any  # Numbers the values of inner programs (scan bodies).
  wired: Any = None  # outs as traced, before folding rewires them.


def _trace(fun, leaves, treedef) -> _Program:
  """Traces ``fun(*treedef.unflatten(leaves))``, inlining nested calls.

  Each ``jax.checkpoint`` and ``jit`` call is inlined as a region: the
  evaluation runs a checkpoint under ``immgrad.checkpoint``, and a
  ``jit`` inlined, or either as it was if it holds no layer (a ``jit``
  reading no parameter either).

  Non-array leaves (flags, None, Python numbers) are static, as under jit.
  """
  dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

  def flat(*values):
    full = list(leaves)
    for i, v in zip(dynamic, values):
      full[i] = v
    return fun(*treedef.unflatten(full))

  closed, shape = jax.make_jaxpr(flat, return_shape=True)(
    *[leaves[i] for i in dynamic]
  )
  counter = iter(range(1 << 62))
  program = _build(closed, counter)
  position = {i: n for i, n in zip(dynamic, program.inputs)}
  program.inputs = [position.get(i) for i in range(len(leaves))]
  program.out_tree = jax.tree.structure(shape)
  return program


def _build(closed, counter) -> _Program:
  """``closed`` (a ClosedJaxpr) as a _Program; ``counter`` numbers values."""
  nodes, consts, avals = [], {}, {}

  def read(env, v):
    return v if isinstance(v, jex_core.Literal) else env[v]

  def inline(jaxpr, const_values, args, region):
    env = {}
    for v, value in zip(jaxpr.constvars, const_values):
      env[v] = next(counter)
      consts[env[v]] = value
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      ins = [read(env, v) for v in eqn.invars]
      name = eqn.primitive.name
      if name in _INLINED or name in _REMAT:
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if not isinstance(inner, jex_core.ClosedJaxpr):
          inner = jex_core.ClosedJaxpr(inner, ())
        child = _Region(eqn, ins, [], len(nodes), 0, region, name in _REMAT)
        outs = inline(inner.jaxpr, inner.consts, ins, child)
        child.outs, child.end = outs, len(nodes)
        env.update(zip(eqn.outvars, outs))
        continue
      outs = [next(counter) for _ in eqn.outvars]
      env.update(zip(eqn.outvars, outs))
      avals.update((n, v.aval) for n, v in zip(outs, eqn.outvars))
      nodes.append(_Node(eqn, ins, outs, region))
    return [read(env, v) for v in jaxpr.outvars]

  inputs = [next(counter) for _ in closed.jaxpr.invars]
  outs = inline(closed.jaxpr, closed.consts, inputs, None)
  return _Program(nodes, inputs, consts, outs, None, avals, counter)


def _is_array(x) -> bool:
  return isinstance(
    x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
  )


def _is_float(x) -> bool:
  return _is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact)


@dataclasses.dataclass
class _Plan:
  """Which equations are layers, and which parameter leaves they step."""

  params: dict  # value number -> parameter leaf index (float leaves only).
  taint: dict  # value number -> frozenset of leaf indices, or None (act).
  immediate: dict  # leaf index -> its immediate layer _Node.
  preprocess: dict  # id(layer) -> (raw value numbers, parameter-only nodes).
  ordinary: dict  # leaf index -> the Reason it keeps an ordinary gradient.
  scans: dict  # id(scan node) -> (its body _Program, the body's _Plan).
  # id(layer) -> the parameter-only terms it also returns (folded L2
  # terms): the value numbers it computes them as, and those it returns.
  terms: dict = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def layers(self) -> frozenset:
    """The ids of the immediate layers' nodes."""
    return frozenset(id(node) for node in self.immediate.values())


_ACT = None  # The taint of a value that depends on an activation.

# Where a parameter-only term may meet the activations and still fold into
# its layers' steps: added to the loss, or scaled by a number (a weight
# decay passed as an argument).
_TERM_MEETS = frozenset({"add", "sub", "add_any", "mul", "div"})


@dataclasses.dataclass
class _Uses:
  """What :func:`_follow` finds: the values' taints, each leaf's uses."""

  taint: dict
  sinks: dict  # leaf -> [(layer node, None) or (None, why)].
  layers: list  # The nodes where parameter-only values meet activations.
  scans: dict
  stacked: dict  # id(scan node) -> the stacked leaves it steps.


@dataclasses.dataclass(eq=False)
class _Fold:
  """A layer that also returns its leaves' parameter-only terms."""

  layer: _Node
  reads: frozenset  # Its parameter leaves.
  penalised: frozenset  # Those of them in terms.
  terms: list  # The terms' value numbers, computed inside the layer.
  outer: list  # The numbers of the layer's extra outputs, the same values.
  users: list  # (node, input position): the terms' uses, to read outer.


@dataclasses.dataclass(frozen=True)
class Reason:
  """Why a parameter leaf keeps an ordinary gradient: a kind and the text.

  ``kind`` is one of ``ordinary.FIXES``' keys (``"tied"``, ``"outside"``,
  ``"loop"``, ``"computed"``, ``"shares"``) or ``"unused"``.
  """

  kind: str
  text: str

  def __str__(self) -> str:
    return self.text


_RETURNED = Reason("outside", "returned by the function")


def _plan(program: _Program, params: dict, paths: list) -> _Plan:
  """Follows parameters through ``program``; decides the immediate layers.

  A parameter-only term combined with the loss (an L2 penalty) whose part
  computed from one layer's leaves alone is a number (``sum(w ** 2)``) is
  *folded* into that layer: the layer computes the number from its raw
  leaves and returns it too, and ``program`` is rewired so that the rest
  of the term reads it there. Its gradient then reaches the layer's
  backward rule with ``dy``, and the layer steps on both.
  """
  first = _follow(program, params, paths)
  folds, why = _folds(program, first)
  while True:
    _rewire(program, folds)
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


def _follow(program: _Program, params: dict, paths: list) -> _Uses:
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
      taint[n] = _ACT
  for n, leaf in params.items():
    taint[n] = frozenset({leaf})
  for n, value in program.consts.items():
    if isinstance(value, jax.core.Tracer):  # Closed over from the caller.
      taint[n] = _ACT
  sinks = {leaf: [] for leaf in params.values()}
  layers, scans, stacked = [], {}, {}
  for node in _in_order(program):
    ins: list = [
      frozenset() if isinstance(v, jex_core.Literal) else taint.get(v, _ACT)
      for v in node.ins
    ]
    act = any(t is _ACT for t in ins)
    reads = frozenset().union(*[t for t in ins if t is not _ACT])
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
      taint[n] = _ACT if act else reads
  for v in program.outs:
    for leaf in _taint_of(taint, v) or ():
      sinks[leaf].append((None, _RETURNED))
  return _Uses(taint, sinks, layers, scans, stacked)


def _in_order(program: _Program) -> list:
  """``program.nodes``, each after the equations its inputs come from.

  Program order, but for the users of folded layers' terms, which wait
  for their layer. (Those in a cycle come last, unresolved: such a fold is
  undone, see :func:`_out_of_order`.)
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


def _taint_of(taint: dict, v):
  return frozenset() if isinstance(v, jex_core.Literal) else taint[v]


def _reads(node: _Node, uses: _Uses) -> frozenset:
  """The parameter leaves layer ``node`` reads (steps, for a scan)."""
  if id(node) in uses.stacked:
    return uses.stacked[id(node)]
  ins = [_taint_of(uses.taint, v) for v in node.ins]
  return frozenset().union(*[t for t in ins if t is not _ACT])


def _decide(program, params: dict, paths: list, uses: _Uses, folds: dict):
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
    reads = _reads(node, uses)
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
        ordinary[leaf] = Reason(
          "shares",
          f"its layer `{node.eqn.primitive.name}` "
          f"({node.where}) also reads {paths[shared[0]]}, "
          f"which is ordinary",
        )
      elif outside:
        ordinary[leaf] = Reason(
          "computed",
          f"its layer `{node.eqn.primitive.name}` ({node.where}) is inside "
          f"`{outside.eqn.primitive.name}` ({outside.where}), which gets "
          f"its weights computed, not the parameters themselves",
        )
  for leaf, leaf_uses in sinks.items():
    if leaf not in immediate and leaf not in ordinary:
      ordinary[leaf] = (
        _why(leaf_uses) if leaf_uses else Reason("unused", "unused")
      )
  failed = {
    key: ordinary[min(fold.reads & ordinary.keys())]
    for key, fold in folds.items()
    if key not in terms
  }
  failed.update(_out_of_order(program, folds, failed))
  plan = _Plan(params, taint, immediate, preprocess, ordinary, uses.scans)
  plan.terms = terms
  return plan, failed


def _folds(program: _Program, uses: _Uses):
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
    reads = _reads(layer, uses)
    others = [
      use for leaf in reads for use in uses.sinks[leaf] if use != (layer, None)
    ]
    meets = [node for node, _ in others if node is not None]
    returned = [why for _, why in others if why == _RETURNED]
    penalised = frozenset(
      leaf for leaf in reads if uses.sinks[leaf] != [(layer, None)]
    )
    if not meets or len(meets) + len(returned) < len(others):
      continue
    if not all(_meets_as_term(node, uses.taint) for node in meets):
      continue
    first = f"`{meets[0].eqn.primitive.name}` ({meets[0].where})"
    if id(layer) in uses.stacked:
      reason = Reason(
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
      reason = Reason(
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


def _consumers(program: _Program) -> dict:
  """Value number -> the nodes that read it, in program order."""
  consumers = collections.defaultdict(list)
  for node in program.nodes:
    for v in node.ins:
      if not isinstance(v, jex_core.Literal):
        consumers[v].append(node)
  return consumers


def _meets_as_term(node: _Node, taint: dict) -> bool:
  """Whether ``node`` combines a parameter-only number with activations as
  a loss takes a penalty: added, or scaled by a number.
  """
  name = node.eqn.primitive.name
  if name not in _TERM_MEETS:
    return False
  sides = [
    (_taint_of(taint, u) is _ACT, v.aval.shape)
    for v, u in zip(node.eqn.invars, node.ins)
  ]
  if any(shape for act, shape in sides if not act):
    return False  # A parameter array (a bias), not a term.
  return name not in ("mul", "div") or not any(
    shape for act, shape in sides if act
  )


def _fold(layer: _Node, reads, penalised, program, taint: dict, consumers):
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


def _rewire(program: _Program, folds: dict) -> None:
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
    regions.update((id(r), r) for r in _regions(node.region))
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
      for region in _regions(node.region):  # Regions read it from outside.
        region.ins = [
          outer[v] if not isinstance(u, jex_core.Literal) and u == v else u
          for u in region.ins
        ]


def _out_of_order(program: _Program, folds: dict, failed: dict) -> dict:
  """The folds whose terms' users cannot run after their layer.

  Those users are evaluated once the layer has run (``_eval`` defers
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
        if node is fold.layer or (late and _checkpoint_of(node.region)):
          user = fold.users[0][0] or node
          out[key] = Reason(
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


def _plan_scan(
  node: _Node, ins: list, params: dict, paths: list, counter, sinks: dict
):
  """Plans a ``scan`` that parameters enter: its body, for stacked ones.

  A parameter closed over by the body (a scan's constant) is reused by
  every iteration: ordinary. A stacked parameter scanned over as it is
  (an ``xs`` of the scan) is planned inside the body, where each iteration
  sees one layer's slice; those the body makes immediate run through
  ``immgrad.scan``. Returns the body and its plan, and those leaves.
  """
  consts = node.eqn.params["num_consts"]
  body = _build(node.eqn.params["jaxpr"], counter)
  slices = {}
  for i, (v, t) in enumerate(zip(node.ins, ins)):
    if t is _ACT or not t:
      continue
    if i < consts:
      why = Reason(
        "loop", f"reused by every iteration of `scan` ({node.where})"
      )
    elif v in params:
      slices[body.inputs[i]] = params[v]
      continue
    else:
      why = Reason(
        "computed",
        f"scanned over by `scan` ({node.where}) after being computed: "
        f"pass the stacked parameter itself as xs",
      )
    for leaf in t:
      sinks[leaf].append((None, why))
  plan = _plan(body, slices, paths)
  stepped = frozenset(plan.immediate)
  for leaf in slices.values():
    if leaf in stepped:
      sinks[leaf].append((node, None))
    else:
      inner = plan.ordinary[leaf]
      sinks[leaf].append(
        (
          None,
          Reason(
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
    if isinstance(v, jex_core.Literal) or taint[v] is not _ACT:
      need(v)
  return pre


def _outside(node: _Node, raw: list, pre: list) -> _Region | None:
  """The checkpoint region around ``node`` its weights do not enter raw.

  Inside ``immgrad.checkpoint`` a layer finds its parameters among the
  region's arguments only: each raw leaf must be one, and the weights
  computed from them, inside.
  """
  for region in _regions(node.region):
    if region.checkpoint and any(n not in region.ins for n in raw):
      return region
  here = _checkpoint_of(node.region)
  for p in pre:
    if _checkpoint_of(p.region) is not here:
      return here or _checkpoint_of(p.region)
  return None


def _why(uses) -> Reason:
  """Why a leaf with these uses keeps an ordinary gradient.

  A layer with a scalar output (``loss + penalty``) is a term of the
  parameters combined with the loss: the leaf is read outside its layer.
  """
  layers = [node for node, _ in uses if node is not None]
  others = [why for node, why in uses if node is None]
  if others:
    return Reason(
      others[0].kind,
      others[0].text
      + (f", and read by {len(layers)} layer(s)" if layers else ""),
    )
  terms = [n for n in layers if not n.eqn.outvars[0].aval.shape]
  if terms:
    rest = [n for n in layers if n not in terms]
    return Reason(
      "outside",
      f"in a term of the parameters combined with the loss by "
      f"{_named(terms[:1])}"
      + (f", and read by {_named(rest)}" if rest else ""),
    )
  return Reason("tied", f"read by {len(set(layers))} layers: {_named(layers)}")


def _named(nodes: list) -> str:
  return ", ".join(f"`{n.eqn.primitive.name}` ({n.where})" for n in nodes)


def _check_mixed(node: _Node, ins: list, paths: list) -> None:
  """Refuses parameters meeting activations where no layer can step once."""
  name = node.eqn.primitive.name
  first = paths[min(frozenset().union(*[t for t in ins if t is not _ACT]))]
  if name in _REFUSED:
    raise ValueError(
      _BRANCH.format(
        path=first, prim=name, where=node.where, fix=_REFUSED[name]
      )
    )
  if name == "scan":
    consts = node.eqn.params["num_consts"]
    carry = ins[consts : consts + node.eqn.params["num_carry"]]
    if any(t is not _ACT and t for t in carry):
      raise ValueError(
        _UNSUPPORTED.format(path=first, prim=name, where=node.where)
      )
  elif name not in _ONE_LAYER and _has_program(node.eqn.params):
    raise ValueError(
      _UNSUPPORTED.format(path=first, prim=name, where=node.where)
    )


def _has_program(params: dict) -> bool:
  """Whether an equation's params hold an inner program (a jaxpr)."""
  programs = (jex_core.Jaxpr, jex_core.ClosedJaxpr)
  return any(
    isinstance(v, programs)
    or (
      isinstance(v, (tuple, list)) and any(isinstance(e, programs) for e in v)
    )
    for v in params.values()
  )


def _bind(node: _Node, values: list) -> list:
  eqn = node.eqn
  subfuns, params = compat.bind_params(eqn.primitive, eqn.params)
  if eqn.primitive.name == "pvary":
    # shard_map(check_vma=True) casts an invariant weight to varying before
    # it meets the batch. Inside a layer the weight is varying already
    # (immediate_layer casts it, so that its gradient stays local): cast
    # only over the axes it does not vary over yet.
    out = [_to_varying(x, params["axes"]) for x in values]
    return out if eqn.primitive.multiple_results else out[:1]
  with (
    source_info_util.user_context(eqn.source_info.traceback),
    eqn.ctx.manager,
  ):
    out = eqn.primitive.bind(*subfuns, *values, **params)
  return list(out) if node.eqn.primitive.multiple_results else [out]


def _to_varying(x, axes: tuple):
  """``x`` cast to vary over those of ``axes`` it does not vary over yet."""
  missing = tuple(a for a in axes if a not in compat.varying_axes(x))
  return compat.to_varying(x, missing) if missing else x


def _run(program: _Program, plan: _Plan, values: list) -> list:
  """Evaluates ``program``; each immediate layer through immediate_layer."""
  env = dict(program.consts)
  env.update((n, v) for n, v in zip(program.inputs, values) if n is not None)
  _eval(program, plan, env, 0, len(program.nodes), None)
  return [_read(env, v) for v in program.outs]


def _read(env: Mapping, v):
  return v.val if isinstance(v, jex_core.Literal) else env[v]


def _eval(
  program, plan, env: MutableMapping, start: int, end: int, region, pending=None
) -> None:
  """Evaluates ``program.nodes[start:end]``, all inside ``region``, in env.

  An equation that reads a folded layer's term before the layer has run
  (an L2 penalty summed before the model is called) waits in ``pending``
  until it has: shared with the inlined regions inside, which use ``env``
  too.
  """
  mine = pending is None
  pending = [] if mine else pending
  i = start
  while i < end:
    node = program.nodes[i]
    if node.region is not region:  # The first node of a region inside.
      inner = _regions(node.region)
      inner = inner[inner.index(region) - 1] if region else inner[-1]
      item, i = inner, inner.end
    else:
      item, i = node, i + 1
    if not _evaluate(program, plan, env, item, pending):
      pending.append(item)
    elif isinstance(item, _Region) or id(item) in plan.terms:
      _catch_up(program, plan, env, pending)
  if mine and pending:
    _catch_up(program, plan, env, pending)
    if pending:
      raise AssertionError(
        f"immgrad.immediate: {pending[0].where} never got its inputs."
      )


def _catch_up(program, plan, env: MutableMapping, pending: list) -> None:
  """Evaluates the waiting equations whose inputs have come."""
  ran = True
  while ran:
    ran = False
    for item in list(pending):
      if _evaluate(program, plan, env, item, pending):
        pending.remove(item)
        ran = True


def _ready(env: Mapping, values: list) -> bool:
  return all(isinstance(v, jex_core.Literal) or v in env for v in values)


def _evaluate(program, plan, env: MutableMapping, item, pending: list) -> bool:
  """Evaluates a node or a region inside; False if an input is not there."""
  if isinstance(item, _Region):
    return _checkpointed(program, plan, env, item, pending)
  node = item
  ins = [
    frozenset() if isinstance(v, jex_core.Literal) else plan.taint[v]
    for v in node.ins
  ]
  reads = frozenset().union(*[t for t in ins if t is not _ACT])
  if (
    all(t is not _ACT for t in ins) and reads and reads <= plan.immediate.keys()
  ):
    return True  # Preprocessing that only an immediate layer needs.
  if not _ready(env, [v for v, t in zip(node.ins, ins) if t is _ACT]):
    return False  # Waits for a folded layer's term.
  if id(node) in plan.layers and id(node) in plan.scans:
    env.update(zip(node.outs, _scanned(node, plan, env)))
  elif id(node) in plan.layers:
    env.update(zip(node.outs, _layer(node, plan, env)))
  else:
    env.update(zip(node.outs, _bind(node, [_read(env, v) for v in node.ins])))
  return True


def _checkpointed(
  program, plan, env: MutableMapping, region: _Region, pending
) -> bool:
  """Evaluates a region: as traced, or by immgrad.checkpoint, or inlined.

  A ``jit`` call that holds no layer and reads no parameter is bound as
  traced, as one call: its transpose then sums the cotangents of its
  inputs' uses inside it first, as plain differentiation does (inlined,
  they would be summed in another order: float association). Returns
  False, evaluating nothing, if an input of a region not inlined is not
  there yet.
  """
  refs = list(
    dict.fromkeys(v for v in region.ins if not isinstance(v, jex_core.Literal))
  )
  inside = list(
    dict.fromkeys(
      node
      for node in plan.immediate.values()
      if region in _regions(node.region)
    )
  )
  if not region.checkpoint and (inside or any(plan.taint[v] for v in refs)):
    _eval(program, plan, env, region.start, region.end, region, pending)
    return True
  if not _ready(env, refs):
    return False
  # The folded layers' terms leave the region with its outputs.
  terms = [n for node in inside for n in plan.terms.get(id(node), ([], []))[1]]
  if region.checkpoint and inside:

    def body(*values):
      inner = collections.ChainMap(dict(zip(refs, values)), env)
      _eval(program, plan, inner, region.start, region.end, region)
      return [
        _read(inner, v)
        if isinstance(v, jex_core.Literal) or v in inner
        else jnp.zeros(program.avals[v].shape, program.avals[v].dtype)
        for v in region.outs
      ] + [inner[n] for n in terms]

    params = region.eqn.params
    outs = remat_lib.checkpoint(
      body, prevent_cse=params["prevent_cse"], policy=params["policy"]
    )(*[env[n] for n in refs])
  else:
    outs = _bind(
      _Node(region.eqn, region.ins, region.outs),
      [_read(env, v) for v in region.ins],
    )
  env.update(
    (n, v)
    for n, v in zip(list(region.outs) + terms, outs)
    if not isinstance(n, jex_core.Literal) and n not in refs
  )
  return True


def _scanned(node: _Node, plan: _Plan, env: MutableMapping) -> list:
  """A ``scan`` over stacked parameters, by immgrad.scan and the body's plan."""
  body, inner = plan.scans[id(node)]
  params = node.eqn.params
  values = [_read(env, v) for v in node.ins]
  consts = params["num_consts"]
  first_x = consts + params["num_carry"]

  def step(carry, x):
    local = dict(body.consts)
    local.update(zip(body.inputs, values[:consts] + list(carry) + list(x)))
    _eval(body, inner, local, 0, len(body.nodes), None)
    outs = [_read(local, v) for v in body.outs]
    return outs[: params["num_carry"]], outs[params["num_carry"] :]

  carry, ys = scan_lib.scan(
    step,
    values[consts:first_x],
    values[first_x:],
    length=params["length"],
    reverse=params["reverse"],
    unroll=params["unroll"],
  )
  return list(carry) + list(ys)


def _layer(node: _Node, plan: _Plan, env: MutableMapping) -> list:
  """``node`` as an immediate layer of its parameters' raw leaves.

  A folded layer also returns its terms (see :func:`_plan`): their
  cotangents join ``dy`` in its backward rule, so ``dW`` has their
  gradient, at the old weights.

  It runs as ``immediate_layer(lambda x, raw: prim(x, preprocess(raw)))`` on
  the very leaves the step handed in, so that ``mode="updated"`` takes dX at
  the processed new weights.
  """
  acts = [
    i
    for i, v in enumerate(node.ins)
    if not isinstance(v, jex_core.Literal) and plan.taint[v] is _ACT
  ]
  raw, preprocess = plan.preprocess[id(node)]
  terms = plan.terms.get(id(node), ([], []))[0]

  def fun(x, weights):
    local = collections.ChainMap(dict(zip(raw, weights)), env)
    for pre in preprocess:
      local.update(
        zip(pre.outs, _bind(pre, [_read(local, u) for u in pre.ins]))
      )
    ins = [_read(local, v) for v in node.ins]
    for i, value in zip(acts, x):
      ins[i] = value
    if not terms:
      return _bind(node, ins)
    return _bind(node, ins), [local[v] for v in terms]

  name = f"{node.eqn.primitive.name} ({node.where})"
  out = immediate_layer(fun, name=name)(
    [env[node.ins[i]] for i in acts], [env[n] for n in raw]
  )
  return out[0] + out[1] if terms else out


def _flatten(args: tuple, kwargs: dict, argnums: int, fun_name: str):
  """The leaves of ``(params, other args, kwargs)``, and how to call back."""
  if not isinstance(argnums, int) or not 0 <= argnums < len(args):
    raise ValueError(
      f"immgrad.immediate: {fun_name} was called with {len(args)} "
      f"positional argument(s), so argnums={argnums!r} names no parameter "
      f"tree. Pass the params tree positionally at argnums."
    )
  params, others = args[argnums], args[:argnums] + args[argnums + 1 :]
  keyed, _ = jax.tree_util.tree_flatten_with_path(params)
  paths = [jax.tree_util.keystr(k) for k, _ in keyed]
  leaves, treedef = jax.tree.flatten((params, others, kwargs))
  return leaves, treedef, paths


def _qualname(fun) -> str:
  return getattr(fun, "__qualname__", repr(fun))


def _analyse(fun, argnums, args, kwargs, only=None):
  """Traces ``fun`` and plans its layers: (program, plan, leaves, paths).

  With ``only`` (leaf positions), the other parameter leaves are arguments
  like the data, and ``fun`` is traced as outside a step: the immediate
  layers and adapters inside it are plain JAX, which this plan replaces.
  """
  leaves, treedef, paths = _flatten(args, kwargs, argnums, _qualname(fun))

  def call(params, others, kwargs):
    return fun(*others[:argnums], params, *others[argnums:], **kwargs)

  if only is None:
    program = _trace(call, leaves, treedef)
  else:
    with context.hidden(context.current()):
      program = _trace(call, leaves, treedef)
  params = {
    program.inputs[i]: i
    for i in range(len(paths))
    if _is_float(leaves[i]) and (only is None or i in only)
  }
  return program, _plan(program, params, paths), leaves, paths


def whole(fun: Callable[..., Any], only: frozenset) -> Callable[..., Any]:
  """The loss ``fun`` made immediate as one program, for ``value_and_grad``.

  Where a layer's weight is also used outside it (an L2 term the loss
  adds outside ``immgrad.haiku.immediate``'s forward function), the step
  runs the whole loss through this planner instead, stepping the leaves at
  positions ``only`` (those the layers claimed) where it can: the term
  then folds into their layers' steps.
  """

  def wrapped(params, *args):
    program, plan, leaves, _ = _analyse(fun, 0, (params, *args), {}, only)
    values = [leaves[i] for i, n in enumerate(program.inputs) if n is not None]
    return jax.tree.unflatten(program.out_tree, _run(program, plan, values))

  return wrapped


def immediate(
  fun: Callable[..., Any], *, argnums: int = 0, strict: bool = False
) -> Callable[..., Any]:
  """Makes every layer JAX traces in ``fun`` an immediate layer.

  Args:
    fun: any JAX function taking the parameter tree as positional argument
      ``argnums``: a loss, a Haiku or Linen ``apply``, an NNX
      ``merge``-and-call, raw JAX. Non-array arguments are static, as
      under ``jax.jit``.
    argnums: the position of the parameter tree among ``fun``'s arguments.
    strict: raise ``ValueError`` where an :class:`OrdinaryWarning` would be
      issued.

  Returns:
    ``fun``, except inside ``immgrad.value_and_grad``: there each equation
    that combines parameter-only values with activations, and whose
    parameter leaves reach nothing else, is an immediate layer stepped in
    the backward pass; every other parameter keeps an ordinary gradient
    (see :func:`layers` for which and why). If a floating-point leaf of the
    parameter tree that ``fun`` uses is left ordinary, each trace of the
    step warns (:class:`OrdinaryWarning`) with the leaves, the reasons and
    their fixes; with ``strict`` it raises.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import immgrad
    >>> def model(params, x):
    ...   h = jax.nn.relu(x @ params["w1"] + params["b1"])
    ...   return h @ params["w2"]
    >>> params = {"w1": jnp.full((2, 3), 0.5), "b1": jnp.zeros(3),
    ...           "w2": jnp.full((3, 1), 0.5)}
    >>> net = immgrad.immediate(model)
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((net(params, x) - y) ** 2)
    >>> tx = immgrad.shim(optax.sgd(0.1))
    >>> step = jax.jit(immgrad.value_and_grad(loss_fn, tx))
    >>> loss, grads = step(params, tx.init(params), jnp.ones((4, 2)),
    ...                    jnp.zeros((4, 1)))
    >>> sorted(k for k, g in grads.items()
    ...        if isinstance(g, immgrad.ImmediateGrad))
    ['b1', 'w1', 'w2']
  """
  if not callable(fun):
    raise TypeError(f"immgrad.immediate expects a function, got {fun!r}.")

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    step = context.current()
    if step is None:
      survey = surveying()
      if survey is None:
        return fun(*args, **kwargs)
      # immgrad.layers is asking: report; run as traced.
      program, plan, leaves, paths = _analyse(fun, argnums, args, kwargs)
      survey.record(plan, leaves, paths)
      values = [
        leaves[i] for i, n in enumerate(program.inputs) if n is not None
      ]
      outs = _run(program, dataclasses.replace(plan, immediate={}), values)
      return jax.tree.unflatten(program.out_tree, outs)
    program, plan, leaves, paths = _analyse(fun, argnums, args, kwargs)
    for i in plan.params.values():
      if step.find(leaves[i], "immgrad.immediate") is None:
        raise ValueError(
          _ARGUMENT_NOT_A_PARAMETER.format(path=paths[i], argnums=argnums)
        )
    for const in program.consts.values():
      slot = step.find(const, "immgrad.immediate")
      if slot is not None:
        raise ValueError(
          _CLOSED_OVER.format(
            fun=_qualname(fun), path=slot.path, argnums=argnums
          )
        )
    ordinary_lib.report(plan.ordinary, len(plan.params), paths, strict)
    values = [leaves[i] for i, n in enumerate(program.inputs) if n is not None]
    outs = _run(program, plan, values)
    return jax.tree.unflatten(program.out_tree, outs)

  # Read back by immgrad.layers; pyright does not model function attributes.
  wrapped.immediate_fun = (fun, argnums)  # pyright: ignore[reportAttributeAccessIssue]
  return wrapped


@dataclasses.dataclass(frozen=True)
class Row:
  """One parameter leaf: the layer that steps it, or why none does."""

  path: str
  shape: str  # e.g. "f32[3,4]".
  layer: str | None  # e.g. "dot_general -> f32[8,4]", None if ordinary.
  source: str | None  # The user's line that made the layer.
  why: str | None  # Why the leaf keeps an ordinary gradient.


class Layers(tuple):
  """:func:`layers`'s answer: a tuple of :class:`Row`, printable as a table.

  ``table[path]`` (a string such as ``"['w']"``) is that leaf's row.
  """

  def __getitem__(self, key):
    if isinstance(key, str):
      for row in self:
        if row.path == key:
          return row
      raise KeyError(key)
    return super().__getitem__(key)

  def __str__(self) -> str:
    cells = [
      (r.path, r.shape, r.layer or "ordinary", r.source if r.layer else r.why)
      for r in self
    ]
    cells.insert(0, ("parameter", "shape", "layer", "source / why ordinary"))
    widths = [max(len(c[i]) for c in cells) for i in range(3)]
    return "\n".join(
      "  ".join(c.ljust(w) for c, w in zip(cell[:3], widths)) + "  " + cell[3]
      for cell in cells
    )


def layers(fun: Callable[..., Any], params: Any, *args, **kwargs) -> Layers:
  """What :func:`immediate` makes of ``fun(params, *args, **kwargs)``.

  Args:
    fun: a function as for :func:`immediate`, or one it returned (then its
      ``argnums`` places ``params`` among ``args``), or a function that
      calls such functions (a loss calling an adapter's ``immediate``:
      then each leaf is reported as the function it was given to steps
      it, ``modules=`` included).
    params: the parameter tree.
    *args: ``fun``'s other arguments (arrays or ``jax.ShapeDtypeStruct``).
    **kwargs: its keyword arguments.

  Returns:
    A :class:`Layers`: for each parameter leaf, the layer that steps it
    (primitive, output shape, the user's source line), or why it keeps an
    ordinary gradient. ``print`` it for a table.

  Example:
    >>> import jax.numpy as jnp
    >>> import immgrad
    >>> def model(params, tokens):
    ...   h = params["embed"][tokens]  # Tied: also the output projection.
    ...   return (h * params["scale"]) @ params["embed"].T
    >>> params = {"embed": jnp.ones((10, 4)), "scale": jnp.ones(4)}
    >>> table = immgrad.layers(model, params, jnp.zeros(3, jnp.int32))
    >>> table["['scale']"].layer
    'mul -> float32[3,4]'
    >>> table["['embed']"].why.startswith("read by 2 layers")
    True
  """
  fun, argnums = getattr(fun, "immediate_fun", (fun, 0))
  args = args[:argnums] + (params,) + args[argnums:]
  leaves, treedef, paths = _flatten(args, kwargs, argnums, _qualname(fun))
  rows = _surveyed(fun, argnums, leaves, treedef, paths)
  if rows is None:  # fun calls no immediate function: it is one.
    _, plan, leaves, paths = _analyse(fun, argnums, args, kwargs)
    rows = [_row(plan, i, path, leaves[i]) for i, path in enumerate(paths)]
  return Layers(rows)


def _row(plan: _Plan, i: int, path: str, leaf) -> Row:
  """Leaf ``i`` of ``plan``'s parameters, shown as ``path``."""
  shape = jax.core.ShapedArray(jnp.shape(leaf), jnp.result_type(leaf))
  shape = shape.str_short()
  node, inner, scanned = plan.immediate.get(i), plan, ""
  while node is not None and id(node) in inner.scans:  # Per layer.
    inner = inner.scans[id(node)][1]
    node, scanned = inner.immediate[i], scanned + " in `scan`"
  if node is not None:
    out = node.eqn.outvars[0].aval.str_short()
    layer = f"{node.eqn.primitive.name} -> {out}{scanned}"
    return Row(path, shape, layer, node.where, None)
  return Row(path, shape, None, None, str(plan.ordinary.get(i, _NOT_FLOAT)))


_NOT_FLOAT = "not floating point: no gradient"
_NOT_GIVEN = (
  "not among the parameters of the immediate functions `fun` calls: the "
  "adapter's `modules=` does not choose its module, or it is used outside "
  "the wrapped function"
)
_survey = threading.local()


def surveying() -> Optional["_Survey"]:
  """The :func:`layers` survey under way on this thread, or None."""
  return getattr(_survey, "current", None)


class _Survey:
  """What :func:`layers` learns from the immediate functions ``fun`` calls.

  Outside a step, an adapter asks it (as it asks a step) which leaves are
  the parameters (``find``), and each :func:`immediate` call records the
  rows of the leaves it was given: the layers of ``mode="current"`` (at
  other dX, Haiku's adapter binds each module call as one layer).
  """

  def __init__(self, index: dict):
    self.index = index  # id(traced parameter leaf) -> its row.
    self.rows = {}
    self.called = False  # Whether an immediate function ran.
    self._outer = None

  def find(self, leaf, user: str):
    del user
    return self.index.get(id(leaf))

  def record(self, plan: _Plan, leaves: list, paths: list) -> None:
    self.called = True
    for j in range(len(paths)):
      i = self.index.get(id(leaves[j]))
      if i is not None and i not in self.rows:
        self.rows[i] = _row(plan, j, "", leaves[j])

  def __enter__(self):
    self._outer, _survey.current = surveying(), self
    return self

  def __exit__(self, *exc):
    _survey.current = self._outer


def _surveyed(fun, argnums, leaves, treedef, paths) -> list | None:
  """The rows of ``fun``'s parameters, from the immediate functions it
  calls (traced abstractly), or None if it calls none.
  """
  dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  rows, called = {}, []

  def probe(*values):
    full = list(leaves)
    for i, v in zip(dynamic, values):
      full[i] = v
    index = {id(full[i]): i for i in dynamic if i < len(paths)}
    params, others, kwargs = treedef.unflatten(full)
    with _Survey(index) as survey:
      fun(*others[:argnums], params, *others[argnums:], **kwargs)
    rows.update(survey.rows)
    called.append(survey.called)

  jax.eval_shape(probe, *[leaves[i] for i in dynamic])
  if not any(called):
    return None
  out = []
  for i, path in enumerate(paths):
    if i in rows:
      out.append(dataclasses.replace(rows[i], path=path))
    else:
      shape = jax.core.ShapedArray(
        jnp.shape(leaves[i]), jnp.result_type(leaves[i])
      ).str_short()
      why = _NOT_GIVEN if _is_float(leaves[i]) else _NOT_FLOAT
      out.append(Row(path, shape, None, None, why))
  return out
