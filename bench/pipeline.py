"""Benchmark: pipelined training steps on DTensor, SPMD vs sub-mesh vs serial.

Side by side in one run (timed in turns, so load drift hits all alike), for S
stages with one CPU device each (intra-op threads 1, inter-op threads S), a
stack of 8 identical feed-forward cells (FC-`width`, batch `batch`), the
training step's loss and gradients (no optimizer update) of:

* serial: the same cells, unpipelined, on one device (the reference);
* submesh: the GPipe engine (`pipeline.engine='submesh'`) on S sub-meshes;
* spmd: the SPMD stage-axis engine (`pipeline.engine='spmd'`) on one
  {'stage': S} mesh, with R circular repeats.

For S in {2, 4}, M in {1, 2, 4, 8}, R in {1, 2} (R = 2 needs M >= S):
speedup = serial / engine; ideal = S * R*M / (R*M + S - 1) (S stages busy
except the bubble); efficiency = speedup / ideal; measured bubble = 1 - serial
/ (S x engine time), vs theory (S-1) / (R*M + S-1). Also the partition
balance of 'balanced' vs 'lingvo' cuts on heterogeneous stacks.

    python bench/pipeline.py [--stages 2 4] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import timed_alternately, write_json  # noqa: E402


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--stages', type=int, nargs='+', default=[2, 4])
  parser.add_argument('--micro', type=int, nargs='+', default=[1, 2, 4, 8])
  parser.add_argument('--width', type=int, default=512)
  parser.add_argument('--batch', type=int, default=128)
  parser.add_argument('--repeats', type=int, default=5, help='timed runs per engine')
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                    'pipeline.json'))
  return parser.parse_args()


ARGS = parse_args()
MAX_STAGES = max(ARGS.stages)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(MAX_STAGES)

from tensorflow.experimental import dtensor  # noqa: E402

from layout_core import pipeline  # noqa: E402
from layout_core.model.base import Sequential  # noqa: E402
from layout_core.model.layers import (Embedding, FeedForward, Softmax,  # noqa: E402
                                      TransformerBlock)
from layout_core.layout.mesh import MeshSpec, build_mesh, configure_virtual_cpus  # noqa: E402
from layout_core.layout.mesh import pack_global_array  # noqa: E402
from layout_core.pipeline.spmd import SpmdPipeline, StackedCells  # noqa: E402
from layout_core.layout.variables import to_numpy  # noqa: E402

configure_virtual_cpus(MAX_STAGES)
NUM_CELLS = 8


def cells(width: int) -> list:
  return [FeedForward.Params().Set(name=f'fc_{i:03d}', input_dim=width, hidden_dim=width)
          for i in range(NUM_CELLS)]


def mse(out, target):
  return tf.reduce_mean((out - target) ** 2)


def serial_step(width: int, x: np.ndarray):
  """The unpipelined cells on one plain device: loss and gradients."""
  with tf.device('/CPU:0'):
    model = Sequential.Params().Set(name='net', sub=cells(width)).Instantiate()
    x_t, target = tf.constant(x), tf.constant(x)

  @tf.function
  def step():
    with tf.device('/CPU:0'):
      with tf.GradientTape() as tape:
        loss = mse(model(x_t), target)
      grads = tape.gradient(loss, model.trainable_variables)
      return loss + tf.add_n([tf.reduce_sum(g) for g in grads]) * 0.0
  return lambda: float(step())


def submesh_step(stages: int, micro: int, width: int, x: np.ndarray):
  params = Sequential.Params().Set(name='net', sub=cells(width))
  staged = pipeline.build_staged_model(
      params, mesh=build_mesh(MeshSpec(shape={'stage': stages})), rules=None,
      num_stages=stages, input_shapes=[(x.shape[0] // micro, width)], method='balanced')
  gpipe = pipeline.GPipe(stages=staged.runners, placement=staged.placement, loss_fn=mse,
                         num_micro_batches=micro)
  place = staged.placement
  micro_x = [place.put(0, a, batch_dim=0) for a in np.split(x, micro)]
  micro_t = [place.put(stages - 1, a, batch_dim=0) for a in np.split(x, micro)]

  def step():
    loss, _, norms = gpipe.loss_and_gradients(micro_x, micro_t)
    return float(to_numpy(loss)) + sum(float(to_numpy(n)) for n in norms) * 0.0
  return step


def spmd_step(stages: int, micro: int, repeats: int, width: int, x: np.ndarray):
  mesh = build_mesh(MeshSpec(shape={'stage': stages}))
  stack = StackedCells(cells(width), parent_path='net', mesh=mesh, rules=None,
                       num_stages=stages, repeats=repeats, batch_axis='')
  engine = SpmdPipeline(stack, num_micro_batches=micro)
  layout = dtensor.Layout([dtensor.UNSHARDED] * 3, mesh)
  micro_x = pack_global_array(x.reshape((micro, -1, width)), layout)
  variables = list(stack.stacked_variables.values())

  @tf.function
  def step(micro_x):
    with tf.GradientTape() as tape:
      xs = [tf.gather(micro_x, m) for m in range(micro)]  # not micro_x[m]: see spmd.py
      outputs = engine(xs)
      loss = tf.add_n([mse(y, xs[m]) for m, y in enumerate(outputs)]) / micro
    grads = tape.gradient(loss, variables)
    return loss + tf.add_n([tf.reduce_sum(g) for g in grads]) * 0.0
  return lambda: float(to_numpy(step(micro_x)))


def training(stages: int) -> list[dict]:
  x = np.random.RandomState(0).randn(ARGS.batch, ARGS.width).astype(np.float32)
  rows = []
  serial = serial_step(ARGS.width, x)
  for micro in ARGS.micro:
    fns = {'serial': serial, 'submesh': submesh_step(stages, micro, ARGS.width, x)}
    for repeats in (1, 2):
      if repeats == 1 or micro >= stages:
        fns[f'spmd_r{repeats}'] = spmd_step(stages, micro, repeats, ARGS.width, x)
    values = {name: fn() for name, fn in fns.items()}
    for name, value in values.items():  # all engines compute the same loss
      assert abs(value - values['serial']) <= 1e-4 * abs(values['serial']), (name, values)
    start = time.perf_counter()
    times = timed_alternately(fns, ARGS.repeats)
    for name, seconds in times.items():
      if name == 'serial':
        continue
      repeats = int(name[-1]) if name.startswith('spmd') else 1
      ideal = stages * repeats * micro / (repeats * micro + stages - 1)
      speedup = times['serial'] / seconds
      rows.append({
          'stages': stages, 'num_micro_batches': micro, 'engine': name.split('_')[0],
          'circular_repeats': repeats, 'seconds': round(seconds, 4),
          'serial_seconds': round(times['serial'], 4), 'speedup': round(speedup, 3),
          'ideal_speedup': round(ideal, 3), 'efficiency': round(speedup / ideal, 3),
          'bubble_theory': round((stages - 1) / (repeats * micro + stages - 1), 3),
          'bubble_measured': round(1 - times['serial'] / (stages * seconds), 3)})
      r = rows[-1]
      print(f'  S={stages} M={micro} {name:8s} {seconds * 1000:8.1f} ms  serial '
            f'{times["serial"] * 1000:7.1f} ms  speedup {speedup:5.2f}x (ideal {ideal:4.2f}x)'
            f'  efficiency {r["efficiency"]:5.3f}  bubble {r["bubble_measured"]:6.3f} '
            f'(theory {r["bubble_theory"]:.3f})', flush=True)
    print(f'    [{time.perf_counter() - start:.0f} s timing]', flush=True)
  return rows


def stacks():
  def block(name, ffn):
    return TransformerBlock.Params().Set(name=name, model_dim=256, num_heads=4, ffn_dim=ffn)
  emb = Embedding.Params().Set(vocab_size=32000, dim=256, max_len=128)
  soft = Softmax.Params().Set(input_dim=256, num_classes=32000)
  return {
      'uniform_8_blocks': [block(f'b{i}', 1024) for i in range(8)],
      'lm_mixed_widths': [emb] + [block(f'b{i}', w) for i, w in
                                  enumerate([256, 4096, 512, 2048, 1024, 8192])] + [soft],
      'lm_heavy_softmax': [emb] + [block(f'b{i}', 512) for i in range(4)] + [soft],
      'skewed_tail': [block(f'b{i}', w) for i, w in enumerate([64, 64, 64, 16384])],
  }


def runtime_limits(stages: int, rows: int) -> dict:
  """What DTensor on this machine allows any pipeline engine, measured with no
  pipeline at all (each a chain of 8 dependent steps in one tf.function):

  * stage_concurrency: the same chain of FC layers on every stage's device
    at once (one einsum over a stage-sharded [S, rows, width] stack), over
    the chain on one device: 1.0 if the S devices compute at the same time,
    S if they take turns. No engine can beat `serial` by more than
    S / stage_concurrency.
  * shift_ms: one pipeline shift (the SPMD engine's per-clock all-reduce of the
    [S, rows, width] buffer over `stage`), for a one-element and for a real
    micro-batch buffer; op_ms: one elementwise op on a stage-sharded tensor.
  """
  mesh = build_mesh(MeshSpec(shape={'stage': stages}))
  width, depth = ARGS.width, 8
  sharded = lambda rank: dtensor.Layout(['stage'] + [dtensor.UNSHARDED] * (rank - 1), mesh)
  rng = np.random.RandomState(1)
  x = rng.randn(stages, rows, width).astype(np.float32)
  w = (rng.randn(stages, width, width) * width ** -0.5).astype(np.float32)
  shift = pack_global_array(np.eye(stages, k=-1).astype(np.float32),
                            dtensor.Layout.replicated(mesh, 2))

  @tf.function
  def on_all_stages(x, w):
    for _ in range(depth):
      x = tf.nn.relu(tf.einsum('sbd,sde->sbe', x, w))
    return x

  @tf.function
  def on_one_device(x, w):
    with tf.device('/CPU:0'):
      for _ in range(depth):
        x = tf.nn.relu(x @ w)
      return x

  @tf.function
  def shifts(x):
    for _ in range(depth):
      x = dtensor.relayout(tf.einsum('us,sbd->ubd', shift, x), sharded(3)) + 1.0
    return x

  @tf.function
  def local_ops(x):
    for _ in range(depth):
      x = x * 1.0001
    return x

  with tf.device('/CPU:0'):
    x0, w0 = tf.constant(x[0]), tf.constant(w[0])
  xs, ws = pack_global_array(x, sharded(3)), pack_global_array(w, sharded(3))
  tiny = pack_global_array(np.ones((stages, 1, 1), np.float32), sharded(3))

  def run(fn, *args):
    return lambda: to_numpy(fn(*args))
  times = timed_alternately({'all': run(on_all_stages, xs, ws), 'one': run(on_one_device, x0, w0),
                             'shift': run(shifts, xs), 'shift_tiny': run(shifts, tiny),
                             'op': run(local_ops, xs)}, ARGS.repeats * 4)
  result = {'stages': stages, 'rows': rows, 'width': width,
            'stage_concurrency': round(times['all'] / times['one'], 2),
            'max_speedup_any_engine': round(stages * times['one'] / times['all'], 2),
            'fc_layer_ms': round(times['one'] / depth * 1000, 3),
            'shift_ms': round(times['shift'] / depth * 1000, 3),
            'shift_tiny_ms': round(times['shift_tiny'] / depth * 1000, 3),
            'op_ms': round(times['op'] / depth * 1000, 3)}
  print(f'  S={stages}: {depth} FC-{width} layers on [{rows}, {width}] on all {stages} stage '
        f'devices at once take {result["stage_concurrency"]:.2f}x the time on one (1.0 = '
        f'concurrent, {stages} = in turns): no engine can beat serial by more than '
        f'{result["max_speedup_any_engine"]:.2f}x here. One FC layer {result["fc_layer_ms"]:.2f} '
        f'ms; one shift {result["shift_ms"]:.2f} ms ({result["shift_tiny_ms"]:.2f} ms for one '
        f'element); one elementwise op {result["op_ms"]:.3f} ms', flush=True)
  return result


def balance() -> list[dict]:
  rows = []
  for name, layers in stacks().items():
    for k in (2, 4):
      if k > len(layers):
        continue
      plans = {m: pipeline.partition(layers, num_stages=k, input_shapes=[(8, 128)]
                                     if layers[0].cls is Embedding else [(8, 128, 256)],
                                     method=m) for m in ('balanced', 'lingvo')}
      rows.append({'stack': name, 'stages': k,
                   'balanced': round(plans['balanced'].balance, 3),
                   'lingvo': round(plans['lingvo'].balance, 3),
                   'lingvo_empty_stages': sum(not s.layers for s in plans['lingvo'].stages)})
  return rows


def main() -> None:
  began = time.perf_counter()
  load = os.getloadavg()
  print(f'Training step (loss + gradients), {NUM_CELLS} x FC-{ARGS.width} cells, batch '
        f'{ARGS.batch}, one CPU device per stage, intra-op 1 / inter-op {MAX_STAGES} '
        f'threads, {ARGS.repeats} timed runs each (median); load average {load[0]:.1f} '
        f'on {os.cpu_count()} cores', flush=True)
  rows, limits = [], []
  for stages in ARGS.stages:
    rows += training(stages)
  print('What the runtime allows (no pipeline; rows of a micro-batch at M=8, and M=1):')
  for stages in ARGS.stages:
    for rows in (ARGS.batch // 8, ARGS.batch):
      limits.append(runtime_limits(stages, rows))
  results = {'setup': {'cells': NUM_CELLS, 'width': ARGS.width, 'batch': ARGS.batch,
                       'repeats': ARGS.repeats, 'cpu_count': os.cpu_count(),
                       'load_average_start': round(load[0], 1),
                       'load_average_end': round(os.getloadavg()[0], 1)},
             'training': rows, 'runtime_limits': limits, 'balance': balance()}
  print('Partition balance (max stage / mean; 1.0 is perfect):')
  for r in results['balance']:
    print(f'  {r["stack"]:18s} K={r["stages"]}: balanced {r["balanced"]:.3f}  lingvo '
          f'{r["lingvo"]:.3f}  (lingvo empty stages: {r["lingvo_empty_stages"]})')
  os.makedirs(os.path.dirname(ARGS.out), exist_ok=True)
  write_json(results, ARGS.out)
  print(f'wrote {ARGS.out} in {time.perf_counter() - began:.0f} s')


if __name__ == '__main__':
  main()
