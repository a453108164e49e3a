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
meshgin's `keep_sums_whole`, which switches the memory optimizer off). Each
row runs in a fresh process and checks the gradient against NumPy.
Measured: sharded weights of [4096, 4096] and up fail by default and are
right with the optimizer off; replicated ones are right either way (the
rewrite happens, the shapes agree); [2048, 2048] never triggers it.

    python bench/grappler_addn_limit.py [--out bench/results/grappler_addn.json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CHILD = r'''
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[4])
from layout_core.layout import mesh as mesh_lib
from layout_core.lazy import dtensor, tf
size, layout, setting = int(sys.argv[1]), sys.argv[2], sys.argv[3]
mesh_lib.configure_virtual_cpus(8)
mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')
if setting == 'optimizer off (keep_sums_whole)':
  mesh_lib.keep_sums_whole()
spec = ['data', 'unsharded'] if layout == 'sharded' else ['unsharded', 'unsharded']
rng = np.random.default_rng(0)
value = rng.uniform(-1, 1, size=[size, size]).astype(np.float32)
w = dtensor.DVariable(mesh_lib.pack_global_array(value, dtensor.Layout(spec, mesh)))
scales = (1.0, 2.0, 3.0, 4.0)

@tf.function
def gradient():
  with tf.GradientTape() as tape:
    total = tf.add_n([tf.reduce_sum(tf.tanh(w * s)) for s in scales])
  return tape.gradient(total, w)

try:
  got = dtensor.unpack(dtensor.relayout(gradient(), dtensor.Layout.replicated(mesh, 2)))[0]
  got = got.numpy()
  want = sum(s * (1 - np.tanh(value * s) ** 2) for s in scales)
  result = {'ok': True, 'max_error': float(np.max(np.abs(got - want)))}
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
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
