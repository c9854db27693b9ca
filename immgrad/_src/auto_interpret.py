"""Runs a planned program: each immediate layer through ``immediate_layer``.

Every other equation is bound again as traced.
"""

import collections
from typing import Mapping, MutableMapping

from jax.extend import core as jex_core
import jax.numpy as jnp

from immgrad._src import auto_program as program_lib
from immgrad._src import compat
from immgrad._src import jaxpr as jaxpr_lib
from immgrad._src import remat as remat_lib
from immgrad._src import scan as scan_lib
from immgrad._src.layer import immediate_layer


def _bind(node: program_lib.Node, values: list) -> list:
  eqn = node.eqn
  if eqn.primitive.name == "pvary":
    # shard_map(check_vma=True) casts an invariant weight to varying before
    # it meets the batch. Inside a layer the weight is varying already
    # (immediate_layer casts it, so that its gradient stays local): cast
    # only over the axes it does not vary over yet.
    out = [_to_varying(x, eqn.params["axes"]) for x in values]
    return out if eqn.primitive.multiple_results else out[:1]
  return jaxpr_lib.rebind(eqn, values)


def _to_varying(x, axes: tuple):
  """``x`` cast to vary over those of ``axes`` it does not vary over yet."""
  missing = tuple(a for a in axes if a not in compat.varying_axes(x))
  return compat.to_varying(x, missing) if missing else x


def run(
  program: program_lib.Program, plan: program_lib.Plan, values: list
) -> list:
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
      inner = program_lib.regions(node.region)
      inner = inner[inner.index(region) - 1] if region else inner[-1]
      item, i = inner, inner.end
    else:
      item, i = node, i + 1
    if not _evaluate(program, plan, env, item, pending):
      pending.append(item)
    elif isinstance(item, program_lib.Region) or id(item) in plan.terms:
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
  if isinstance(item, program_lib.Region):
    return _checkpointed(program, plan, env, item, pending)
  node = item
  ins = [
    frozenset() if isinstance(v, jex_core.Literal) else plan.taint[v]
    for v in node.ins
  ]
  reads = frozenset().union(*[t for t in ins if t is not program_lib.ACT])
  if (
    all(t is not program_lib.ACT for t in ins)
    and reads
    and reads <= plan.immediate.keys()
  ):
    return True  # Preprocessing that only an immediate layer needs.
  if not _ready(
    env, [v for v, t in zip(node.ins, ins) if t is program_lib.ACT]
  ):
    return False  # Waits for a folded layer's term.
  if id(node) in plan.layers and id(node) in plan.scans:
    env.update(zip(node.outs, _scanned(node, plan, env)))
  elif id(node) in plan.layers:
    env.update(zip(node.outs, _layer(node, plan, env)))
  else:
    env.update(zip(node.outs, _bind(node, [_read(env, v) for v in node.ins])))
  return True


def _checkpointed(
  program, plan, env: MutableMapping, region: program_lib.Region, pending
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
      if region in program_lib.regions(node.region)
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
      program_lib.Node(region.eqn, region.ins, region.outs),
      [_read(env, v) for v in region.ins],
    )
  env.update(
    (n, v)
    for n, v in zip(list(region.outs) + terms, outs)
    if not isinstance(n, jex_core.Literal) and n not in refs
  )
  return True


def _scanned(
  node: program_lib.Node, plan: program_lib.Plan, env: MutableMapping
) -> list:
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


def _layer(
  node: program_lib.Node, plan: program_lib.Plan, env: MutableMapping
) -> list:
  """``node`` as an immediate layer of its parameters' raw leaves.

  A folded layer also returns its terms (``auto_fold.py``): their
  cotangents join ``dy`` in its backward rule, so ``dW`` has their
  gradient, at the old weights.

  It runs as ``immediate_layer(lambda x, raw: prim(x, preprocess(raw)))`` on
  the very leaves the step handed in, so that ``mode="updated"`` takes dX at
  the processed new weights.
  """
  acts = [
    i
    for i, v in enumerate(node.ins)
    if not isinstance(v, jex_core.Literal) and plan.taint[v] is program_lib.ACT
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
