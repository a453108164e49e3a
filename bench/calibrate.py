r"""Calibration: the rates the layout suggester's cost model divides by, measured here.

On this machine's 8 virtual CPU devices (meshgin's thread settings), every
device busy at once, in one fresh process:

  * matmul FLOP/s per device, float32 and bfloat16, at four sizes (a chain
    of dependent [rows, k] @ [k, k] per device, rows split over data=8);
  * elementwise element-ops/s per device (a chain of x * y + z on tensors);
  * collectives over a mesh axis of 2, 4 and 8 devices at three message sizes,
    fitted to latency + bytes / bandwidth: all-reduce (a matmul whose
    contracted dim is split: the partial sums reduced), all-gather (a
    split tensor relaid out replicated) and all-to-all (a tensor split on
    one dim relaid split on another: an MoE layer's token exchange);

then the step times of real `launch.train` runs (`runs_for`, subprocesses, each
the median of 3 processes): tiny LMs under each engine and split, whose
time is the layout's structure (fixed costs per block run, per tensor
all-reduce, per FSDP / ZeRO-1 variable, per SPMD tick and per-tick sum,
per routed block, per step), and a matmul-heavy LM for what the micro-benchmarks miss (the
share of the matmul rate a step gets, the scale of each collective's bytes,
the sub-mesh bubble that shows on shared cores). Each of those rates is
fitted (`fit`) as what is left of its runs' time after the suggester's own
prediction (`plugins.suggest.planner.predict_plan`) of the rest, so the
cost model and its calibration cannot count a part twice; the file keeps
each run's measured and predicted time and the largest difference
(`fit_error`). Cross-host collectives are not measured (one host): a
nominal 1 GB/s.

    python bench/calibrate.py [--out bench/results/calibration.json]
    python bench/calibrate.py --refit     # fit the stored times again: after a
                                          # change to the cost model, measuring nothing
    python bench/calibrate.py --resume    # go on from a run that stopped

The cost model reads the file (`layout_core/suggest/calibration.py`) and says
when it is stale (another processor, core count or TensorFlow, or 90 days).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import (MEGATRON, RESULTS, provenance, run_child, with_megatron,  # noqa: E402
                          write_json)

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

def timed(fn, *args, reps=20, batch_s=0.25):
  """Seconds per call: the best of 5 batches of up to `reps` calls, fewer
  (down to 1) where a call takes longer than `batch_s / reps`: a large
  matmul in a slow dtype."""
  def run(count):
    start = time.perf_counter()
    for _ in range(count):
      out = fn(*args)
    for o in (out if isinstance(out, (list, tuple)) else [out]):
      [t.numpy() for t in dtensor.unpack(o)]
    return (time.perf_counter() - start) / count
  run(2)  # traced and warm
  reps = max(1, min(reps, int(batch_s / run(1))))
  return min(run(reps) for _ in range(5))

result = {'matmul': {}, 'elementwise': {},
          'collectives': {'all_reduce': {}, 'all_gather': {}, 'all_to_all': {}}}
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
  for kind in ('all_reduce', 'all_gather', 'all_to_all'):
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
      elif kind == 'all_to_all':  # [k r, k, 256] split on dim 0 -> split on dim 1
        cols = 256
        rows = max(elements // (k * cols), 1)
        x = dtensor.call_with_layout(lambda: tf.ones([k * rows, k, cols]),
                                     dtensor.Layout(['a', U, U], m))
        fn = tf.function(lambda x: dtensor.relayout(x, dtensor.Layout([U, 'a', U], m)) * 1.0)
        seconds = timed(fn, x)
        moved = rows * k * cols * 4  # a device's slice, as the cost model counts it
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
WIDE = ['transformer_lm.model_dim = 512', 'transformer_lm.num_heads = 8',
        'transformer_lm.ffn_dim = 2048', 'transformer_lm.num_layers = 2',
        'optimizer.shard_state = False']
PIPE = ["mesh.shape = {'stage': 2, 'data': 4}", 'pipeline.num_stages = 2',
        'pipeline.num_micro_batches = 4']
# Every block routed to 8 experts (top-2), split over the batch's own axis
# (GShard): the tokens go to their experts by all-to-all and come back.
def moe(expert_dim: int, capacity: float) -> tuple[str, ...]:
  return ('transformer_lm.moe = @moe_feed_forward()', 'moe_feed_forward.num_experts = 8',
          'moe_feed_forward.experts_per_token = 2',
          f'moe_feed_forward.expert_dim = {expert_dim}',
          f'moe_feed_forward.capacity_factor = {capacity}',
          "layout_rules.rules = [(r'.*/moe/w_(gate|up|down)', "
          "('data', 'unsharded', 'unsharded'))]")


@dataclasses.dataclass(frozen=True)
class Run:
  """One measured `launch.train` configuration (quickstart.gin + bindings).
  `alone`: a one-device mesh, which has the host's cores to itself: its
  prediction uses the per-device rates x 8 (`rates_for`). `steps`: each
  process's, its first 4 not counted."""
  label: str
  bindings: tuple[str, ...]
  alone: bool = False
  steps: int = 12


