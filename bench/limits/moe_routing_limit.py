"""Which forms of an MoE router's math DTensor (TF 2.21) differentiates with
the batch's rows split, and which it does not: why `layout_core/model/moe.py`
reads the top-k weights back through one-hots and takes its load-balancing
loss as a mean over tokens.

The router's probabilities p [G rows, S tokens, E experts] (softmax of
random logits), on 8 virtual CPU devices. Each case is the gradient of a
scalar with respect to the logits, in its own process, computed

* with the rows split over `data=8` (as a training step holds them),
* with the experts' dim split instead (as DTensor lays the router's output
  out where nothing pins the rows and the expert weights are split: a
  sub-mesh pipeline stage with the experts over its batch axis), and
* replicated (the control: the same math on the same mesh),

under meshgin's thread settings and TF's defaults, and checked against the
same gradient on one device without DTensor. The cases:

* `top_k values`: sum of w * tf.math.top_k(p, 2).values, the plain way to
  read the chosen weights;
* `one-hot read-back` (meshgin's form): top_k for the indices only (no
  gradient), the weights read as einsum(one_hot(indices), p);
* `mean over rows and tokens`: sum of c * reduce_mean(p, axis=[0, 1]), the
  load-balancing loss's P_e as written;
* `mean over tokens` (meshgin's form): the same loss as the mean over
  tokens of sum_e c_e p_e.

Each prints ok with its largest gradient error, or the first line of the
error TensorFlow raised.

    python bench/limits/moe_routing_limit.py [--out bench/results/moe_routing_limit.json]
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
import json, sys
sys.path.insert(0, sys.argv[1])
case, placing, threads = sys.argv[2], sys.argv[3], sys.argv[4]
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
if threads == 'meshgin':
  from layout_core.layout.mesh import configure_virtual_cpus
  configure_virtual_cpus(8)
else:
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
G, S, E, K = 16, 32, 8, 2
rng = np.random.default_rng(0)
logits_host = rng.normal(size=(G, S, E)).astype(np.float32)
w_host = rng.normal(size=(G, S, K)).astype(np.float32)
c_host = rng.normal(size=(E,)).astype(np.float32)

def loss_of(logits, w, c):
  p = tf.nn.softmax(logits)
  if case == 'top_k values':
    return tf.reduce_sum(w * tf.math.top_k(p, K).values)
  if case == 'one-hot read-back':
    _, index = tf.math.top_k(tf.stop_gradient(p), K)
    top = tf.einsum('gske,gse->gsk', tf.one_hot(index, E, dtype=p.dtype), p)
    return tf.reduce_sum(w * top)
  if case == 'mean over rows and tokens':
    return tf.reduce_sum(c * tf.reduce_mean(p, axis=[0, 1]))
  return tf.reduce_mean(tf.einsum('gse,e->gs', p, c))  # 'mean over tokens'

def grad(logits, w, c):
  with tf.GradientTape() as tape:
    tape.watch(logits)
    loss = loss_of(logits, w, c)
  return tape.gradient(loss, logits)

expected = grad(tf.constant(logits_host), tf.constant(w_host), tf.constant(c_host)).numpy()
mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')
U = dtensor.UNSHARDED
def placed(value, spec):
  whole = dtensor.copy_to_mesh(tf.constant(value), dtensor.Layout.replicated(mesh, value.ndim))
  return dtensor.relayout(whole, dtensor.Layout(spec, mesh))
rows = ['data', U, U] if placing == 'rows split' else [U, U, U]
experts = [U, U, 'data'] if placing == 'experts split' else rows
try:
  found = tf.function(grad)(placed(logits_host, experts), placed(w_host, rows),
                            placed(c_host, [U]))
  found = dtensor.relayout(found, dtensor.Layout.replicated(mesh, 3))
  found = dtensor.unpack(found)[0].numpy()
  error = float(np.max(np.abs(found - expected)) / np.max(np.abs(expected)))
  result = {'ok': error < 1e-5, 'relative_error': error}
except Exception as e:  # what TensorFlow raised, first line
  result = {'ok': False, 'error': type(e).__name__ + ': ' + str(e).strip().splitlines()[0][:300]}
print('RESULT ' + json.dumps(result))
'''

CASES = ('top_k values', 'one-hot read-back', 'mean over rows and tokens', 'mean over tokens')
PLACINGS = ('rows split', 'experts split', 'replicated')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'moe_routing_limit.json'))
  args = parser.parse_args()
  results = []
  for case in CASES:
    for placing in PLACINGS:
      for threads in ('meshgin', 'tf defaults'):
        found = run_child(CHILD, REPO, case, placing, threads)
        results.append({'case': case, 'placing': placing, 'threads': threads, **found})
        what = (f"ok, gradient within {found['relative_error']:.1e}" if found['ok']
                else found.get('error') or f"WRONG by {found['relative_error']:.2e}")
        print(f'{case:26s} {placing:14s} threads {threads:11s} {what}', flush=True)
  write_json(results, args.out)


if __name__ == '__main__':
  main()
