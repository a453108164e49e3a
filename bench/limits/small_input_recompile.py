"""Limit check: a small function input whose value changes recompiles the function once.

DTensor (TF 2.21) folds the value of a small function input (measured here:
17 elements or fewer are folded, 24 or more are not) into its compile cache
key. The first call with another value then
misses the cache and compiles the whole function again (SPMD expansion and
all); after that miss DTensor stops folding that input, so later values hit.
A step function that takes a host scalar that changes every step (the step,
a dropout seed, a clipping norm) therefore pays its compile twice: the
sub-mesh pipeline engine's lm_pipeline.gin run spent 9 of its 40 s on it.

This calls one step-sized function (a 4-layer MLP's loss and gradients on a
{'data': 2, 'model': 4} mesh, 8 virtual CPU devices) with an extra input of
each length and dtype, with the values 1, 1, 2, 3: for each call, whether
DTensor's function cache missed (its own counters) and the wall time.
Measured: every length up to 17 recompiles at the first new value (as long
as the first compile), 24 and more never do. The fix the engine uses,
`layout_core.layout.mesh.pack_changing_scalar` (64 copies, the function
reads [0]), is the 64-element row.

    python bench/limits/small_input_recompile.py [--out bench/results/small_input_recompile.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.common import RESULTS, write_json  # noqa: E402
from layout_core.layout import mesh as mesh_lib  # noqa: E402
from layout_core.lazy import dtensor, tf  # noqa: E402
import numpy as np  # noqa: E402

VALUES = (1, 1, 2, 3)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'small_input_recompile.json'))
  args = parser.parse_args()
  mesh = mesh_lib.build_mesh(mesh_lib.MeshSpec(shape={'data': 2, 'model': 4}))
  from tensorflow.dtensor.python import api  # pylint: disable=import-outside-toplevel
  misses = lambda: api._dtensor_device()._get_stats()['function_manager.miss']  # noqa: E731
  width = 256
  weights = [dtensor.DVariable(mesh_lib.pack_global_array(
      np.random.default_rng(i).normal(size=[width, width]).astype(np.float32) / 16,
      dtensor.Layout(['unsharded', 'model'] if i % 2 == 0 else ['model', 'unsharded'], mesh)))
      for i in range(4)]
  batch = mesh_lib.pack_global_array(np.ones([32, width], np.float32),
                                     dtensor.Layout(['data', 'unsharded'], mesh))
  results = {}
  for length in (1, 16, 17, 24, 31, 32, 64):
    for dtype in (np.int64, np.float32):

      @tf.function(autograph=False)
      def step(x, extra):
        with tf.GradientTape() as tape:
          h = x
          for w in weights:
            h = tf.nn.relu(h @ w)
          loss = tf.reduce_mean(h) * tf.cast(extra[0], tf.float32)
        return loss, tape.gradient(loss, weights)

      calls = []
      for value in VALUES:
        extra = mesh_lib.pack_global_array(np.full([length], value, dtype),
                                           dtensor.Layout.replicated(mesh, 1))
        before, start = misses(), time.perf_counter()
        [float(dtensor.unpack(t)[0]) for t in step(batch, extra)[:1]]
        calls.append({'value': value, 'missed': misses() > before,
                      'seconds': time.perf_counter() - start})
      key = f'{length} x {np.dtype(dtype).name}'
      results[key] = {'calls': calls,
                      'recompiled_at_new_value': calls[2]['missed'],
                      'new_value_vs_same_value': calls[2]['seconds'] / calls[1]['seconds']}
      print(f'{key:16s} ' + '  '.join(
          f"value {c['value']}: {'MISS' if c['missed'] else 'hit '} {c['seconds']:6.3f} s"
          for c in calls))
  write_json(results, args.out)


if __name__ == '__main__':
  main()
