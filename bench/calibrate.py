r"""Calibration: the rates the layout suggester's cost model divides by, measured here.

On this machine's 8 virtual CPU devices (meshgin's thread settings), every
device busy at once, in one fresh process:

  * matmul FLOP/s per device, float32 and bfloat16, at four sizes (a chain
    of dependent [rows, k] @ [k, k] per device, rows split over data=8);
  * elementwise element-ops/s per device (a chain of x * y + z on tensors);
  * collectives over a mesh axis of 2, 4 and 8 devices at three message sizes,
    fitted to latency + bytes / bandwidth: all-reduce (a matmul whose
    contracted dim is split: the partial sums reduced) and all-gather (a
    split tensor relaid out replicated);

then, from real `launch.train` steps (subprocesses): the fixed costs of a
step's structure, from tiny LMs under each engine and split (`fixed_costs`),
and what the micro-benchmarks miss, from a matmul-heavy LM
(`step_efficiency`). Cross-host collectives are not measured (one host): a nominal 1 GB/s.

    python bench/calibrate.py [--out bench/results/calibration.json]

The cost model reads the file (`layout_core/suggest/calibration.py`) and says
when it is stale (another processor, core count or TensorFlow, or 90 days).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import RESULTS, provenance, run_child, write_json  # noqa: E402

CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from layout_core.layout.mesh import configure_virtual_cpus
N = configure_virtual_cpus(8)
devices = [f'/job:localhost/replica:0/task:0/device:CPU:{i}' for i in range(N)]
U = dtensor.UNSHARDED

def mesh(shape):
  return dtensor.create_mesh(list(shape.items()), devices=devices, device_type='CPU')

def timed(fn, *args, reps=20):
  for _ in range(3):
    out = fn(*args)
  _ = [dtensor.unpack(o) for o in (out if isinstance(out, (list, tuple)) else [out])]
  best = 1e9
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    for o in (out if isinstance(out, (list, tuple)) else [out]):
      [t.numpy() for t in dtensor.unpack(o)]
    best = min(best, (time.perf_counter() - start) / reps)
  return best

result = {'matmul': {}, 'elementwise': {}, 'collectives': {'all_reduce': {}, 'all_gather': {}}}
data8 = mesh({'data': N})
for dtype in ('float32', 'bfloat16'):
  rows = []
  for r, k in ((64, 128), (256, 256), (256, 512), (512, 1024)):
    n = k
    x = dtensor.call_with_layout(tf.fill, dtensor.Layout(['data', U], data8), [N * r, k],
                                 tf.constant(0.01, dtype))
    w = dtensor.call_with_layout(tf.fill, dtensor.Layout([U, U], data8), [k, n],
                                 tf.constant(0.01, dtype))
    def chain(x, w):  # dependent, so that nothing is computed once for four
      for _ in range(4):
        x = tf.matmul(x, w)
      return x
    chain = tf.function(chain)
    seconds = timed(chain, x, w, reps=5) / 4
    flops = 2.0 * r * k * n
    rows.append((flops, flops / seconds))
  result['matmul'][dtype] = rows
  size = 1 << 18
  x = dtensor.call_with_layout(tf.fill, dtensor.Layout(['data'], data8), [N * size],
                               tf.constant(0.5, dtype))
  def axpy(x, y, z):  # tensors, not constants: nothing for grappler to fold
    for _ in range(8):
      x = x * y + z
    return x
  seconds = timed(tf.function(axpy), x, x, x, reps=10)
  result['elementwise'][dtype] = 16 * size / seconds

for k in (2, 4, 8):
  m = mesh({'a': k, 'b': N // k})
  for kind in ('all_reduce', 'all_gather'):
    points = []
    for nbytes in (1 << 14, 1 << 18, 1 << 22):
      elements = nbytes // 4
      if kind == 'all_reduce':  # [rows, k] @ [k, cols], contracted dim split over 'a'
        cols = 256
        rows = max(elements // cols, 1)
        x = dtensor.call_with_layout(lambda: tf.ones([rows, k]), dtensor.Layout([U, 'a'], m))
        w = dtensor.call_with_layout(lambda: tf.ones([k, cols]), dtensor.Layout(['a', U], m))
        fn = tf.function(lambda x, w: tf.matmul(x, w))
        seconds = timed(fn, x, w)
        moved = rows * cols * 4
      else:  # [k * e] split over 'a' -> replicated
        x = dtensor.call_with_layout(lambda: tf.ones([k * (elements // k)]),
                                     dtensor.Layout(['a'], m))
        fn = tf.function(lambda x: dtensor.relayout(x, dtensor.Layout([U], m)) * 1.0)
        seconds = timed(fn, x)
        moved = (elements // k) * 4 * k
      points.append((moved, seconds))
    xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
    slope, intercept = np.polyfit(xs, ys, 1)
    result['collectives'][kind][k] = {'latency_s': max(float(intercept), 1e-6),
                                      'bytes_per_s': float(1.0 / max(slope, 1e-15)),
                                      'points': points}
print('RESULT ' + json.dumps(result))
'''

ENV = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='2')
STEP_LINE = re.compile(r'step (\d+)/\d+ .* ([\d.]+) steps/s')


def train_step_seconds(bindings: list[str], *, steps: int = 12, runs: int = 3) -> float:
  """Seconds per step of `launch.train` runs: the median over `runs` fresh
  processes of each one's median after its first 4 steps (one process's
  figure varies by 10-15% from run to run: a single run doubled a fixed
  cost between two calibrations)."""
  return statistics.median(_one_run_step_seconds(bindings, steps=steps) for _ in range(runs))


def _one_run_step_seconds(bindings: list[str], *, steps: int) -> float:
  model_dir = tempfile.mkdtemp(prefix='meshgin_calibrate_')
  args = [sys.executable, '-m', 'launch.train', f'--model_dir={model_dir}',
          '--gin_file=configs/experiments/quickstart.gin',
          *[f'--gin_bindings={b}' for b in bindings + [
              f'train.num_steps = {steps}', 'train.log_every = 1', 'train.eval_every = 0',
              'train.eval_batches = 1', 'checkpoint.every_steps = 0',
              'checkpoint.save_at_end = False']]]
  done = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, check=False)
  rates = [float(m.group(2)) for m in STEP_LINE.finditer(done.stderr)
           if int(m.group(1)) > 4]
  if done.returncode or not rates:
    raise RuntimeError(f'calibration run failed: {done.stderr[-2000:]}')
  return statistics.median(1.0 / r for r in rates)


TINY = ['transformer_lm.model_dim = 16', 'transformer_lm.num_heads = 8',
        'transformer_lm.ffn_dim = 16', 'transformer_lm.num_layers = 4',
        'optimizer.shard_state = False', 'layout_rules.rules = []']


def fixed_costs() -> dict:
  """The fixed costs of a step, from tiny LMs (width 16, 8 heads: their FLOPs
  and bytes are negligible, so what they take is what the layout's structure
  costs), each a residual of one run against data=8 with 4 blocks:

    * per block run and device it spans, per engine: without a pipeline, 4
      blocks minus 1 block, over 3 x 8 (the rest of a 1-block step is the
      step's own cost: input, embedding, softmax, loss, dispatch); the
      sub-mesh engine's (stage=2 x data=4, 4 micro-batches: each block runs
      once per micro-batch on 4 devices; its shifts included); the SPMD
      engine's per stacked cell run, and per tick (the same mesh: 5 ticks of
      2 cells, and with 2 circular repeats 9 ticks of 1);
    * per tensor-parallel all-reduce, for model axes of 2, 4 and 8 (data x
      model = 8, the shipped Megatron rules): 4 per block + 2 each for the
      split embedding and softmax;
    * per variable FSDP gathers (data=8, train.fsdp) and per variable ZeRO-1
      updates (data=8, optimizer.shard_state)."""
  from plugins.suggest.planner import megatron_binding  # pylint: disable=import-outside-toplevel
  megatron = megatron_binding()
  tiny = {}

  def run(label, bindings):
    tiny[label] = train_step_seconds(TINY + bindings)
    return tiny[label]

  one = run('data=8, 1 block', ['transformer_lm.num_layers = 1'])
  four = run('data=8', [])
  per_device = {'plain': (four - one) / 3 / 8}
  step_s = max(one - 8 * per_device['plain'], 0.0)
  tensor = {}
  for m in (2, 4, 8):
    t = run(f'data={8 // m} x model={m}',
            [f"mesh.shape = {{'data': {8 // m}, 'model': {m}}}", megatron])
    tensor[m] = max((t - four) / (4 * 4 + 2 + 2), 0.0)
  pipe = ["mesh.shape = {'stage': 2, 'data': 4}", 'pipeline.num_stages = 2',
          'pipeline.num_micro_batches = 4']
  submesh = run('stage=2 x data=4, submesh', pipe)  # 4 blocks x 4 micro-batches on 4 devices
  per_device['submesh'] = (submesh - step_s) / (4 * 4) / 4
  # The SPMD engine: 4 micro-batches, 1 repeat: 5 ticks of 2 stacked cells;
  # 2 repeats: 9 ticks of 1. Two runs: a tick's own cost and a cell run's.
  spmd = run('stage=2 x data=4, spmd', pipe + ["pipeline.engine = 'spmd'"])
  spmd2 = run('stage=2 x data=4, spmd, 2 repeats',
              pipe + ["pipeline.engine = 'spmd'", 'pipeline.circular_repeats = 2'])
  cell = ((spmd - step_s) * 9 - (spmd2 - step_s) * 5) / (10 * 9 - 9 * 5)  # 2 equations
  per_device['spmd'] = max(cell, 0.0) / 8
  tick_s = max((spmd - step_s - 10 * cell) / 5, 0.0)
  variables = 4 * 12 + 7  # 12 per block; embeddings, final norm, softmax
  fsdp = run('data=8, FSDP', ['train.fsdp = True'])
  zero = run('data=8, ZeRO-1', ['optimizer.shard_state = True'])
  return {'block_device_s': per_device, 'step_s': step_s, 'spmd_tick_s': tick_s,
          'tensor_s': {str(m): v for m, v in tensor.items()},
          'fsdp_variable_s': max((fsdp - four) / variables, 0.0),
          'zero_variable_s': max((zero - four) / variables, 0.0),
          'tiny_step_seconds': tiny}


def step_efficiency(data: dict) -> dict:
  """What the micro-benchmarks miss, from a model whose matmuls and weights
  dominate (width 512, 2 blocks, ffn 2048; neither of bench/suggest.py's
  models), each measured step against the cost model's prediction, one
  unknown at a time: on one device (no collective), per compute dtype, the
  share of the matmul rate a real step gets (casts, layouts, the backward's
  shapes); then on data=8 in bfloat16 the scale of the data-parallel
  gradient sum's bytes term, of FSDP's (meshgin gathers with all-to-alls)
  and of ZeRO-1's; last, on stage=2 x data=4 with 2 micro-batches, the share
  of the sub-mesh engine's bubble that shows on this host's shared cores."""
  from layout_core.suggest import calibration, cost  # pylint: disable=import-outside-toplevel
  from layout_core.train import memory  # pylint: disable=import-outside-toplevel
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=import-outside-toplevel
  shape = ['transformer_lm.model_dim = 512', 'transformer_lm.num_heads = 8',
           'transformer_lm.ffn_dim = 2048', 'transformer_lm.num_layers = 2',
           'optimizer.shard_state = False']
  found = {'matmul_efficiency': {}, 'collective_scale': {}, 'shared_bubble': 0.0,
           'efficiency_step_seconds': {}}

  def predict(bindings, rates):
    with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'], bindings=bindings,
                                 search_paths=[]):
      plan = plan_lib.make_plan()
    estimate = memory.estimate_memory(
        records=plan.records, params=plan.params,
        input_shapes=[s for s, _ in plan.task.input_specs(plan.train.batch_size)],
        config=plan.train, optimizer=plan.optimizer, mesh_axes=plan.mesh_spec.shape,
        pipeline=plan.pipeline)
    profile = cost.ModelProfile.of(plan.params, input_shapes=[
        s for s, _ in plan.task.input_specs(plan.train.batch_size)])
    return cost.predict_step(profile, records=plan.records, mesh_axes=plan.mesh_spec.shape,
                             config=plan.train, optimizer=plan.optimizer, rates=rates,
                             remat_of=memory.remat_leaves(plan.params, plan.train),
                             fsdp_axis=estimate.fsdp_axis, state_axis=estimate.state_axis,
                             pipeline=plan.pipeline)

  # One device (no collective at all): the share of the matmul rate a real
  # step gets. That device has the host's cores to itself, 8 devices' worth.
  for dtype in ('float32', 'bfloat16'):
    bindings = shape + ["mesh.shape = {'data': 1}", f"train.compute_dtype = '{dtype}'"]
    rates = calibration.rates_from_json({**data, **found}, source='calibrating')
    alone = dataclasses.replace(
        rates, matmul={k: [(size, 8 * rate) for size, rate in table]
                       for k, table in rates.matmul.items()},
        elementwise={k: 8 * v for k, v in rates.elementwise.items()})
    seconds = found['efficiency_step_seconds'][f'data=1, {dtype}'] = train_step_seconds(
        bindings)
    step = predict(bindings, alone)
    found['matmul_efficiency'][dtype] = min(max(step.terms['matmul'] / max(
        seconds - (step.seconds - step.terms['matmul']), 1e-9), 0.05), 1.0)
  # Then on data=8 in bfloat16, one at a time, the scale of each collective's
  # bytes term: the gradient sum of replicated weights, FSDP's, ZeRO-1's.
  bf16 = shape + ["train.compute_dtype = 'bfloat16'"]
  for name, term, extra in (('data', 'data all-reduce', []),
                            ('fsdp', 'FSDP gathers', ['train.fsdp = True']),
                            ('zero1', 'ZeRO-1 all-gather', ['optimizer.shard_state = True'])):
    rates = calibration.rates_from_json({**data, **found}, source='calibrating')
    seconds = found['efficiency_step_seconds'][name] = train_step_seconds(bf16 + extra)
    step = predict(bf16 + extra, rates)
    wire = step.terms[term]  # its bytes (the per-variable costs are a term of their own)
    rest = step.seconds - wire
    found['collective_scale'][name] = min(max((seconds - rest) / max(wire, 1e-9), 0.05), 20.0)
  # The sub-mesh engine, stage=2 x data=4, 2 micro-batches: the share of the
  # bubble of devices of their own that shows on this host's shared cores.
  pipe = bf16 + ["mesh.shape = {'stage': 2, 'data': 4}", 'pipeline.num_stages = 2',
                 'pipeline.num_micro_batches = 2']
  rates = calibration.rates_from_json({**data, **found, 'shared_bubble': 1.0},
                                      source='calibrating')
  seconds = found['efficiency_step_seconds']['submesh'] = train_step_seconds(pipe)
  step = predict(pipe, rates)
  bubble = step.terms['pipeline bubble']
  found['shared_bubble'] = min(max((seconds - (step.seconds - bubble)) / max(bubble, 1e-9),
                                   0.0), 1.0)
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'calibration.json'))
  args = parser.parse_args()
  measured = run_child(CHILD, REPO)
  fixed = fixed_costs()
  from layout_core.suggest.calibration import machine_facts  # noqa: E402
  facts = machine_facts()
  info = provenance()
  data = {
      'device_type': 'CPU', 'devices': 8,
      'measured': {'date': info['date'], **facts},
      'matmul': measured['matmul'], 'elementwise': measured['elementwise'],
      'collectives': {kind: {size: {k: v for k, v in fit.items() if k != 'points'}
                             for size, fit in by_size.items()}
                      for kind, by_size in measured['collectives'].items()},
      'collective_points': {kind: {size: fit['points'] for size, fit in by_size.items()}
                            for kind, by_size in measured['collectives'].items()},
      'cross_host': {'latency_s': 1e-3, 'bytes_per_s': 1e9},
      **fixed,
      'matmul_efficiency': {}, 'collective_scale': {},
      'devices_share_cores': True,
  }
  data.update(step_efficiency({**data, 'measured': {}}))
  write_json(data, args.out)
  print(json.dumps({k: v for k, v in data.items() if k != 'collective_points'}, indent=1))


if __name__ == '__main__':
  main()
