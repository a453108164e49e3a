"""What the first call of a DTensor function costs on N virtual CPUs: the
limit under meshgin's start-up (bench/startup.py).

The work: one Adam update with global-norm clipping of 30 replicated
variables shaped like the quickstart's (957 graph ops), in one
`tf.function`, no meshgin code. Each contender is a fresh process; it times
the trace (`get_concrete_function`) and the first call (compile + run)
apart, and a later call:

* `plain`: tf.Variables on one device, no DTensor (the reference);
* `dtensor N`: DVariables replicated on a `data` mesh of N = 1, 2, 4, 8;
* variations on N = 8: Grappler off (`disable_meta_optimizer`); one
  intra-op thread (meshgin's setting for 8 devices on 2 cores);
  `DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION=1` (DTensor's one-function
  expansion instead of a copy per device).

    python bench/limits/dtensor_compile_limit.py [--rounds 3]

The same holds for the eager op that makes a variable's handle: DTensor
compiles it once per distinct variable name. `variables` makes 60
DVariables (replicated, 8 devices) named each by its own path, all by one
name, or unnamed.

Measured on the 2-core machine, 2026-11-26 (first call, s): plain 0.15;
DTensor 1: 0.37, 2: 0.39, 4: 0.67, 8: 1.37 (2.5 CPU-s); on 8 with Grappler
off 0.53, with one intra-op thread 1.38, with multi-device expansion 2.49.
The trace costs the same everywhere (0.35 s). So the compile grows with the
device count, and most of it is Grappler run on each device's copy.
Variables: 9.1 ms each named by their own paths, 1.7 ms all under one
name, 2.1 ms unnamed (hence `layout_core.layout.variables.dvariable`).
Results go to bench/results/dtensor_compile_limit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CHILD = r'''
import json, sys, time
devices, options = int(sys.argv[1]), json.loads(sys.argv[2])
import tensorflow as tf
from tensorflow.experimental import dtensor
if options.get('grappler') is False:
  tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
if options.get('intra_op'):
  tf.config.threading.set_intra_op_parallelism_threads(options['intra_op'])
shapes = [(64, 64)] * 16 + [(64,)] * 10 + [(64, 256), (256, 64), (64, 64), (256,)]
if devices:
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
  mesh = dtensor.create_mesh([('data', devices)], device_type='CPU')
  on_mesh = lambda v: dtensor.copy_to_mesh(v, dtensor.Layout.replicated(mesh, rank=v.shape.rank))
  variable = lambda v: dtensor.DVariable(on_mesh(v))
else:
  on_mesh, variable = (lambda v: v), tf.Variable
params, m, v = ([variable(tf.zeros(s)) for s in shapes] for _ in range(3))
step = variable(tf.constant(0.0))
grads = [on_mesh(tf.ones(s)) for s in shapes]

@tf.function(autograph=False)
def update(grads):
  norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads]))
  scale = tf.minimum(1.0, 1.0 / (norm + 1e-12))
  t = step.read_value() + 1.0
  correction = tf.sqrt(1.0 - 0.999 ** t) / (1.0 - 0.9 ** t)
  for p, m_, v_, g in zip(params, m, v, grads):
    g = g * scale
    new_m, new_v = 0.9 * m_ + 0.1 * g, 0.999 * v_ + 0.001 * tf.square(g)
    m_.assign(new_m)
    v_.assign(new_v)
    p.assign_sub(1e-3 * correction * new_m / (tf.sqrt(new_v) + 1e-8))
  step.assign_add(1.0)
  return norm

clock = lambda: (time.perf_counter(), time.process_time())
t0 = clock()
ops = len(update.get_concrete_function(grads).graph.get_operations())
t1 = clock()
update(grads).numpy()
t2 = clock()
update(grads).numpy()
t3 = clock()
print('RESULT ' + json.dumps({'ops': ops, 'trace': t1[0] - t0[0], 'first_call': t2[0] - t1[0],
                              'first_call_cpu': t2[1] - t1[1], 'later_call': t3[0] - t2[0]}))
'''

VARIABLES_CHILD = r'''
import json, sys, time
naming = sys.argv[1]
import tensorflow as tf
from tensorflow.experimental import dtensor
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')
layout = dtensor.Layout.replicated(mesh, rank=2)

def make(i):
  name = {'own path': f'lm/stack/block_{i:03d}/w', 'one name': 'w', 'unnamed': None}[naming]
  return dtensor.DVariable(dtensor.pack([tf.zeros((64, 64 + i % 3))] * 8, layout), name=name)
make(0)
start = time.perf_counter()
for i in range(1, 61):
  make(i)
print('RESULT ' + json.dumps({'ms_per_variable': (time.perf_counter() - start) / 60 * 1000}))
'''
NAMINGS = ('own path', 'one name', 'unnamed')

CONTENDERS = {  # name -> (devices (0: plain TF), options, environment)
    'plain': (0, {}, {}),
    'dtensor 1': (1, {}, {}),
    'dtensor 2': (2, {}, {}),
    'dtensor 4': (4, {}, {}),
    'dtensor 8': (8, {}, {}),
    'dtensor 8, Grappler off': (8, {'grappler': False}, {}),
    'dtensor 8, 1 intra-op thread': (8, {'intra_op': 1}, {}),
    'dtensor 8, multi-device expansion': (8, {}, {'DTENSOR_ENABLE_MULTI_DEVICE_EXPANSION': '1'}),
}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'dtensor_compile_limit.json'))
  args = parser.parse_args()
  rounds = {name: [] for name in CONTENDERS}
  for _ in range(args.rounds):
    for name, (devices, options, env) in CONTENDERS.items():
      rounds[name].append(run_child(CHILD, str(devices), json.dumps(options), env=env))
  best = {name: min(results, key=lambda r: r['first_call']) for name, results in rounds.items()}
  plain = best['plain']['first_call']
  print(f'{"contender":36s} {"ops":>5s} {"trace s":>8s} {"first call s":>13s} {"CPU s":>6s} '
        f'{"vs plain":>9s} {"later ms":>9s}')
  for name, r in best.items():
    print(f'{name:36s} {r["ops"]:5d} {r["trace"]:8.2f} {r["first_call"]:13.2f} '
          f'{r["first_call_cpu"]:6.2f} {r["first_call"] / plain:8.1f}x '
          f'{1000 * r["later_call"]:9.1f}')
  variables = {naming: min(run_child(VARIABLES_CHILD, naming)['ms_per_variable']
                           for _ in range(args.rounds)) for naming in NAMINGS}
  print('\n60 DVariables on 8 devices, ms each: ' +
        ', '.join(f'{naming} {ms:.1f}' for naming, ms in variables.items()))
  write_json(dict(rounds_run=args.rounds, best=best, rounds=rounds,
                  variables_ms_each=variables), args.out)


if __name__ == '__main__':
  main()
