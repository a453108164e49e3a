r"""Host memory of DTensor's all-gather on CPU: the default lowering vs CollectiveGatherV2.

A sharded -> replicated `dtensor.relayout` inside a `tf.function` (the step
that gathers a parameter back after a sharded optimizer update) is timed and
its host memory (RSS) measured, in a fresh process per setting, for several
shapes and gathered dims on an 8-device CPU mesh:

  * default: DTensor lowers the all-gather to a zero-padded all-reduce;
  * `LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2=1`: TF's CollectiveGatherV2
    (what `layout_core.tf_internals.lower_gathers_once` sets, once per
    process, when the process's first mesh has one axis).

Reported: RSS added by the first call and by the next ones, seconds per call,
and whether both settings give identical values.

    python bench/all_gather_memory.py [--out bench/results/all_gather_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS, run_child, write_json  # pylint: disable=wrong-import-position

_CHILD = r'''
import json, sys, time
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8)
mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')
shape, dim, count = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def rss():
  return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
spec = [dtensor.UNSHARDED] * len(shape)
spec[dim] = 'data'
replicated, sharded = dtensor.Layout.replicated(mesh, len(shape)), dtensor.Layout(spec, mesh)
init = np.random.default_rng(0).normal(size=shape).astype(np.float32)
variables = [dtensor.DVariable(dtensor.copy_to_mesh(tf.constant(init), replicated))
             for _ in range(count)]
@tf.function
def update():
  for v in variables:  # the sharded update, then the parameter gathered back
    part = dtensor.relayout(v.read_value(), sharded)
    v.assign(dtensor.relayout(part * 0.5 + 1.0, replicated))
before = rss()
update()
first = rss()
start = time.perf_counter()
for _ in range(3):
  update()
dtensor.unpack(variables[-1].read_value())[0].numpy()  # wait for the calls to finish
seconds = (time.perf_counter() - start) / 3
after = rss()
checksum = float(sum(float(tf.reduce_sum(dtensor.unpack(v.read_value())[0])) for v in variables))
print('RESULT ' + json.dumps({'first_call_bytes': first - before, 'later_calls_bytes': after - first,
                              'seconds_per_call': seconds, 'checksum': checksum}))
'''

CASES = [([1024, 4096], 1, 4), ([4096, 1024], 0, 4), ([1024, 4, 256], 0, 4),
         ([4, 256, 1024], 2, 4)]
SETTINGS = {'default (all-reduce)': None, 'CollectiveGatherV2': '1'}
VARIABLE = 'LOWER_DTENSOR_GATHER_TO_COLLECTIVE_GATHER_V2'


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'all_gather_memory.json'))
  args = parser.parse_args()
  results = []
  print(f'{"shape":>16s} {"dim":>3s} {"vars":>4s} {"replicated MiB":>14s} {"setting":>22s} '
        f'{"+RSS 1st MiB":>12s} {"+RSS later":>10s} {"ms/call":>8s}')
  for shape, dim, count in CASES:
    checksums = set()
    for name, value in SETTINGS.items():
      row = run_child(_CHILD, json.dumps(shape), str(dim), str(count), env={VARIABLE: value})
      checksums.add(round(row.pop('checksum'), 2))
      size = 4 * 8 * count
      for n in shape:
        size *= n
      row.update(shape=shape, dim=dim, variables=count, setting=name, replicated_bytes=size)
      results.append(row)
      print(f'{str(shape):>16s} {dim:3d} {count:4d} {size / 2**20:14.0f} {name:>22s} '
            f'{row["first_call_bytes"] / 2**20:12.0f} {row["later_calls_bytes"] / 2**20:10.0f} '
            f'{1e3 * row["seconds_per_call"]:8.1f}', flush=True)
    print(f'{"":>16s} same values in both settings: {len(checksums) == 1}')
  write_json(results, args.out)


if __name__ == '__main__':
  main()
