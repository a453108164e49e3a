"""What `build_mesh` sets up for every function that runs on its mesh."""

from __future__ import annotations

from bench.grappler_addn_limit import sum_of_four_error


def test_a_sharded_sum_of_four_gradients_survives_grappler(mesh_data8):
  """The gradient of a weight used four times is an AddN of four sharded
  tensors. Left on, Grappler's memory optimizer turns that sum into adds to a
  variable of the global shape, which fails on every shard
  (bench/grappler_addn_limit.py: a [4096, 4096] weight is the smallest size
  measured to trigger it); `build_mesh` switches it off."""
  error, specs = sum_of_four_error(mesh_data8, ['data', 'unsharded'], 4096)
  assert specs == ['data', 'unsharded']
  assert error <= 1e-5
