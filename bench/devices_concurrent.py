"""Do a process's logical CPU devices run at the same time? (the pipeline
engines' premise, measured with no pipeline at all).

The same work, a 6-layer ReLU chain x[256, 1024] @ w[1024, 1024] (and, to
find where it stops, the pipeline bench's micro-batch x[16, 512] @ w[512, 512]), run

* `one device`: on one logical device (the reference);
* `mesh, replicated`: on a 2-device DTensor mesh with replicated inputs, so
  each device runs the whole chain (2x the work of `one device`);
* `mesh, stage-sharded`: stacked [2, ...] weights and inputs sharded over a
  'stage' axis: each device runs its own chain (the SPMD engine's form);
* `two sub-meshes, one function`: one chain on each of two 1-device meshes in
  one tf.function (the sub-mesh engine's form);
* `two tf.devices, one function`: the same without DTensor.

If the two devices run together, 2x the work takes ~1x the reference's time
on 2 cores (time ratio ~1, CPU-seconds per wall-second ~2); if they take
turns, ~2x. Each variation of the thread settings runs in its own process
(TensorFlow reads them once): meshgin's (`configure_cpu_threads`: cores //
devices intra-op threads), intra-op 1 / inter-op 4, and TF's defaults.

    python bench/devices_concurrent.py [--out bench/results/devices_concurrent.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, run_child, write_json  # noqa: E402

CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
threads, (B, D) = json.loads(sys.argv[2]), json.loads(sys.argv[3])
import tensorflow as tf
from tensorflow.experimental import dtensor
if threads == 'meshgin':
  from layout_core.layout.mesh import configure_virtual_cpus
  configure_virtual_cpus(2)
else:
  if threads:
    tf.config.threading.set_intra_op_parallelism_threads(threads[0])
    tf.config.threading.set_inter_op_parallelism_threads(threads[1])
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
devices = [f'/job:localhost/replica:0/task:0/device:CPU:{i}' for i in range(2)]
pair = dtensor.create_mesh([('x', 2)], devices=devices, device_type='CPU')
stage = dtensor.create_mesh([('stage', 2)], devices=devices, device_type='CPU')
singles = [dtensor.create_mesh([('x', 1)], devices=[d], device_type='CPU') for d in devices]
LAYERS = 6

def chain(x, w):
  for _ in range(LAYERS):
    x = tf.nn.relu(tf.matmul(x, w)) * 0.03
  return x

def on(layout, shape):
  return dtensor.call_with_layout(tf.function(lambda: tf.random.stateless_normal(shape, [1, 2])),
                                  layout)

results = {}
def wait(out):
  for o in (out if isinstance(out, (list, tuple)) else [out]):
    dtensor.unpack(o) if dtensor.is_dtensor(o) else o.numpy()

def timed(name, fn, *args, work=1):
  for _ in range(3):
    wait(fn(*args))
  best, cpu_per_wall = 1e9, 0.0
  for _ in range(3):
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    for _ in range(10):
      out = fn(*args)
    wait(out)
    wall = (time.perf_counter() - start) / 10
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime) / 10
    if wall < best:
      best, cpu_per_wall = wall, cpu / wall
  results[name] = {'ms': 1e3 * best, 'cpu_per_wall': cpu_per_wall, 'work': work}

with tf.device(devices[0]):
  x1, w1 = tf.random.normal([B, D]), tf.random.normal([D, D])
timed('one device', tf.function(chain), x1, w1)
rep = lambda rank: dtensor.Layout.replicated(pair, rank)
timed('mesh, replicated', tf.function(chain), on(rep(2), [B, D]), on(rep(2), [D, D]), work=2)
def stacked(x, w):
  for _ in range(LAYERS):
    x = tf.nn.relu(tf.einsum('sbd,sde->sbe', x, w)) * 0.03
  return x
xs = on(dtensor.Layout(['stage', 'unsharded', 'unsharded'], stage), [2, B, D])
ws = on(dtensor.Layout(['stage', 'unsharded', 'unsharded'], stage), [2, D, D])
timed('mesh, stage-sharded', tf.function(stacked), xs, ws, work=2)
xa, wa = on(dtensor.Layout.replicated(singles[0], 2), [B, D]), on(dtensor.Layout.replicated(singles[0], 2), [D, D])
xb, wb = on(dtensor.Layout.replicated(singles[1], 2), [B, D]), on(dtensor.Layout.replicated(singles[1], 2), [D, D])
timed('two sub-meshes, one function', tf.function(lambda a, b, c, d: [chain(a, b), chain(c, d)]),
      xa, wa, xb, wb, work=2)
with tf.device(devices[1]):
  x2, w2 = tf.random.normal([B, D]), tf.random.normal([D, D])
def two_devices(a, b, c, d):
  with tf.device(devices[0]):
    first = chain(a, b)
  with tf.device(devices[1]):
    second = chain(c, d)
  return [first, second]
timed('two tf.devices, one function', tf.function(two_devices), x1, w1, x2, w2, work=2)
print('RESULT ' + json.dumps(results))
'''

VARIANTS = {'meshgin threads (cores // devices)': 'meshgin',
            'intra-op 1, inter-op 4': [1, 4], 'TF defaults': None}
SIZES = {'x[256, 1024] @ w[1024, 1024]': [256, 1024],
         'x[16, 512] @ w[512, 512] (bench/pipeline.py\'s micro-batch)': [16, 512]}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'devices_concurrent.json'))
  args = parser.parse_args()
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  results = {'cores': len(os.sched_getaffinity(0))}
  for size, shape in SIZES.items():
    for variant, threads in VARIANTS.items():
      measured = run_child(CHILD, repo, json.dumps(threads), json.dumps(shape))
      reference = measured['one device']['ms']
      print(f'{size}, {variant}:')
      for name, m in measured.items():
        m['time_ratio'] = m['ms'] / reference
        print(f"  {name:32s} {m['ms']:7.2f} ms  {m['time_ratio']:4.2f}x one device "
              f"for {m['work']}x the work  {m['cpu_per_wall']:4.2f} CPU-s per wall-s")
      results[f'{size}, {variant}'] = measured
  write_json(results, args.out)


if __name__ == '__main__':
  main()
