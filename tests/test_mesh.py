"""What `build_mesh` sets up for every function that runs on its mesh."""

from __future__ import annotations

import numpy as np

from layout_core.layout import mesh as mesh_lib
from layout_core.lazy import dtensor, tf


def test_a_sharded_sum_of_four_gradients_survives_grappler(mesh_data8):
  """The gradient of a weight used four times is an AddN of four sharded
  tensors. Left on, Grappler's memory optimizer turns that sum into adds to a
  variable of the global shape, which fails on every shard
  (bench/grappler_addn_limit.py: a [4096, 4096] weight is the smallest size
  measured to trigger it); `build_mesh` switches it off."""
  rng = np.random.default_rng(0)
  value = rng.uniform(-1, 1, size=[4096, 4096]).astype(np.float32)
  w = dtensor.DVariable(mesh_lib.pack_global_array(
      value, dtensor.Layout(['data', 'unsharded'], mesh_data8)))
  scales = (1.0, 2.0, 3.0, 4.0)

  @tf.function
  def gradient():
    with tf.GradientTape() as tape:
      total = tf.add_n([tf.reduce_sum(tf.tanh(w * s)) for s in scales])
    return tape.gradient(total, w)

  grad = gradient()
  assert dtensor.fetch_layout(grad).sharding_specs == ['data', 'unsharded']
  got = dtensor.unpack(dtensor.relayout(grad, dtensor.Layout.replicated(mesh_data8, 2)))[0]
  want = sum(s * (1 - np.tanh(value * s) ** 2) for s in scales)
  np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