def runs_for(wide_dtype: str) -> tuple[Run, ...]:
  """What the fixed costs are fitted to: tiny LMs (width 16, 8 heads: their
  FLOPs and bytes are negligible, so what they take is what the layout's
  structure costs); then what the micro-benchmarks miss, from a model whose
  matmuls and weights dominate (width 512, 2 blocks, ffn 2048; neither of
  bench/suggest.py's), in `wide_dtype`: the dtype whose one-device step is
  faster here (`faster_dtype`), so that a collective's or the bubble's
  share of the step is not lost in a slow dtype's matmuls. The bfloat16
  one-device run takes 7 steps: without AVX-512 each is ~20 s."""
  compute = f"train.compute_dtype = '{wide_dtype}'"
  return (
      Run('data=8, 1 block', (*TINY, 'transformer_lm.num_layers = 1')),
      Run('data=8', tuple(TINY)),
      *(Run(f'data={8 // m} x model={m}',
            (*TINY, f"mesh.shape = {{'data': {8 // m}, 'model': {m}}}", MEGATRON))
        for m in (2, 4, 8)),
      Run('stage=2 x data=4, submesh', (*TINY, *PIPE)),
      Run('stage=2 x data=4, spmd', (*TINY, *PIPE, "pipeline.engine = 'spmd'")),
      Run('stage=2 x data=4, spmd, 2 repeats',
          (*TINY, *PIPE, "pipeline.engine = 'spmd'", 'pipeline.circular_repeats = 2')),
      Run('data=8, FSDP', (*TINY, 'train.fsdp = True')),
      Run('data=8, ZeRO-1', (*TINY, 'optimizer.shard_state = True')),
      Run('data=8, MoE', (*TINY, *moe(16, 0.0))),
      *(Run(f'data=1, {dtype}', (*WIDE, "mesh.shape = {'data': 1}",
                                 f"train.compute_dtype = '{dtype}'"), alone=True,
            steps=7 if dtype == 'bfloat16' else 12)
        for dtype in ('float32', 'bfloat16')),
      Run('data', (*WIDE, compute)),
      Run('fsdp', (*WIDE, compute, 'train.fsdp = True')),
      Run('zero1', (*WIDE, compute, 'optimizer.shard_state = True')),
      Run('moe', (*WIDE, compute, *moe(256, 1.0))),
      Run('submesh', (*WIDE, compute, "mesh.shape = {'stage': 2, 'data': 4}",
                      'pipeline.num_stages = 2', 'pipeline.num_micro_batches = 2')),
  )


def faster_dtype(seconds: dict[str, float]) -> str:
  """The compute dtype whose one-device step of the larger model is faster:
  measured as a whole step, since a matmul micro-benchmark can mislead (on
  AVX2 alone bfloat16's `tf.matmul` ran at float32's rate while its
  training step took 13x as long)."""
  return min(('float32', 'bfloat16'), key=lambda dtype: seconds[f'data=1, {dtype}'])


@dataclasses.dataclass(frozen=True)
class Knob:
  """One rate fitted: its place in the calibration file, and its range. A
  step's predicted time is linear in each knob's value (`invert`: in its
  reciprocal: a matmul share divides the matmul term)."""
  keys: tuple[str, ...]
  low: float = 0.0
  high: float = math.inf
  invert: bool = False

  def set(self, data: dict, value: float) -> None:
    *outer, last = self.keys
    for key in outer:
      data = data.setdefault(key, {})
    data[last] = (1.0 / value if value > 0 else math.inf) if self.invert else value

  def clamp(self, value: float) -> float:
    if self.invert:  # the range is the share's; the value its reciprocal
      return min(max(value, 1.0 / self.high), 1.0 / self.low)
    return min(max(value, self.low), self.high)


