r"""Limit check: does TensorFlow 2.21's einsum run bfloat16 as fast as its matmul here?

A bf16 quickstart step on `data=2` ran at a fifth of float32's rate while
`bench/limits/bf16_matmul_limit.py` found bf16 MatMul faster than float32. This
isolates the difference: a layer's projection x[b, t, d] @ w[d, f] with its
gradients (forward and backward, as a training step runs it) written as
`tf.einsum('btd,df->btf')` (as `layout_core.model.weights.dense` does) and
as `tf.matmul` broadcast over b, float32 vs bfloat16, timed in turns
in one process, for each variation that could change the answer: oneDNN on
or off (`TF_ENABLE_ONEDNN_OPTS`, read at import, so one subprocess each) and
intra-op threads 1 vs all cores. The shapes are the quickstart's feed-forward
layer on one device's rows and one 4x wider.

    python bench/limits/bf16_einsum_limit.py [--out bench/results/bf16_einsum.json]
"""

from __future__ import annotations

import argparse
import os
import sys

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from bench.common import RESULTS, run_child, write_json  # pylint: disable=wrong-import-position

SHAPES = ['16,64,64,256', '16,64,256,1024']  # b, t, d, f

_CHILD = r'''
import json, sys, time
import tensorflow as tf
threads, shapes, repeats = int(sys.argv[1]), sys.argv[2].split(';'), 3
if threads:
  tf.config.threading.set_intra_op_parallelism_threads(threads)
FORMS = {'einsum': lambda x, w: tf.einsum('btd,df->btf', x, w),
         'matmul': lambda x, w: tf.matmul(x, w)}
rows = []
for shape in shapes:
  b, t, d, f = (int(n) for n in shape.split(','))
  fns, inputs, best = {}, {}, {}
  for dtype in (tf.float32, tf.bfloat16):
    x = tf.cast(tf.random.normal([b, t, d]), dtype)
    w = tf.cast(tf.random.normal([d, f]), dtype)
    for form, project in FORMS.items():
      def step(x, w, project=project):  # forward and both gradients
        with tf.GradientTape() as tape:
          tape.watch([x, w])
          y = project(x, w)
        return tape.gradient(y, [x, w], output_gradients=tf.ones_like(y))
      key = f'{dtype.name} {form}'
      fns[key], inputs[key] = tf.function(step), (x, w)
      fns[key](x, w)[0].numpy()  # trace and warm up
  count = max(3, int(2e8 / (b * t * d * f)))
  for _ in range(repeats):  # in turns, best of `repeats`
    for key, fn in fns.items():
      start = time.perf_counter()
      for _ in range(count):
        out = fn(*inputs[key])
      out[0].numpy()
      best[key] = min(best.get(key, 1e9), (time.perf_counter() - start) / count)
  rows.append({'shape': [b, t, d, f], **{k.replace(' ', '_') + '_ms': v * 1e3
                                         for k, v in best.items()}})
print('RESULT ' + json.dumps(rows))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'bf16_einsum.json'))
  args = parser.parse_args()
  results = []
  print(f'{"oneDNN":>6s} {"threads":>7s} {"b, t, d, f":>18s} {"f32 einsum":>10s} '
        f'{"f32 matmul":>10s} {"bf16 einsum":>11s} {"bf16 matmul":>11s} '
        f'{"einsum/matmul bf16":>18s}')
  for onednn in ('1', '0'):
    for threads in (0, 1):
      rows = run_child(_CHILD, str(threads), ';'.join(SHAPES),
                       env={'TF_ENABLE_ONEDNN_OPTS': onednn})
      for row in rows:
        row.update(onednn=onednn == '1', intra_op_threads=threads or os.cpu_count(),
                   bf16_einsum_over_matmul=row['bfloat16_einsum_ms'] / row['bfloat16_matmul_ms'],
                   bf16_einsum_over_float32=row['bfloat16_einsum_ms'] / row['float32_einsum_ms'])
        results.append(row)
        print(f'{onednn:>6s} {row["intra_op_threads"]:7d} {str(row["shape"]):>18s} '
              f'{row["float32_einsum_ms"]:8.2f}ms {row["float32_matmul_ms"]:8.2f}ms '
              f'{row["bfloat16_einsum_ms"]:9.2f}ms {row["bfloat16_matmul_ms"]:9.2f}ms '
              f'{row["bf16_einsum_over_matmul"]:17.2f}x', flush=True)
  write_json(results, args.out)


if __name__ == '__main__':
  main()
