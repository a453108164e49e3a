r"""Limit check: where does TF 2.21's CollectiveGatherV2 lowering of DTensor relayouts work?

`layout_core.tf_internals.lower_gathers_once` (called by `build_mesh`) turns
on `LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2` only for a process whose
first mesh has one axis, and `build_mesh` then refuses meshes of more. This
shows why: every relayout between layouts of a [8, 8, 16] tensor (each dim
unsharded or on a mesh axis, then back to replicated) is run on a one-axis
mesh (`data=8`) and a two-axis mesh (`data=2 x model=4`), eagerly and inside a
`tf.function`, with the default lowering and with CollectiveGatherV2, in a
fresh process each; every result is compared with the input.

    python bench/limits/gather_lowering_limit.py [--out bench/results/gather_lowering.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from bench.common import RESULTS, run_child, write_json  # pylint: disable=wrong-import-position

_CHILD = r'''
import itertools, json, sys
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8)
axes, compiled = json.loads(sys.argv[1]), sys.argv[2] == 'function'
mesh = dtensor.create_mesh([tuple(a) for a in axes], device_type='CPU')
U = 'unsharded'
names = [a for a, _ in axes]
specs = [s for s in itertools.product(names + [U], repeat=3)
         if any(x != U for x in s) and len([x for x in s if x != U]) == len({x for x in s if x != U})]
value = np.arange(8 * 8 * 16, dtype=np.float32).reshape(8, 8, 16)
replicated = dtensor.Layout.replicated(mesh, 3)
counts = {'ok': 0, 'error': 0, 'wrong': 0}
first_error = ''
for source in specs:
  for target in [(U, U, U)] + [s for s in specs if s != source]:
    x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(value), replicated),
                         dtensor.Layout(list(source), mesh))
    def move(t, target=target):
      return dtensor.relayout(dtensor.relayout(t, dtensor.Layout(list(target), mesh)) + 0.0,
                              replicated)
    try:
      y = tf.function(move)(x) if compiled else move(x)
      same = np.array_equal(dtensor.unpack(y)[0].numpy(), value)
      counts['ok' if same else 'wrong'] += 1
    except Exception as e:  # pylint: disable=broad-except
      counts['error'] += 1
      first_error = first_error or f'{source} -> {target}: {type(e).__name__}: {str(e).splitlines()[0][:160]}'
print('RESULT ' + json.dumps({**counts, 'first_error': first_error}))
'''

MESHES = {'data=8': [['data', 8]], 'data=2 x model=4': [['data', 2], ['model', 4]]}
VARIABLE = 'LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'gather_lowering.json'))
  args = parser.parse_args()
  results = []
  print(f'{"mesh":>18s} {"mode":>9s} {"lowering":>20s} {"ok":>5s} {"error":>6s} {"wrong":>6s}')
  for mesh_name, axes in MESHES.items():
    for mode in ('eager', 'function'):
      for lowering in ('default', 'CollectiveGatherV2'):
        row = run_child(_CHILD, json.dumps(axes), mode,
                        env={VARIABLE: None if lowering == 'default' else '1'})
        row.update(mesh=mesh_name, mode=mode, lowering=lowering)
        results.append(row)
        print(f'{mesh_name:>18s} {mode:>9s} {lowering:>20s} {row["ok"]:5d} {row["error"]:6d} '
              f'{row["wrong"]:6d}', flush=True)
        if row['first_error']:
          print(f'{"":>18s} first error: {row["first_error"]}')
  write_json(results, args.out)


if __name__ == '__main__':
  main()
