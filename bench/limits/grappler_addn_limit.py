"""Limit check: Grappler's memory optimizer breaks sharded sums in DTensor functions.

When Grappler estimates that a function's peak memory is high, its memory
optimizer rewrites every sum of three or more tensors that is live at the
peak (`AddN`, which is how a gradient of a weight used in several places is
summed) into in-place adds to a temporary variable. The variable's shape
comes from the graph's static shapes, and in DTensor's per-device functions
those are the global shapes: with a sharded sum every add then fails with
"Parameters and update must be the same size". The SPMD pipeline engine hit
it on a 4x wider lm_small (its stacked weights' gradients sum 8 micro-batches).

This measures it on the smallest function that shows it: the gradient of
sum_i sum(tanh(w * i)), i = 1..4, for a float32 weight `w` on a
{'data': 8} mesh of 8 virtual CPU devices, for each size, layout (rows
sharded 8 ways or replicated) and setting (TensorFlow's default, and
meshgin's `layout_core.tf_internals.keep_sums_whole`, which switches the
memory optimizer off). Each row runs in a fresh process and checks the
gradient against NumPy (tests/test_tf_internals.py runs the sharded
[4096, 4096] row as its positive control).
Measured: sharded weights of [4096, 4096] and up fail by default and are
right with the optimizer off; replicated ones are right either way (the
rewrite happens, the shapes agree); [2048, 2048] never triggers it.

    python bench/limits/grappler_addn_limit.py [--out bench/results/grappler_addn.json]
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.common import RESULTS, run_child, write_json  # noqa: E402

SCALES = (1.0, 2.0, 3.0, 4.0)


def sum_of_four_error(mesh, spec, size: int) -> tuple[float, list[str]]:
  """The gradient of sum_i sum(tanh(w * i)), i = 1..4, for a random [size,
  size] weight laid out as `spec` on `mesh`: its largest error against NumPy,
  and its layout's sharding specs. Raises what TensorFlow raises when the
  function fails."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from layout_core.layout import mesh as mesh_lib  # pylint: disable=import-outside-toplevel
  from layout_core.lazy import dtensor, tf  # pylint: disable=import-outside-toplevel
  value = np.random.default_rng(0).uniform(-1, 1, size=[size, size]).astype(np.float32)
  w = dtensor.DVariable(mesh_lib.pack_global_array(value, dtensor.Layout(spec, mesh)))

  @tf.function
  def gradient():
    with tf.GradientTape() as tape:
      total = tf.add_n([tf.reduce_sum(tf.tanh(w * s)) for s in SCALES])
    return tape.gradient(total, w)

  grad = gradient()
  got = dtensor.unpack(dtensor.relayout(grad, dtensor.Layout.replicated(mesh, 2)))[0]
  want = sum(s * (1 - np.tanh(value * s) ** 2) for s in SCALES)
  return float(np.max(np.abs(got.numpy() - want))), dtensor.fetch_layout(grad).sharding_specs


CHILD = r'''
import json, sys
sys.path.insert(0, sys.argv[4])
from bench.limits.grappler_addn_limit import sum_of_four_error
from layout_core import tf_internals
from layout_core.layout import mesh as mesh_lib
from layout_core.lazy import dtensor
size, layout, setting = int(sys.argv[1]), sys.argv[2], sys.argv[3]
mesh_lib.configure_virtual_cpus(8)
mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')
if setting == 'optimizer off (keep_sums_whole)':
  tf_internals.keep_sums_whole()
spec = ['data', 'unsharded'] if layout == 'sharded' else ['unsharded', 'unsharded']
try:
  result = {'ok': True, 'max_error': sum_of_four_error(mesh, spec, size)[0]}
except Exception as error:  # pylint: disable=broad-except
  result = {'ok': False, 'error': f'{type(error).__name__}: ' + str(error).split('\n')[0][-160:]}
print('RESULT ' + json.dumps(result))
'''

SIZES = (2048, 4096, 8192)
LAYOUTS = ('sharded', 'replicated')
SETTINGS = ('TensorFlow default', 'optimizer off (keep_sums_whole)')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'grappler_addn.json'))
  args = parser.parse_args()
  repo = REPO
  rows = []
  for size in SIZES:
    for layout in LAYOUTS:
      for setting in SETTINGS:
        result = run_child(CHILD, str(size), layout, setting, repo)
        rows.append({'weight': f'[{size}, {size}]', 'layout': layout, 'setting': setting,
                     **result})
        outcome = (f"right (max error {result['max_error']:.1e})" if result['ok']
                   else result['error'])
        print(f'[{size}, {size}] {layout:10s} {setting:32s} {outcome}', flush=True)
  write_json(rows, args.out)


if __name__ == '__main__':
  main()