def _block(engine):
  return Knob(('block_device_s', engine))


# Each group's rates from its runs, in this order (each group's solve uses the
# rates fitted before it); the fit goes round until nothing moves.
GROUPS = (
    (('data=8, 1 block', 'data=8'), (Knob(('step_s',)), _block('plain'))),
    *((((f'data={8 // m} x model={m}',), (Knob(('tensor_s', str(m))),)) for m in (2, 4, 8))),
    (('stage=2 x data=4, submesh',), (_block('submesh'),)),
    # 5 ticks of 2 cells; 9 ticks of 1 cell, each tick's gradients summed on
    # their own: a cell run, and a variable's sum per tick. A tick's own cost
    # cannot be told from a cell run's by these two (it stays in the cell's:
    # spmd_tick_s is 0); bench/spmd_repeats.py finds the repeats' extra time
    # in the per-tick sums (8 gradient all-reduces a step with 1 repeat, 120
    # with 2).
    (('stage=2 x data=4, spmd', 'stage=2 x data=4, spmd, 2 repeats'),
     (_block('spmd'), Knob(('spmd_sum_variable_s',)))),
    (('data=8, FSDP',), (Knob(('fsdp_variable_s',)),)),
    (('data=8, ZeRO-1',), (Knob(('zero_variable_s',)),)),
    (('data=8, MoE',), (Knob(('moe_block_s',)),)),
    *(((f'data=1, {dtype}',), (Knob(('matmul_efficiency', dtype), 0.05, 1.0, invert=True),))
      for dtype in ('float32', 'bfloat16')),
    *(((label,), (Knob(('collective_scale', label), 0.05, 20.0),))
      for label in ('data', 'fsdp', 'zero1')),
    (('moe',), (Knob(('moe_matmul_share',), 0.05, 4.0, invert=True),)),
    (('submesh',), (Knob(('shared_bubble',), 0.0, 1.0),)),
)
ROUNDS = 8


def plan_of(run: Run):
  """The run's plan, as launch.train makes it (no TensorFlow)."""
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=import-outside-toplevel
  with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'],
                               bindings=with_megatron(run.bindings), search_paths=[]):
    return plan_lib.make_plan()


def rates_for(run: Run, rates):
  """The rates `run` is predicted with: a one-device run's device has the
  host's cores to itself, 8 devices' worth of matmul and elementwise rate."""
  if not run.alone:
    return rates
  return dataclasses.replace(
      rates, matmul={k: [(size, 8 * rate) for size, rate in table]
                     for k, table in rates.matmul.items()},
      elementwise={k: 8 * v for k, v in rates.elementwise.items()})


def predict(run: Run, data: dict, plan=None) -> float:
  """The cost model's step seconds for `run` with the rates in `data`:
  `plugins.suggest.planner.predict_plan`, the suggester's own prediction."""
  from layout_core.suggest import calibration  # pylint: disable=import-outside-toplevel
  from plugins.suggest.planner import predict_plan  # pylint: disable=import-outside-toplevel
  rates = rates_for(run, calibration.rates_from_json(data, source='calibrating'))
  return predict_plan(plan or plan_of(run), rates=rates).seconds


