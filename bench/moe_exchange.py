r"""Which collectives DTensor runs to move an MoE layer's tokens to their experts and back.

The dispatch buffer of a routed layer (`layout_core.model.moe`) is
[G rows, E experts, C slots, D]: made where the rows live (split over the
batch axis), then relaid so that each device holds its experts' slots. Two
exchanges, each forward and back, on 8 virtual CPU devices:

  * `same axis` (GShard, mesh data=8, the experts split over the batch's own
    axis): [data, U, U, U] -> [U, data, U, U] and back;
  * `two axes` (mesh expert=4 x data=2, the batch on 'data', the experts on
    'expert'): [data, U, U, U] -> [data, expert, U, U], then the combine
    einsum contracting the experts ('gsec,gecd->gsd') back to the rows.

Each runs once compiled under a profiler trace, forward alone and with the
gradients of the buffer, the combine weights and the experts' own weights
(split as the experts are: a training step's backward); the ops the trace names are counted by kind (an all-to-all,
all-gather, all-reduce, collective, or a local split), with the forward's
seconds per call (median of `--calls`) and the values and gradients checked
against the same math in numpy.

    python bench/moe_exchange.py [--rows 16 --slots 64 --dim 256] [--out bench/results/moe_exchange.json]

Measured (2-core x86, TF 2.21; bench/results/moe_exchange.json): see docs/limits.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import read_trace, write_json  # noqa: E402

KERNEL = re.compile(r':(Collective\w+)$')  # '<node>:<kernel>' events of collective kernels


def traced_ops(logdir: str, devices: int) -> dict[str, float]:
  """The collective kernels the trace ran, per device: {'CollectiveAllToAllV2':
  2.0, ...}; a split of a replicated tensor runs none."""
  counts = collections.Counter()
  for plane in read_trace(logdir).planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    for line in plane.lines:
      for event in line.events:
        found = KERNEL.search(names.get(event.metadata_id, ''))
        if found:
          counts[found.group(1)] += 1
  return {name: n / devices for name, n in sorted(counts.items())}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--experts', type=int, default=8)
  parser.add_argument('--rows', type=int, default=16)
  parser.add_argument('--slots', type=int, default=64)
  parser.add_argument('--dim', type=int, default=256)
  parser.add_argument('--calls', type=int, default=9)
  parser.add_argument('--out', default=os.path.join(REPO_ROOT, 'bench', 'results',
                                                    'moe_exchange.json'))
  args = parser.parse_args()
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tensorflow.experimental import dtensor  # pylint: disable=import-outside-toplevel
  from layout_core import tf_internals  # pylint: disable=import-outside-toplevel
  from layout_core.layout.mesh import (MeshSpec, build_mesh,  # pylint: disable=import-outside-toplevel
                                       configure_virtual_cpus, pack_global_array)
  from layout_core.layout.variables import to_numpy  # pylint: disable=import-outside-toplevel
  configure_virtual_cpus(8)
  tf_internals.lower_gathers_once(False, reason='bench/moe_exchange.py builds two meshes')
  u = dtensor.UNSHARDED
  e, g, c, d = args.experts, args.rows, args.slots, args.dim
  rng = np.random.default_rng(0)
  buffer = rng.normal(size=(g, e, c, d)).astype(np.float32)
  combine = (rng.random((g, 3, e, c)) < 0.05).astype(np.float32)   # [G, S=3, E, C]
  upstream = rng.normal(size=(g, 3, d)).astype(np.float32)         # the output's gradient
  scale = rng.normal(size=(e, d)).astype(np.float32)               # each expert's own weight
  expected = np.einsum('gsec,gecd->gsd', combine, buffer * scale[None, :, None])
  back = np.einsum('gsec,gsd->gecd', combine, upstream)             # the experts' outputs'
  expected_grads = (back * scale[None, :, None],
                    np.einsum('gsd,gecd->gsec', upstream, buffer * scale[None, :, None]),
                    np.einsum('gecd,gecd->ed', back, buffer))

  cases = {}
  for name, shape, expert_axis in (('same axis', {'data': 8}, 'data'),
                                   ('two axes', {'expert': 4, 'data': 2}, 'expert')):
    mesh = build_mesh(MeshSpec(shape=shape))
    rows = dtensor.Layout(['data', u, u, u], mesh)
    at_experts = dtensor.Layout([u if expert_axis == 'data' else 'data', expert_axis, u, u],
                                mesh)
    x = pack_global_array(buffer, rows)
    weights = pack_global_array(combine, dtensor.Layout(['data', u, u, u], mesh))
    up = pack_global_array(upstream, dtensor.Layout(['data', u, u], mesh))
    w = pack_global_array(scale, dtensor.Layout([expert_axis, u], mesh))  # split as experts

    def math(x, weights, w, at_experts=at_experts, rows=rows, expert_axis=expert_axis):
      h = tf.einsum('gecd,ed->gecd', dtensor.relayout(x, at_experts), w)  # to the experts
      if expert_axis == 'data':
        h = dtensor.relayout(h, rows)                     # back by the inverse exchange
      return tf.einsum('gsec,gecd->gsd', weights, h)     # combine (sums over the experts)

    exchange = tf.function(lambda x=x, weights=weights, w=w, math=math: math(x, weights, w))

    @tf.function
    def with_backward(x=x, weights=weights, w=w, up=up, math=math):
      with tf.GradientTape() as tape:
        tape.watch([x, weights, w])
        y = math(x, weights, w)
        loss = tf.reduce_sum(y * up)
      return tape.gradient(loss, [x, weights, w]), loss   # a step's loss: its forward runs

    np.testing.assert_allclose(to_numpy(exchange()), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(with_backward()[0], expected_grads):  # sums of 256: float32's error
      np.testing.assert_allclose(to_numpy(got), want, rtol=1e-5,
                                 atol=1e-5 * float(np.abs(want).max()))
    found = {}
    for label, fn in (('ops', exchange), ('ops_with_backward', with_backward)):
      with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        dtensor.unpack(tf.nest.flatten(fn())[0])[0].numpy()
        tf.profiler.experimental.stop()
        found[label] = traced_ops(logdir, devices=8)
    seconds = []
    for _ in range(args.calls):
      start = time.perf_counter()
      dtensor.unpack(exchange())[0].numpy()
      seconds.append(time.perf_counter() - start)
    cases[name] = {'mesh': shape, **found, 'seconds_per_call': statistics.median(seconds)}
    print(f"{name:10s} {shape}: {statistics.median(seconds) * 1e3:.1f} ms/call; forward "
          f"{found['ops']}; forward and backward {found['ops_with_backward']}")
  write_json({'experts': e, 'rows': g, 'slots': c, 'dim': d, 'buffer_bytes': buffer.nbytes,
              'cases': cases}, args.out)


if __name__ == '__main__':
  main()
