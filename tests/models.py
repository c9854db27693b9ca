"""A small model with several input and parameter shapes, for the tests.

A convolution (4-D weights), a two-input layer whose ``x`` is a tuple, an
elementwise scale and offset (1-D weights), a dense head, and two ordinary
(undecorated) parameters: a scalar temperature and an output bias.
"""

import jax
import jax.numpy as jnp
import numpy as np


def conv(x, p):
  y = jax.lax.conv_general_dilated(
    x,
    p["w"],
    window_strides=(1, 1),
    padding="SAME",
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
  )
  return y + p["b"]


def two_inputs(x, p):
  h, side = x
  return h @ p["w"] + side @ p["v"]


def scale_offset(x, p):
  return x * p["scale"] + p["offset"]


def head(x, p):
  return x @ p["w"]


def init(key):
  k = jax.random.split(key, 6)
  return {
    "conv": {
      "w": jax.random.normal(k[0], (3, 3, 3, 4)) / np.sqrt(27),
      "b": jnp.full((4,), 0.1),
    },
    "mix": {
      "w": jax.random.normal(k[1], (64, 16)) / 8.0,
      "v": jax.random.normal(k[2], (5, 16)) / np.sqrt(5),
    },
    "norm": {
      "scale": 1.0 + 0.1 * jax.random.normal(k[3], (16,)),
      "offset": 0.1 * jax.random.normal(k[4], (16,)),
    },
    "head": {"w": jax.random.normal(k[5], (16, 3)) / 4.0},
    "temperature": jnp.array(1.5),
    "out_bias": jnp.zeros((3,)),
  }


def loss_fn(wrap=lambda f: f):
  """The loss, with ``wrap`` applied to each primitive layer."""

  def loss(params, images, side, y):
    h = jax.nn.relu(wrap(conv)(images, params["conv"]))  # (B, 4, 4, 4)
    h = h.reshape(h.shape[0], -1)  # (B, 64)
    h = jnp.tanh(wrap(two_inputs)((h, side), params["mix"]))
    h = jax.nn.gelu(wrap(scale_offset)(h, params["norm"]))
    out = wrap(head)(h, params["head"]) * params["temperature"]
    out = out + params["out_bias"]
    return jnp.mean((out - y) ** 2)

  return loss


def batches(key, n, batch=8):
  keys = jax.random.split(key, 3 * n)
  return [
    (
      jax.random.normal(keys[3 * i], (batch, 4, 4, 3)),
      jax.random.normal(keys[3 * i + 1], (batch, 5)),
      jax.random.normal(keys[3 * i + 2], (batch, 3)),
    )
    for i in range(n)
  ]
