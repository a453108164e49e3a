r"""FSDP's gather and gradient sum on CPU: DTensor's collectives vs meshgin's all-to-alls.

One weight [D, F], stored split over 'data' (8 virtual CPU devices), used in
`x @ w` for x [B, T, D] split over the batch, bfloat16 math; the gradients
function (forward, backward, the weight's gradient back in its split layout)
is run both ways in this process:

  * `dtensor`: the weight gathered with a relayout to its use layout
    (`fsdp.gather`), its gradient relaid back (DTensor fuses the batch's sum
    and the split into a reduce-scatter);
  * `per_replica`: the weight as one copy per replica (`fsdp.per_replica`,
    an all-to-all of the compute dtype) used by `fsdp.replica_einsum`, whose
    gradient stays on each replica and comes back by the inverse all-to-all
    and a local float32 sum: what `train.fsdp` runs.

Measured per way, compiled as the engine compiles FSDP's gradients function
(this process's first mesh has one axis, so `build_mesh` chose the
CollectiveGatherV2 lowering): the bytes made during one call and live at
the CPU allocator's peak in it (TensorFlow's profiler, `bench/peak_breakdown.py`'s
`breakdown`), also in units of the whole weight in bfloat16, the ops that
made them, and seconds per call (median of `--calls`), side by side; and
that both give the same gradient.

    python bench/fsdp_collectives.py [--dim 2048 --ffn 8192] [--out bench/results/fsdp_collectives.json]

Measured (D 2048, F 8192, B 64, T 16, 2-core x86; bench/results/fsdp_collectives.json):
the same gradient both ways. DTensor's way leaves 960 MiB made in the call
live at its peak (30 whole bfloat16 weights): its reduce-scatter runs as a
float32 all-reduce of the whole weight on every device (8 x 64 MiB) plus
the ring's chunks (448 MiB), with bfloat16 gradients too. The all-to-alls
leave 536 MiB (16.8): bfloat16 moved, one whole bfloat16 copy per device.
Seconds per call 0.537 vs 0.500 (0.93x) for this one weight; in the whole
LM step the all-to-alls were faster (bench/step.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import RESULTS, write_json  # noqa: E402
from bench.peak_breakdown import live_at_peak  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--dim', type=int, default=2048)
  parser.add_argument('--ffn', type=int, default=8192)
  parser.add_argument('--batch', type=int, default=64)
  parser.add_argument('--time', type=int, default=16)
  parser.add_argument('--calls', type=int, default=9)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'fsdp_collectives.json'))
  args = parser.parse_args()
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  from layout_core.layout import fsdp  # pylint: disable=import-outside-toplevel
  from layout_core.layout.mesh import MeshSpec, build_mesh  # pylint: disable=import-outside-toplevel
  from layout_core.layout.variables import to_numpy  # pylint: disable=import-outside-toplevel
  tf.config.set_logical_device_configuration(
      tf.config.list_physical_devices('CPU')[0], [tf.config.LogicalDeviceConfiguration()] * 8)
  mesh = build_mesh(MeshSpec(shape={'data': 8}))
  unsharded = dtensor.UNSHARDED
  d, f, b, t = args.dim, args.ffn, args.batch, args.time
  stored = dtensor.Layout(['data', unsharded], mesh)
  use = dtensor.Layout.replicated(mesh, 2)
  rng = np.random.default_rng(0)
  w = dtensor.DVariable(dtensor.relayout(dtensor.copy_to_mesh(
      tf.constant(rng.normal(0, 0.02, (d, f)), tf.float32), use), stored))
  fsdp.set_use_layout(w, use)
  x = dtensor.relayout(dtensor.copy_to_mesh(
      tf.constant(rng.normal(0, 1, (b, t, d)), tf.bfloat16), dtensor.Layout.replicated(mesh, 3)),
      dtensor.Layout(['data', unsharded, unsharded], mesh))

  def loss_of(y):
    return tf.reduce_sum(tf.square(tf.cast(y, tf.float32)))

  def dtensor_way():
    return tf.einsum('btd,df->btf', x, fsdp.gather(w, to=use, stored=stored,
                                                   dtype=tf.bfloat16))

  def per_replica_way():
    replicas = fsdp.per_replica(w, tf.bfloat16, axis='data')
    return fsdp.replica_einsum('btd,df->btf', fsdp.as_rows(x, 8), w, replicas, axis='data')

  whole = d * f * 2
  results, gradients, functions = {}, {}, {}
  for name, forward in (('dtensor', dtensor_way), ('per_replica', per_replica_way)):
    @tf.function
    def gradient(forward=forward):
      with tf.GradientTape() as tape:
        loss = loss_of(forward())
      return tape.gradient(loss, w)
    grad = gradient()
    functions[name], gradients[name] = gradient, to_numpy(grad)
    # One slice fetched: to_numpy would gather it.
    found = live_at_peak(lambda: dtensor.unpack(gradient())[0].numpy(), min_bytes=2**20)
    results[name] = {
        'gradient_layout': list(dtensor.fetch_layout(grad).sharding_specs),
        'peak_bytes': found['made_in_call_live_at_peak_bytes'],
        'peak_in_whole_bf16_weights': found['made_in_call_live_at_peak_bytes'] / whole,
        'live_at_peak_by_op': {row['op'].split('/')[-1]: row for row in found['by_op'][:4]}}
  seconds = {name: [] for name in functions}
  for _ in range(args.calls):  # in turns, so both see the same machine
    for name, gradient in functions.items():
      start = time.perf_counter()
      dtensor.unpack(gradient())[0].numpy()
      seconds[name].append(time.perf_counter() - start)
  for name, result in results.items():
    result['seconds_per_call'] = statistics.median(seconds[name])
    print(f"{name:12s} made in the call, live at its peak {result['peak_bytes'] / 2**20:7.1f} "
          f"MiB = {result['peak_in_whole_bf16_weights']:4.1f} whole bf16 weights; "
          f"{result['seconds_per_call']:.3f} s/call; gradient layout {result['gradient_layout']}")
    for op, row in result['live_at_peak_by_op'].items():
      print(f"    {row['bytes'] / 2**20:7.1f} MiB  {op[-60:]}  {row['tensors']}")
  same = bool(np.array_equal(gradients['dtensor'], gradients['per_replica']))
  ratio = results['per_replica']['peak_bytes'] / results['dtensor']['peak_bytes']
  speed = results['dtensor']['seconds_per_call'] / results['per_replica']['seconds_per_call']
  print(f'per_replica / dtensor: peak {ratio:.2f}x, speed {speed:.2f}x; '
        f'same gradient: {same}')
  write_json({'dim': d, 'ffn': f, 'batch': b, 'time': t, 'devices': 8,
              'whole_bf16_weight_bytes': whole, 'ways': results,
              'peak_ratio_per_replica_vs_dtensor': ratio,
              'speed_ratio_per_replica_vs_dtensor': speed,
              'same_gradient': same}, args.out)


if __name__ == '__main__':
  main()
