"""Benchmark: GPipe schedule efficiency and stage-partition balance.

1. Efficiency, side by side in one run: K=2 stages x 4 feed-forward layers
   (width 1024, batch 128, as in the Lingvo peer measurement) on plain CPU devices, intra-op threads 1 and inter-op
   threads K (one worker per stage). For M in {1, 2, 4, 8}: the pipelined forward
   vs the same stages run strictly one micro-batch after another (control
   dependencies); efficiency = measured speedup / (K*M / (M+K-1)). Also the
   pipelined forward+backward at M=1 vs running the layers directly.
2. Balance (max stage FLOPs / (total / K)) of 'balanced' vs 'lingvo' on
   heterogeneous stacks (embedding + blocks of mixed widths + softmax).

    python bench/pipeline.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

K = 2
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(K)

from layout_core import pipeline  # noqa: E402
from layout_core.layers import (Embedding, FeedForward, Sequential,  # noqa: E402
                                Softmax, TransformerBlock, leaf_layers)
from layout_core.mesh import MeshSpec, build_mesh, configure_virtual_cpus  # noqa: E402
from layout_core.variables import to_numpy  # noqa: E402

configure_virtual_cpus(K)


def efficiency(width=1024, batch=128, layers_per_stage=4) -> dict:
  layers = [FeedForward.Params().Set(name=f'fc_{i}', input_dim=width, hidden_dim=width)
            for i in range(K * layers_per_stage)]
  plan = pipeline.partition(layers, num_stages=K, input_shapes=[(batch, width)])
  placement = pipeline.DevicePlacement([f'/CPU:{k}' for k in range(K)])
  x = tf.random.normal([batch, width])
  rows = []
  for m in (1, 2, 4, 8):
    pipe = pipeline.Pipeline(plan, placement=placement, num_micro_batches=m)

    @tf.function
    def pipelined(x, pipe=pipe):
      return tf.reduce_sum(pipe(x))

    @tf.function
    def serial(x, pipe=pipe):
      previous, outputs = None, []
      for micro in pipe.split(x):
        h = micro
        for k, stage in enumerate(pipe.stages):
          with tf.control_dependencies([previous] if previous is not None else []):
            h = placement.run(k, stage, tf.identity(h))
          previous = h
        outputs.append(h)
      return tf.reduce_sum(tf.concat(outputs, axis=0))

    t = timed_alternately({'pipe': lambda f=pipelined: f(x).numpy(),
                           'serial': lambda f=serial: f(x).numpy()})
    t_pipe, t_serial = t['pipe'], t['serial']
    ideal = K * m / (m + K - 1)
    rows.append({'num_micro_batches': m, 'pipelined_s': round(t_pipe, 4),
                 'serial_s': round(t_serial, 4), 'speedup': round(t_serial / t_pipe, 3),
                 'ideal_speedup': round(ideal, 3),
                 'efficiency': round(t_serial / t_pipe / ideal, 3)})

  pipe1 = pipeline.Pipeline(plan, placement=placement, num_micro_batches=1)
  direct = [layer for stage in pipe1.stages for layer in stage.children()]

  @tf.function
  def train_pipelined(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(pipe1(x) ** 2)
    return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, pipe1.trainable_variables)])

  @tf.function
  def train_direct(x):
    with tf.GradientTape() as tape:
      h = x
      for layer in direct:
        h = layer(h)
      loss = tf.reduce_sum(h ** 2)
    return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, pipe1.trainable_variables)])

  t = timed_alternately({'pipe': lambda: train_pipelined(x).numpy(),
                         'direct': lambda: train_direct(x).numpy()})
  t_train_pipe, t_train_direct = t['pipe'], t['direct']
  return {'stages': K, 'width': width, 'batch': batch, 'layers_per_stage': layers_per_stage,
          'forward': rows,
          'train_step_m1_pipelined_s': round(t_train_pipe, 4),
          'train_step_direct_s': round(t_train_direct, 4),
          'train_step_m1_ratio': round(t_train_pipe / t_train_direct, 3)}


def fc_stack(width: int, count: int):
  return Sequential.Params().Set(name='net', sub=[
      FeedForward.Params().Set(name=f'fc_{i}', input_dim=width, hidden_dim=width)
      for i in range(count)])


def staged(params, placement_kind: str, batch: int, width: int):
  """(runners, placement) for K stages of `params` on plain devices or sub-meshes."""
  leaves = leaf_layers(params)
  plan = pipeline.partition([p for _, p in leaves], num_stages=K,
                            input_shapes=[(batch, width)])
  if placement_kind == 'devices':
    placement = pipeline.DevicePlacement([f'/CPU:{k}' for k in range(K)])
    model = params.Instantiate()
  else:
    placement = pipeline.SubMeshPlacement(mesh=build_mesh(MeshSpec(shape={'stage': K})))
    with pipeline.StagedLayoutScope(meshes=placement.meshes, layer_stages=pipeline.layer_stages(
        [path for path, _ in leaves], plan)):
      model = params.Instantiate()
  return pipeline.stage_runners(model, plan), placement


def training(width=1024, batch=128, layers_per_stage=4) -> dict:
  """GPipe training steps (the engine launch.train uses): 'gpipe' vs 'serial'
  schedule, side by side, on plain devices and on DTensor sub-meshes."""
  params = fc_stack(width, K * layers_per_stage)
  x = np.random.RandomState(0).randn(batch, width).astype(np.float32)
  loss_fn = lambda out, target: tf.reduce_mean((out - target) ** 2)
  result = {'stages': K, 'width': width, 'batch': batch,
            'layers_per_stage': layers_per_stage}
  for kind in ('devices', 'sub_meshes'):
    runners, placement = staged(params, kind, batch, width)
    rows = []
    for m in (1, 2, 4, 8):
      micro_x = [placement.put(0, a, batch_dim=0) for a in np.split(x, m)]
      micro_t = [placement.put(K - 1, a, batch_dim=0) for a in np.split(x, m)]
      steps = {}
      for schedule in ('gpipe', 'serial'):
        engine = pipeline.GPipe(stages=runners, placement=placement, loss_fn=loss_fn,
                                num_micro_batches=m, schedule=schedule)

        def step(engine=engine):
          loss, _, norms = engine.loss_and_gradients(micro_x, micro_t)
          return to_numpy(loss) + sum(to_numpy(n) for n in norms)
        steps[schedule] = step
      times = timed_alternately(steps)
      ideal = K * m / (m + K - 1)
      speedup = times['serial'] / times['gpipe']
      row = {'num_micro_batches': m, 'gpipe_s': round(times['gpipe'], 4),
             'serial_s': round(times['serial'], 4), 'speedup': round(speedup, 3),
             'ideal_speedup': round(ideal, 3), 'efficiency': round(speedup / ideal, 3),
             'bubble_fraction_theory': round((K - 1) / (m + K - 1), 3),
             # idle share of the K stages over a step: 1 - serial work / (K x step time)
             'bubble_fraction_measured': round(1 - times['serial'] / (K * times['gpipe']), 3)}
      rows.append(row)
    result[kind] = rows
  return result


def timed_alternately(fns: dict, repeats: int = 9) -> dict:
  """Median seconds of each function, timed in turns so drift hits all alike."""
  for fn in fns.values():
    fn()  # trace
  samples = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      fn()
      samples[name].append(time.perf_counter() - start)
  return {name: statistics.median(values) for name, values in samples.items()}


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
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default=os.path.join(os.path.dirname(__file__), 'results',
                                                    'pipeline.json'))
  args = parser.parse_args()
  results = {'efficiency': efficiency(), 'training': training(), 'balance': balance()}
  e = results['efficiency']
  print(f'GPipe forward, K={K}, {e["layers_per_stage"]} x FC-{e["width"]} per stage, '
        f'batch {e["batch"]}, intra-op 1 / inter-op {K} threads')
  print('   M   pipelined   serial   speedup   ideal   efficiency')
  for r in e['forward']:
    print(f'  {r["num_micro_batches"]:2d}   {r["pipelined_s"]*1000:7.1f}ms {r["serial_s"]*1000:7.1f}ms'
          f'   {r["speedup"]:6.2f}x  {r["ideal_speedup"]:5.2f}x   {r["efficiency"]:6.3f}')
  print(f'train step (fwd+bwd) at M=1: pipelined {e["train_step_m1_pipelined_s"]*1000:.1f} ms vs '
        f'direct {e["train_step_direct_s"]*1000:.1f} ms ({e["train_step_m1_ratio"]:.3f}x)')
  t = results['training']
  for kind in ('devices', 'sub_meshes'):
    print(f'GPipe training step (engine of launch.train), K={K}, {t["layers_per_stage"]} x '
          f'FC-{t["width"]} per stage, batch {t["batch"]}, on {kind}; efficiency = '
          'speedup over the serial schedule / ideal; bubble measured = 1 - serial / (K x time)')
    for r in t[kind]:
      parts = [f'M={r["num_micro_batches"]}: serial {r["serial_s"]*1000:6.1f}ms',
               f'gpipe {r["gpipe_s"]*1000:6.1f}ms', f'speedup {r["speedup"]:.2f}x',
               f'(ideal {r["ideal_speedup"]:.2f}x)', f'efficiency {r["efficiency"]:.3f}',
               f'bubble {r["bubble_fraction_measured"]:.3f}',
               f'(theory {r["bubble_fraction_theory"]:.3f})']
      print('  ' + '  '.join(parts))
  print('Partition balance (max stage / mean; 1.0 is perfect):')
  for r in results['balance']:
    print(f'  {r["stack"]:18s} K={r["stages"]}: balanced {r["balanced"]:.3f}  lingvo '
          f'{r["lingvo"]:.3f}  (lingvo empty stages: {r["lingvo_empty_stages"]})')
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, 'w') as f:
    json.dump(results, f, indent=2)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
