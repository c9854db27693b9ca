"""A traced function as a flat list of equations over numbered values.

``immgrad.immediate`` traces the function once, inlining ``jit`` and
``jax.checkpoint`` calls as regions; what the planner says of the values
(their taints, why a leaf keeps an ordinary gradient) is named here too.
"""

import dataclasses
import functools
from typing import Any, Optional

import jax
from jax.extend import core as jex_core

from immgrad._src import callsite
from immgrad._src import jaxpr as jaxpr_lib

_REMAT = frozenset({"remat2", "checkpoint"})
_INLINED = jaxpr_lib.CALLS | _REMAT


@dataclasses.dataclass(eq=False)
class Region:
  """A ``jax.checkpoint`` or ``jit`` call, inlined: nodes[start:end]."""

  eqn: Any
  ins: list
  outs: list
  start: int
  end: int
  parent: Optional["Region"]
  checkpoint: bool = True  # False: a ``jit`` call.
  wired: Any = None  # ins as traced, before folding rewires them.

  @property
  def where(self) -> str:
    return callsite.user_line(self.eqn.source_info)


@dataclasses.dataclass(eq=False)
class Node:
  """One equation, with inputs and outputs renamed to program-wide ints."""

  eqn: Any
  ins: list  # An int (a value of the program) or a Literal.
  outs: list
  region: Region | None = None  # The innermost checkpoint around it.
  wired: Any = None  # (ins, outs) as traced, before folding rewires them.

  @property
  def where(self) -> str:
    return callsite.user_line(self.eqn.source_info)


def regions(region: Region | None) -> list:
  """``region`` and the regions around it, innermost first."""
  chain = []
  while region is not None:
    chain.append(region)
    region = region.parent
  return chain


def checkpoint_of(region: Region | None) -> Region | None:
  """The innermost checkpoint region at or around ``region``."""
  return next((r for r in regions(region) if r.checkpoint), None)


@dataclasses.dataclass
class Program:
  """``fun`` as a flat list of equations over numbered values."""

  nodes: list
  inputs: list  # The numbers of the traced arguments, in order.
  consts: dict  # number -> value (the jaxpr's constants).
  outs: list  # Numbers (or Literals) of the outputs.
  out_tree: Any
  avals: dict  # number -> abstract value, for the equations' outputs.
  counter: Any  # Numbers the values of inner programs (scan bodies).
  wired: Any = None  # outs as traced, before folding rewires them.


def trace(fun, leaves, treedef, dynamic: list) -> Program:
  """Traces ``fun(*treedef.unflatten(leaves))``, inlining nested calls.

  Each ``jax.checkpoint`` and ``jit`` call is inlined as a region: the
  evaluation runs a checkpoint under ``immgrad.checkpoint``, and a
  ``jit`` inlined, or either as it was if it holds no layer (a ``jit``
  reading no parameter either).

  Only the leaves at positions ``dynamic`` (the arrays) are traced; the
  others (flags, None, Python numbers) are static, as under jit.
  """

  def flat(*values):
    full = list(leaves)
    for i, v in zip(dynamic, values):
      full[i] = v
    return fun(*treedef.unflatten(full))

  closed, shape = jax.make_jaxpr(flat, return_shape=True)(
    *[leaves[i] for i in dynamic]
  )
  counter = iter(range(1 << 62))
  program = build(closed, counter)
  position = {i: n for i, n in zip(dynamic, program.inputs)}
  program.inputs = [position.get(i) for i in range(len(leaves))]
  program.out_tree = jax.tree.structure(shape)
  return program


def build(closed, counter) -> Program:
  """``closed`` (a ClosedJaxpr) as a Program; ``counter`` numbers values."""
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
      inner = jaxpr_lib.inner(eqn, names=_INLINED)
      if inner is not None:
        child = Region(eqn, ins, [], len(nodes), 0, region, name in _REMAT)
        outs = inline(inner.jaxpr, inner.consts, ins, child)
        child.outs, child.end = outs, len(nodes)
        env.update(zip(eqn.outvars, outs))
        continue
      outs = [next(counter) for _ in eqn.outvars]
      env.update(zip(eqn.outvars, outs))
      avals.update((n, v.aval) for n, v in zip(outs, eqn.outvars))
      nodes.append(Node(eqn, ins, outs, region))
    return [read(env, v) for v in jaxpr.outvars]

  inputs = [next(counter) for _ in closed.jaxpr.invars]
  outs = inline(closed.jaxpr, closed.consts, inputs, None)
  return Program(nodes, inputs, consts, outs, None, avals, counter)


@dataclasses.dataclass
class Plan:
  """Which equations are layers, and which parameter leaves they step."""

  params: dict  # value number -> parameter leaf index (float leaves only).
  taint: dict  # value number -> frozenset of leaf indices, or None (act).
  immediate: dict  # leaf index -> its immediate layer Node.
  preprocess: dict  # id(layer) -> (raw value numbers, parameter-only nodes).
  ordinary: dict  # leaf index -> the Reason it keeps an ordinary gradient.
  scans: dict  # id(scan node) -> (its body Program, the body's Plan).
  # id(layer) -> the parameter-only terms it also returns (folded L2
  # terms): the value numbers it computes them as, and those it returns.
  terms: dict = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def layers(self) -> frozenset:
    """The ids of the immediate layers' nodes."""
    return frozenset(id(node) for node in self.immediate.values())


ACT = None  # The taint of a value that depends on an activation.


@dataclasses.dataclass
class Uses:
  """What following the parameters finds: the values' taints, each leaf's uses."""

  taint: dict
  sinks: dict  # leaf -> [(layer node, None) or (None, why)].
  layers: list  # The nodes where parameter-only values meet activations.
  scans: dict
  stacked: dict  # id(scan node) -> the stacked leaves it steps.


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


RETURNED = Reason("outside", "returned by the function")


def taint_of(taint: dict, v):
  return frozenset() if isinstance(v, jex_core.Literal) else taint[v]


def reads(node: Node, uses: Uses) -> frozenset:
  """The parameter leaves layer ``node`` reads (steps, for a scan)."""
  if id(node) in uses.stacked:
    return uses.stacked[id(node)]
  ins = [taint_of(uses.taint, v) for v in node.ins]
  return frozenset().union(*[t for t in ins if t is not ACT])
