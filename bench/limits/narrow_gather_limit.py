r"""Limit check: what gathering a narrow (bfloat16, int8) weight over `data=8` holds on CPU.

FSDP stores every weight split and gathers it where the math uses it. A
frozen base stored narrow (`train.frozen_dtype`) was gathered in its own
dtype and widened after; with FSDP on `data=8` its runs peaked at 2.3x
(bfloat16) and 3.1x (int8) a float32 base's (`bench/frozen_memory.py`).
This isolates one weight [D, F], stored split over 'data' on its first
dim, gathered to replicated and used in `x @ w` (x [B, T, D] split over
the batch, float32 math) in a `tf.function`, its forward only (what
evaluation runs) and the input's gradient (what training runs for a frozen
weight), for each stored dtype (float32, bfloat16, int8) and each way:

  * `narrow`: gathered in the stored dtype, then widened to float32;
  * `widened`: widened to float32 on each device's slice, then gathered
    (what `layout_core.layout.fsdp.gather_all` does now).

Each lowering of DTensor's all-gathers (CollectiveGatherV2, which
`build_mesh` picks for a one-axis mesh, and TF's default zero-padded
all-reduce) runs in a fresh process: the choice is per process. Measured
per case: the bytes made during one call and live at the CPU allocator's
peak (TensorFlow's profiler, `bench/peak_breakdown.py`), in whole float32
weights, and the ops that made them; and that every way gives the same
values. oneDNN is on in the children (`ONEDNN`).

    python bench/limits/narrow_gather_limit.py [--dim 1536 --ffn 6144] \
        [--out bench/results/narrow_gather_limit.json]
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from bench.common import RESULTS, run_child, write_json  # pylint: disable=wrong-import-position

_CHILD = r'''
import json, sys
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
sys.path.insert(0, sys.argv[1])
from bench.peak_breakdown import live_at_peak
from layout_core import tf_internals
from layout_core.layout.mesh import MeshSpec, build_mesh
collective_gather, d, f, b, t = sys.argv[2] == 'CollectiveGatherV2', *map(int, sys.argv[3:7])
tf_internals.lower_gathers_once(collective_gather, reason='the limit check asks for it')
mesh = build_mesh(MeshSpec(shape={'data': 8}))
U = dtensor.UNSHARDED
stored, use = dtensor.Layout(['data', U], mesh), dtensor.Layout.replicated(mesh, 2)
rng = np.random.default_rng(0)
w32 = rng.normal(0, 0.02, (d, f)).astype(np.float32)
x = dtensor.relayout(dtensor.copy_to_mesh(tf.constant(rng.normal(0, 1, (b, t, d)), tf.float32),
                                          dtensor.Layout.replicated(mesh, 3)),
                     dtensor.Layout(['data', U, U], mesh))
values = {'float32': w32, 'bfloat16': w32,
          'int8': np.clip(np.round(w32 / 0.0005), -127, 127)}

def variable(dtype):
  value = dtensor.copy_to_mesh(tf.cast(tf.constant(values[dtype]), dtype), use)
  return dtensor.DVariable(dtensor.relayout(value, stored), trainable=False)

def gathered(w, way):
  if way == 'widened':
    return dtensor.relayout(tf.cast(w, tf.float32), use)
  return tf.cast(dtensor.relayout(tf.convert_to_tensor(w), use), tf.float32)

rows, outputs = [], {}
for dtype in ('float32', 'bfloat16', 'int8'):
  w = variable(dtype)
  for way in ('narrow', 'widened'):
    if dtype == 'float32' and way == 'widened':
      continue  # the same ops
    @tf.function
    def forward(w=w, way=way):
      return tf.einsum('btd,df->btf', x, gathered(w, way))
    @tf.function
    def backward(w=w, way=way):
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(tf.square(tf.einsum('btd,df->btf', x, gathered(w, way))))
      return tape.gradient(loss, x)
    for name, fn in (('forward', forward), ('backward', backward)):
      out = fn()
      outputs[(dtype, way, name)] = dtensor.unpack(out)[0].numpy()
      # One slice fetched: fetching it whole would gather it.
      found = live_at_peak(lambda: dtensor.unpack(fn())[0].numpy(), min_bytes=2**20)
      rows.append({'dtype': dtype, 'way': way, 'function': name,
                   'peak_bytes': found['made_in_call_live_at_peak_bytes'],
                   'by_op': [{'op': r['op'].split('/')[-1][-60:], 'bytes': r['bytes'],
                              'tensors': r['tensors']} for r in found['by_op'][:4]]})
same = {f'{dtype} {name}': bool(np.array_equal(outputs[(dtype, 'narrow', name)],
                                               outputs[(dtype, 'widened', name)]))
        for dtype in ('bfloat16', 'int8') for name in ('forward', 'backward')}
print('RESULT ' + json.dumps({'rows': rows, 'same_values': same}))
'''

LOWERINGS = ('CollectiveGatherV2', 'default')
# The profiler records the allocations of oneDNN's allocator only; TF turns
# oneDNN on by default only on CPUs with AVX512_VNNI, AVX512_BF16 or AMX (on a
# 2-core AVX2 EPYC it was off: no event recorded), so it is turned on here.
ONEDNN = {'TF_ENABLE_ONEDNN_OPTS': '1'}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--dim', type=int, default=1536)
  parser.add_argument('--ffn', type=int, default=6144)
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--time', type=int, default=64)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'narrow_gather_limit.json'))
  args = parser.parse_args()
  whole = args.dim * args.ffn * 4
  results = {'dim': args.dim, 'ffn': args.ffn, 'batch': args.batch, 'time': args.time,
             'devices': 8, 'whole_float32_weight_bytes': whole, 'lowerings': {}}
  for lowering in LOWERINGS:
    found = run_child(_CHILD, REPO, lowering, *map(str, (args.dim, args.ffn, args.batch,
                                                         args.time)), env=ONEDNN)
    for row in found['rows']:
      row['peak_in_whole_float32_weights'] = row['peak_bytes'] / whole
      print(f"{lowering:18s} {row['dtype']:8s} {row['way']:8s} {row['function']:8s} "
            f"{row['peak_bytes'] / 2**20:8.1f} MiB = "
            f"{row['peak_in_whole_float32_weights']:5.2f} whole float32 weights", flush=True)
      for op in row['by_op']:
        print(f"      {op['bytes'] / 2**20:8.1f} MiB  {op['op']}  {op['tensors']}")
    print(f'{lowering}: same values either way: {found["same_values"]}', flush=True)
    results['lowerings'][lowering] = found
  write_json(results, args.out)


if __name__ == '__main__':
  main()
