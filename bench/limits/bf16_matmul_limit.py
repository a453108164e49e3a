r"""Limit check: does TensorFlow 2.21 multiply bfloat16 matrices faster than float32 here?

The bf16 step rate of `bench/memory.py` can only beat float32 if TF's own
MatMul kernel does. This isolates that kernel: square matmuls in a
`tf.function` (and with `jit_compile=True`), float32 vs bfloat16, timed in
turns in one process, for each variation that could change the answer:
oneDNN on or off (`TF_ENABLE_ONEDNN_OPTS`, read at import, so one
subprocess each) and intra-op threads 1 vs all cores.

    python bench/limits/bf16_matmul_limit.py [--sizes 512 1024 2048] [--out bench/results/bf16_matmul.json]
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
import json, sys, time
import tensorflow as tf
threads, sizes, repeats = int(sys.argv[1]), [int(s) for s in sys.argv[2].split(',')], 3
if threads:
  tf.config.threading.set_intra_op_parallelism_threads(threads)
rows = []
for size in sizes:
  for jit in (False, True):
    best = {}
    fns = {}
    inputs = {}
    for dtype in (tf.float32, tf.bfloat16):
      a = tf.cast(tf.random.normal([size, size]), dtype)
      b = tf.cast(tf.random.normal([size, size]), dtype)
      fns[dtype.name] = tf.function(lambda x, y: tf.matmul(x, y), jit_compile=jit)
      inputs[dtype.name] = (a, b)
      fns[dtype.name](a, b).numpy()  # trace and warm up
    count = max(2, int(4e9 / size**3))
    for _ in range(repeats):  # in turns, best of `repeats`
      for name, fn in fns.items():
        start = time.perf_counter()
        for _ in range(count):
          out = fn(*inputs[name])
        out.numpy()
        seconds = (time.perf_counter() - start) / count
        best[name] = min(best.get(name, 1e9), seconds)
    rows.append({'size': size, 'jit_compile': jit,
                 'float32_gflops': 2 * size**3 / best['float32'] / 1e9,
                 'bfloat16_gflops': 2 * size**3 / best['bfloat16'] / 1e9,
                 'bf16_speedup': best['float32'] / best['bfloat16']})
print('RESULT ' + json.dumps(rows))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--sizes', type=int, nargs='*', default=[512, 1024, 2048])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'bf16_matmul.json'))
  args = parser.parse_args()
  flags = open('/proc/cpuinfo').read() if os.path.exists('/proc/cpuinfo') else ''
  print(f'CPU flags: avx512_bf16={"avx512_bf16" in flags} amx_bf16={"amx_bf16" in flags}, '
        f'{os.cpu_count()} cores')
  results = []
  print(f'{"oneDNN":>6s} {"threads":>7s} {"size":>5s} {"jit":>5s} {"f32 GFLOP/s":>11s} '
        f'{"bf16 GFLOP/s":>12s} {"bf16/f32":>8s}')
  for onednn in ('1', '0'):
    for threads in (0, 1):
      rows = run_child(_CHILD, str(threads), ','.join(map(str, args.sizes)),
                       env={'TF_ENABLE_ONEDNN_OPTS': onednn})
      for row in rows:
        row.update(onednn=onednn == '1', intra_op_threads=threads or os.cpu_count())
        results.append(row)
        print(f'{onednn:>6s} {row["intra_op_threads"]:7d} {row["size"]:5d} '
              f'{str(row["jit_compile"]):>5s} {row["float32_gflops"]:11.1f} '
              f'{row["bfloat16_gflops"]:12.1f} {row["bf16_speedup"]:8.2f}', flush=True)
  write_json(results, args.out)


if __name__ == '__main__':
  main()
