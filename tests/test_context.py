"""``context.py`` directly: a step's frozen settings, and the registry of
parameter slots that each trace of the step (the loss, a scan body, a
checkpointed function) keeps over those same settings.
"""

import dataclasses

import jax.numpy as jnp
import optax
import pytest

from immgrad._src import context


def _settings(**changes):
  fixed = dict(tx=optax.sgd(0.1), params={}, shared=(), dx_at=1.0)
  return context.Settings(**{**fixed, **changes})


def test_settings_cannot_change_after_construction():
  settings = _settings()
  with pytest.raises(dataclasses.FrozenInstanceError):
    settings.dx_at = 0.0
  assert settings.dx_at == 1.0


@pytest.mark.parametrize(
  "changes,steps",
  [
    (dict(dx_at=0.0), False),  # "current": the shim alone steps.
    (dict(dx_at=1.0), True),
    (dict(dx_at=0.5), True),
    (dict(dx_at=0.0, atomic=True), True),  # The layer checks its step.
    (dict(dx_at=0.0, measure_dx=True), True),
  ],
)
def test_a_layer_steps_in_its_backward_rule_only_when_the_settings_need_it(
  changes, steps
):
  assert _settings(**changes).steps_in_backward is steps


def test_a_nested_registry_keeps_the_settings_and_its_own_slots():
  """A nested trace's registry: the step's very settings, its own flag if
  given (else the outer one's), and slots of its own; a view of the outer
  trace found from the nested one is refused, naming the parameter.
  """
  outer_flag, inner_flag = jnp.zeros(()), jnp.ones(())
  outer = context.Registry(_settings(), outer_flag, parent=None)
  leaf = jnp.ones(3)
  outer.add(context.Slot(path="['w']", view=leaf, weight=leaf, state=[]))
  with context.opened(outer):
    assert outer.find(leaf, "layer").path == "['w']"
  inner = outer.nested(inner_flag)
  assert inner.settings is outer.settings
  assert inner.flag is inner_flag and outer.nested().flag is outer_flag
  assert inner.slots == [] and inner.parent is outer
  with pytest.raises(
    ValueError, match=r"layer 'layer' was called on .*\['w'\]"
  ):
    inner.find(leaf, "layer")
