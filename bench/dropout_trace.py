"""What a dropout mask costs to trace and compile: the element index as one
range, reshaped, against broadcast ranges.

A mask bit hashes each element's global row-major index
(`layout_core.model.random.dropout`), so every dropout in a step function
builds that index. `one range` is `layout_core.layout.variables.flat_index`
(a range over all elements, reshaped); `broadcast ranges` builds it as
meshgin did before, one range per dim scaled by its stride and added with
broadcasting (about ten graph ops per dim). The work: a step function of a
stack of 12 dropouts (rate 0.1) on a [8, 16, 32] activation sharded
batch x model on a 2x2 mesh of virtual CPUs, with the gradient; each
contender in a fresh process, in turns round after round; each figure is
the best round's.

    python bench/dropout_trace.py [--rounds 3]

It reports the graph ops of the traced function (forward and backward), the
CPU seconds of the trace and of the first call (compile and run) and the
milliseconds of a later call, and whether the two masks are equal bit for
bit. Results go to bench/results/dropout_trace.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, children_in_turns, write_json  # noqa: E402

CONTENDERS = ('one range', 'broadcast ranges')
LAYERS = 12

CHILD = r'''
import json, sys, time
broadcast, layers = sys.argv[1] == '1', int(sys.argv[2])
from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus
configure_virtual_cpus(4)
from layout_core.lazy import tf, dtensor
from layout_core.layout import variables
from layout_core.model import random

def broadcast_ranges(shape):  # meshgin's index before the one range
  index = tf.zeros([1] * len(shape), tf.int64)
  stride = 1
  for dim in reversed(range(len(shape))):
    axis_range = tf.range(shape[dim], dtype=tf.int64) * stride
    index = index + tf.reshape(axis_range, [-1 if i == dim else 1 for i in range(len(shape))])
    stride *= shape[dim]
  return index

if broadcast:
  random.flat_index = broadcast_ranges
mesh = build_mesh(MeshSpec(shape={'data': 2, 'model': 2}))
layout = dtensor.Layout(['data', 'unsharded', 'model'], mesh)
x = dtensor.call_with_layout(tf.ones, layout, shape=[8, 16, 32])

def step(x, seed):
  with tf.GradientTape() as tape:
    tape.watch(x)
    h = x
    for layer in range(layers):
      h = random.dropout(h, rate=0.1, inputs=random.DropoutInputs(seed, layer + 1, 0)) * 1.01
    total = tf.reduce_sum(h)
  return h, tape.gradient(total, x)

function = tf.function(step, autograph=False)
seed = dtensor.copy_to_mesh(tf.constant(7, tf.int64), dtensor.Layout.replicated(mesh, 0))
start = time.process_time()
concrete = function.get_concrete_function(x, seed)
trace = time.process_time() - start
start = time.process_time()
h, grad = function(x, seed)
float(tf.reduce_sum(grad))
first = time.process_time() - start
later = []
for _ in range(5):
  start = time.perf_counter()
  h, grad = function(x, seed)
  float(tf.reduce_sum(grad))
  later.append(time.perf_counter() - start)
mask = (dtensor.relayout(h, dtensor.Layout.replicated(mesh, 3)).numpy() != 0)
print('RESULT ' + json.dumps({
    'ops': len(concrete.graph.get_operations()), 'trace_cpu': trace, 'first_call_cpu': first,
    'later_call_ms': 1000 * min(later), 'kept': mask.mean().item(),
    'mask': ''.join('1' if b else '0' for b in mask.ravel()[:4096])}))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  rounds, best = children_in_turns(
      CHILD, {name: ['1' if name == 'broadcast ranges' else '0', str(LAYERS)]
              for name in CONTENDERS}, rounds=args.rounds,
      keys=('ops', 'trace_cpu', 'first_call_cpu', 'later_call_ms'),
      describe=lambda r: (f'{r["ops"]:5d} ops, trace {r["trace_cpu"]:5.2f} CPU-s, first call '
                          f'{r["first_call_cpu"]:5.2f} CPU-s, later call '
                          f'{r["later_call_ms"]:6.2f} ms'))
  same_masks = len({r['mask'] for runs in rounds.values() for r in runs}) == 1
  one, old = best['one range'], best['broadcast ranges']
  ratio = (old['trace_cpu'] + old['first_call_cpu']) / (one['trace_cpu'] + one['first_call_cpu'])
  print(f'{LAYERS} dropouts: {old["ops"]} -> {one["ops"]} graph ops; trace + first call '
        f'{ratio:.2f}x the CPU with broadcast ranges; masks equal: {same_masks}')
  write_json({'layers': LAYERS, 'best': best, 'ratio_trace_and_compile_cpu': ratio,
              'same_masks': same_masks, 'kept_fraction': rounds['one range'][0]['kept'],
              'rounds': {n: [{k: v for k, v in r.items() if k != 'mask'} for r in runs]
                         for n, runs in rounds.items()}},
             os.path.join(RESULTS, 'dropout_trace.json'))


if __name__ == '__main__':
  main()
