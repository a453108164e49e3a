"""What splitting lm_small's batch 8 ways costs its matmuls, with DTensor and
without it: is the gradients function's extra time on `data=8` DTensor's, or
the same work cut into smaller pieces on the same 2 cores?

The work: forward and backward (gradients of the input and of every weight)
of lm_small's four transformer blocks' matmuls and attention, on a batch of
32 x 64 tokens, width 256, 8 heads, ffn 1024. Each contender runs it

* `one device, B=32`: on one CPU device (the reference; meshgin's thread
  setting for a one-device mesh: TF's default intra-op pool);
* `one device, B=32, 1 thread`: the same with one intra-op thread;
* `8 tf.devices, B=4 each`: eight slices of the batch, one per logical
  device, in one tf.function, no DTensor, no collective: the same matmuls
  cut 8 ways and nothing else;
* `DTensor data=8`: the batch split over an 8-device mesh, weights
  replicated (DTensor adds the weight gradients' all-reduce);

each 8-device form under four thread settings (meshgin's: intra-op
cores // 8 = 1; TF's defaults; intra-op 1 with inter-op 8; intra-op 2 with
inter-op 2), each in its own process. Steps are timed
in rounds, best of 3. If `8 tf.devices` is as slow as `DTensor data=8`, the
cost is the split itself (smaller matmuls), not DTensor's.

    python bench/limits/split_matmul_limit.py [--out bench/results/split_matmul_limit.json]
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
sys.path.insert(0, sys.argv[1])
form, threads = sys.argv[2], json.loads(sys.argv[3])
import tensorflow as tf
from tensorflow.experimental import dtensor
N = 1 if form.startswith('one device') else 8
if threads == 'meshgin':
  from layout_core.layout.mesh import configure_virtual_cpus
  configure_virtual_cpus(N)
else:
  if threads:
    tf.config.threading.set_intra_op_parallelism_threads(threads[0])
    if len(threads) > 1:
      tf.config.threading.set_inter_op_parallelism_threads(threads[1])
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * N)
B, T, D, H, F, LAYERS = 32, 64, 256, 8, 1024, 4
K = D // H
rng = tf.random.Generator.from_seed(0)
shapes = {'wq': [D, H, K], 'wk': [D, H, K], 'wv': [D, H, K], 'wo': [H, K, D],
          'w_in': [D, F], 'w_out': [F, D]}
host = [{n: rng.normal(s) * 0.05 for n, s in shapes.items()} for _ in range(LAYERS)]
x_host = rng.normal([B, T, D])

def blocks(x, weights):
  for w in weights:
    q, k, v = (tf.einsum('btd,dhk->bthk', x, w[n]) for n in ('wq', 'wk', 'wv'))
    probs = tf.nn.softmax(tf.einsum('bthk,buhk->bhtu', q, k) * K ** -0.5)
    x = x + tf.einsum('bthk,hkd->btd', tf.einsum('bhtu,buhk->bthk', probs, v), w['wo'])
    x = x + tf.einsum('btf,fd->btd', tf.nn.relu(tf.einsum('btd,df->btf', x, w['w_in'])),
                      w['w_out'])
  return x

def grads_of(x, weights):
  flat = [w[n] for w in weights for n in shapes]
  with tf.GradientTape() as tape:
    tape.watch(x)
    tape.watch(flat)
    loss = tf.reduce_sum(tf.square(blocks(x, weights)))
  return tape.gradient(loss, [x] + flat)

if form.startswith('one device'):
  weights = [{n: tf.Variable(v) for n, v in w.items()} for w in host]
  step = tf.function(lambda: grads_of(x_host, weights))
elif form == '8 tf.devices':
  devices = [f'/device:CPU:{i}' for i in range(8)]
  copies, xs = [], []
  for i, d in enumerate(devices):
    with tf.device(d):
      copies.append([{n: tf.Variable(v) for n, v in w.items()} for w in host])
      xs.append(tf.identity(x_host[i * B // 8:(i + 1) * B // 8]))
  @tf.function
  def step():
    out = []
    for d, x, w in zip(devices, xs, copies):
      with tf.device(d):
        out.append(grads_of(x, w))
    return out
else:
  mesh = dtensor.create_mesh([('data', 8)], device_type='CPU')
  rep = lambda v: dtensor.DVariable(dtensor.copy_to_mesh(v, dtensor.Layout.replicated(mesh, v.shape.rank)))
  weights = [{n: rep(v) for n, v in w.items()} for w in host]
  x = dtensor.relayout(dtensor.copy_to_mesh(x_host, dtensor.Layout.replicated(mesh, 3)),
                       dtensor.Layout(['data', 'unsharded', 'unsharded'], mesh))
  step = tf.function(lambda: grads_of(x, weights))

def run():
  out = step()
  tf.nest.map_structure(lambda t: t.numpy() if not form.startswith('DTensor') else
                        dtensor.unpack(t)[0].numpy(), out)
for _ in range(3):
  run()
best = float('inf')
for _ in range(3):
  start = time.perf_counter()
  for _ in range(10):
    run()
  best = min(best, (time.perf_counter() - start) / 10)
print('RESULT ' + json.dumps({'ms': 1e3 * best}))
'''

FORMS = (('one device, B=32', 'meshgin'), ('one device, B=32, 1 thread', [1]),
         ('8 tf.devices', 'meshgin'), ('8 tf.devices', None), ('8 tf.devices', [1, 8]),
         ('8 tf.devices', [2, 2]),
         ('DTensor data=8', 'meshgin'), ('DTensor data=8', None), ('DTensor data=8', [1, 8]),
         ('DTensor data=8', [2, 2]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'split_matmul_limit.json'))
  args = parser.parse_args()
  repo = REPO
  results = []
  for form, threads in FORMS:
    ms = run_child(CHILD, repo, form, json.dumps(threads))['ms']
    results.append({'form': form, 'threads': threads or 'TF default', 'ms': ms})
  reference = results[0]['ms']
  for r in results:
    r['ratio_to_one_device'] = r['ms'] / reference
    label = 'meshgin' if r['threads'] == 'meshgin' else r['threads']
    print(f"{r['form']:28s} threads {str(label):10s} {r['ms']:7.1f} ms  "
          f"{r['ratio_to_one_device']:4.2f}x one device", flush=True)
  write_json(results, args.out)


if __name__ == '__main__':
  main()
