"""`gather_together` against DTensor's own relayout, one tensor at a time.
(The all-gather lowering itself: tests/test_tf_internals.py.)"""

import numpy as np
import pytest

from layout_core.lazy import dtensor, tf
from layout_core.layout.gather import gather_together
from layout_core.layout.mesh import pack_global_array
from layout_core.layout.variables import to_numpy


def cases(mesh_data8, mesh_2x4):
  """(global value, its layout, target layout): shards split on their first,
  middle and last dims, several dtypes, a replicated value, a partly sharded
  target and a 2-D mesh (relaid one by one, or bucketed by axis)."""
  rng = np.random.RandomState(0)
  L = dtensor.Layout
  u = 'unsharded'
  return [
      (rng.randn(16, 3), L(['data', u], mesh_data8), L([u, u], mesh_data8)),
      (rng.randn(5, 24), L([u, 'data'], mesh_data8), L([u, u], mesh_data8)),
      (rng.randn(2, 8, 3), L([u, 'data', u], mesh_data8), L([u, u, u], mesh_data8)),
      (rng.randn(8), L(['data'], mesh_data8), L([u], mesh_data8)),
      (rng.randint(0, 9, (8, 2)).astype(np.int32), L(['data', u], mesh_data8),
       L([u, u], mesh_data8)),
      (rng.randn(4, 4), L([u, u], mesh_data8), L([u, u], mesh_data8)),
      (rng.randn(4, 8), L(['data', 'model'], mesh_2x4), L([u, 'model'], mesh_2x4)),
      (rng.randn(4, 8), L(['data', u], mesh_2x4), L([u, u], mesh_2x4)),
      (rng.randn(6, 8), L([u, 'model'], mesh_2x4), L([u, u], mesh_2x4)),
  ]


@pytest.mark.parametrize('bucket_bytes', [1 << 20, 200])
def test_gather_together_equals_relayout_one_by_one(mesh_data8, mesh_2x4, bucket_bytes):
  """Every value and layout is what `dtensor.relayout` gives, whether all
  shards share one bucket or most get their own (200 bytes)."""
  setups = cases(mesh_data8, mesh_2x4)
  values = [pack_global_array(v.astype(v.dtype if v.dtype == np.int32 else np.float32), src)
            for v, src, _ in setups]
  sources = [src for _, src, _ in setups]
  targets = [dst for _, _, dst in setups]
  together = tf.function(lambda *xs: gather_together(xs, sources, targets,
                                                     bucket_bytes=bucket_bytes))(*values)
  one_by_one = tf.function(
      lambda *xs: [dtensor.relayout(x, t) for x, t in zip(xs, targets)])(*values)
  for (expected, _, target), got, reference in zip(setups, together, one_by_one):
    assert dtensor.fetch_layout(got) == target
    np.testing.assert_array_equal(to_numpy(got), expected.astype(to_numpy(got).dtype))
    # Each device's local piece too, not only the assembled value.
    for mine, theirs in zip(dtensor.unpack(got), dtensor.unpack(reference)):
      np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
