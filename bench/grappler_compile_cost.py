"""What Grappler costs the first steps of a small DTensor model, where compiling is the work.

The suite's shared pytest process trains dozens of tiny models for a few
steps each (the composition matrix, FSDP, precision, pipelines), so its CPU
time is mostly TensorFlow compiling the step functions, and a large part of
that is Grappler rewriting each per-device function. This times three steps
of three composition-matrix cells (tests/test_composition.py's `make` and
`trace`, on the 8 virtual CPU devices of the tests) in fresh processes, each
cell with Grappler as TensorFlow sets it and with its meta optimizer off
(`tf.config.optimizer.set_experimental_options({'disable_meta_optimizer':
True})`, what tests/conftest.py sets for its shared process), in turns; CPU
seconds are the median of `--repeats` processes. The losses are printed
beside them: the same math, compiled two ways.

    python bench/grappler_compile_cost.py [--repeats 3] [--out bench/results/suite/grappler_compile_cost.json]

Its results are the test suite's, not meshgin's performance: they live in
bench/results/suite/, apart from the results docs/performance.md renders.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CELLS = ('spmd+remat=block+accum=2', 'plain+remat=full+fsdp+accum=2+optimizer=adafactor',
         'gpipe+remat=full')

CHILD = r'''
import json, os, resource, sys
sys.path.insert(0, os.getcwd())
from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus
configure_virtual_cpus(8)
import tensorflow as tf
from layout_core import tf_internals
tf_internals.lower_gathers_once(False, reason='bench')
from tests import composition, test_composition as tc  # imports tests/conftest.py: off
# Set after that import, before anything compiles: TensorFlow's default, or off.
tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': sys.argv[2] == 'off'})
meshes = {'2d': build_mesh(MeshSpec(shape={'data': 2, 'model': 4})),
          'stage': build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))}
cell = next(c for c in tc.CELLS if composition.name(c) == sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF)
losses = tc.trace(tc.make(cell, meshes), 3)['loss']
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
print('RESULT ' + json.dumps({'cpu_seconds': cpu, 'losses': losses}))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'suite', 'grappler_compile_cost.json'))
  args = parser.parse_args()
  rows = []
  for cell in CELLS:
    runs = {'default': [], 'off': []}
    for _ in range(args.repeats):
      for setting in runs:  # in turns, so drift hits both alike
        runs[setting].append(run_child(CHILD, cell, setting))
    seconds = {s: statistics.median(r['cpu_seconds'] for r in runs[s]) for s in runs}
    row = {'cell': cell, 'cpu_seconds_grappler_default': round(seconds['default'], 2),
           'cpu_seconds_meta_optimizer_off': round(seconds['off'], 2),
           'ratio_off_to_default': round(seconds['off'] / seconds['default'], 3),
           'losses_default': runs['default'][0]['losses'], 'losses_off': runs['off'][0]['losses']}
    rows.append(row)
    print(f"{cell}: {row['cpu_seconds_grappler_default']:.1f} s with Grappler, "
          f"{row['cpu_seconds_meta_optimizer_off']:.1f} s without "
          f"({row['ratio_off_to_default']:.2f}x); losses {row['losses_default']} vs "
          f"{row['losses_off']}", flush=True)
  write_json(rows, args.out)


if __name__ == '__main__':
  main()
