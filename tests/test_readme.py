"""The README's training-step example runs as written and trains."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_training_step_runs():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  assert blocks, "README.md has no python example"
  scope = {}
  exec(blocks[0], scope)
  first = scope["loss"]
  for _ in range(20):
    scope["params"], scope["opt_state"], loss = scope["train_step"](
      scope["params"], scope["opt_state"], scope["x"], scope["y"]
    )
  assert jnp.isfinite(loss) and loss < first
