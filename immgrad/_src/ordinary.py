"""Telling the user which parameters ``immgrad.immediate`` leaves ordinary.

A leaf it was given that no immediate layer steps, for a reason other than
not being used, trains with an ordinary gradient: a warning says so once
per trace of the step (``strict=True``: an error), with each kind's fix.
"""

import warnings

from immgrad._src import callsite


class OrdinaryWarning(UserWarning):
  """Parameters given to :func:`immgrad.immediate` train ordinarily.

  Issued once per trace of the step; raised as a ``ValueError`` instead
  with ``immediate(..., strict=True)``; silenced with
  ``warnings.filterwarnings("ignore", category=immgrad.OrdinaryWarning)``.

  Example:
    >>> import warnings
    >>> import jax.numpy as jnp, optax
    >>> import immgrad
    >>> def loss_fn(params, tokens):  # The embedding is tied.
    ...   return jnp.mean(params["embed"][tokens] @ params["embed"].T)
    >>> params = {"embed": jnp.ones((10, 4))}
    >>> tx = immgrad.shim(optax.sgd(0.1))
    >>> step = immgrad.value_and_grad(
    ...   immgrad.immediate(loss_fn), tx, mode="current")
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   _ = step(params, tx.init(params), jnp.arange(3))
    >>> print(str(caught[0].message).splitlines()[1])  # doctest: +ELLIPSIS
      ['embed']: read by 2 layers: `gather` (...), `dot_general` (...)
  """


# Per kind of reason: what it means and the fix, in plain words.
FIXES = {
  "tied": (
    "tied (read by two layers, such as an embedding reused for the "
    "logits): it trains ordinarily by design, since one layer's step would "
    "miss the other use's gradient; untie it (one parameter per use) to "
    "make it immediate"
  ),
  "outside": (
    "read outside its layer (a term of the parameters such as an L2 "
    "penalty added to the loss, or returned by the function): for weight "
    "decay drop the term and use optax.adamw or optax.add_decayed_weights; "
    "return only values computed from the activations"
  ),
  "loop": (
    "reused by every iteration of a loop (lax.scan or hk.dynamic_unroll "
    "closing over it): a recurrent cell's weights train ordinarily by "
    "design; for a stack of distinct layers, scan over the stacked "
    "parameters as xs (immgrad.scan, hk.layer_stack)"
  ),
  "computed": (
    "computed weights handed into a jax.checkpoint (or scanned over after "
    "being computed): compute them from the parameters inside the "
    "checkpoint, and scan over the stacked parameters themselves"
  ),
  "shares": (
    "its layer also reads an ordinary leaf: it becomes immediate when that "
    "leaf does"
  ),
}
_SHOWN = 5  # Paths named in the message; the rest are counted.


def report(ordinary: dict, given: int, paths: list, strict: bool) -> None:
  """Warns (``strict``: raises) if any leaf in ``ordinary`` is used.

  Args:
    ordinary: leaf index -> ``auto_program.Reason``.
    given: how many floating-point parameter leaves the function was given.
    paths: each leaf's path, by index.
    strict: raise ``ValueError`` instead of warning.
  """
  used = sorted((i, why) for i, why in ordinary.items() if why.kind != "unused")
  if not used:
    return
  message = _message(used, given, paths)
  if strict:
    raise ValueError(message)
  warnings.warn(message, OrdinaryWarning, stacklevel=callsite.user_stacklevel())


def _message(used: list, given: int, paths: list) -> str:
  lines = [
    f"immgrad.immediate: {len(used)} of the {given} parameter leaves it "
    f"was given train with an ordinary gradient, not immediately:"
  ]
  lines += [f"  {paths[i]}: {why}" for i, why in used[:_SHOWN]]
  if len(used) > _SHOWN:
    lines.append(
      f"  ... and {len(used) - _SHOWN} more (immgrad.layers lists all)"
    )
  kinds = [kind for kind in FIXES if any(why.kind == kind for _, why in used)]
  lines.append("What each reason means, and its fix:")
  lines += [f"- {FIXES[kind]}." for kind in kinds]
  lines.append(
    "Pass strict=True to make this an error, or silence it with "
    'warnings.filterwarnings("ignore", category=immgrad.OrdinaryWarning).'
  )
  return "\n".join(lines)