def fit(data: dict, seconds: dict[str, float]) -> dict:
  """The fixed costs, matmul shares, collective scales and shared bubble
  that make `predict` give each run's measured `seconds`: per group, its
  unknowns solved from predictions at 0 and at 1 of each (the prediction is
  linear in them), clamped to their ranges; the groups in turn, round after
  round, since each group's prediction holds the others' rates. Returns
  `data` with them and, per run, its measured and predicted seconds, and the
  largest relative difference (`fit_error`): what a prediction of these
  runs from the file gives back."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  data = json.loads(json.dumps(data))
  for _, knobs in GROUPS:  # start from nothing: every fixed cost 0, every share 1
    for knob in knobs:
      knob.set(data, 1.0 if knob.invert or knob.low > 0 else 0.0)
  data['spmd_tick_s'] = 0.0  # in the SPMD cell's cost (GROUPS)
  runs = {run.label: run for run in runs_for(data.get('wide_dtype', 'bfloat16'))}
  plans = {label: plan_of(run) for label, run in runs.items()}
  for _ in range(ROUNDS):
    for labels, knobs in GROUPS:
      group = [runs[label] for label in labels]

      def at(values):
        for knob, value in zip(knobs, values):
          knob.set(data, value)
        return np.array([predict(run, data, plans[run.label]) for run in group])

      base = at([0.0] * len(knobs))
      slopes = np.stack([at(np.eye(len(knobs))[j]) - base for j in range(len(knobs))], axis=1)
      measured = np.array([seconds[label] for label in labels])
      solved = np.linalg.solve(slopes, measured - base)
      at([knob.clamp(float(v)) for knob, v in zip(knobs, solved)])
  report = []
  for run in runs.values():
    predicted = predict(run, data, plans[run.label])
    report.append({'label': run.label, 'bindings': list(run.bindings),
                   'measured_s': seconds[run.label], 'predicted_s': predicted,
                   'error': predicted / seconds[run.label] - 1.0})
  data['runs'] = report
  data['fit_error'] = max(abs(r['error']) for r in report)
  return data


PARTIAL = os.path.join(RESULTS, '.calibrate.partial.json')  # a dotfile: not a result


def measure_runs(data: dict, seconds: dict[str, float]) -> tuple[dict, dict[str, float]]:
  """Each run's step seconds that `seconds` lacks, measured: the one-device
  runs first, which choose the larger model's dtype (`faster_dtype`). After
  each run the micro-benchmarks and every time so far are kept in
  `PARTIAL`, so a stop (or a fit that fails) loses no measurement: --resume
  goes on."""
  seconds = dict(seconds)

  def keep():
    with open(PARTIAL, 'w') as f:
      json.dump({'data': data, 'seconds': seconds}, f)

  def measure(run: Run):
    if run.label not in seconds:
      seconds[run.label] = train_step_seconds(with_megatron(run.bindings), steps=run.steps)
      print(f'{run.label:36s} {seconds[run.label] * 1e3:9.2f} ms a step', flush=True)
      keep()

  keep()
  for run in runs_for('float32'):  # the one-device runs are the same for either dtype
    if run.alone:
      measure(run)
  data.setdefault('wide_dtype', faster_dtype(seconds))
  for run in runs_for(data['wide_dtype']):
    measure(run)
  return data, seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'calibration.json'))
  parser.add_argument('--refit', action='store_true',
                      help='fit the rates again to the step times --out already holds '
                           '(after a change to the cost model), measuring nothing')
  parser.add_argument('--resume', action='store_true',
                      help='go on from a stopped run (bench/results/.calibrate.partial.json): '
                           'its micro-benchmarks and step times kept, the rest measured')
  args = parser.parse_args()
  if args.refit:
    with open(args.out) as f:
      data = json.load(f)
    seconds = {r['label']: r['measured_s'] for r in data.get('runs', [])} or {
        **data['tiny_step_seconds'], **data['efficiency_step_seconds']}  # an older file
    for key in ('runs', 'fit_error', 'tiny_step_seconds', 'efficiency_step_seconds'):
      data.pop(key, None)
    data['refit'] = provenance()['commit']
  elif args.resume and os.path.exists(PARTIAL):
    with open(PARTIAL) as f:
      partial = json.load(f)
    data, seconds = measure_runs(partial['data'], partial['seconds'])
  else:
    measured = run_child(CHILD, REPO)
    from layout_core.suggest.calibration import machine_facts  # noqa: E402
    info = provenance()
    data = {
        'device_type': 'CPU', 'devices': 8,
        'measured': {'date': info['date'], **machine_facts()},
        'matmul': measured['matmul'], 'elementwise': measured['elementwise'],
        'collectives': {kind: {size: {k: v for k, v in fit.items() if k != 'points'}
                               for size, fit in by_size.items()}
                        for kind, by_size in measured['collectives'].items()},
        'collective_points': {kind: {size: fit['points'] for size, fit in by_size.items()}
                              for kind, by_size in measured['collectives'].items()},
        'cross_host': {'latency_s': 1e-3, 'bytes_per_s': 1e9},
        'devices_share_cores': True,
    }
    data, seconds = measure_runs(data, {})
  data = fit(data, seconds)
  write_json(data, args.out)
  if os.path.exists(PARTIAL):
    os.remove(PARTIAL)
  print(json.dumps({k: v for k, v in data.items() if k not in ('collective_points', 'runs')},
                   indent=1))
  for run in data['runs']:
    print(f"{run['label']:36s} measured {run['measured_s'] * 1e3:7.2f} ms, predicted "
          f"{run['predicted_s'] * 1e3:7.2f} ms ({run['error']:+.1%})")


if __name__ == '__main__':
  main()
