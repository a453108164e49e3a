r"""Start-up, phase by phase: from `python -m launch.train ...` to its first
step, beside a hand-written TensorFlow program of the same model, on one
device and under DTensor.

    python bench/startup.py [--configs quickstart lm_2d] [--rounds 3] [--without_grappler]

Each contender is a fresh process, run in turns (meshgin's configs, then the
plain program, round after round) so that load drift hits all alike; each
figure is the best round's. The meshgin child runs the real entry point,
`launch.train.main` under `absl.app.run`, with `train.num_steps = 3`; it only
wraps a few of the functions that path calls with a clock (nothing else
changes), and the first call of each step function also waits for its
result, so that each phase ends when its work is done:

    phase                         ends when
    python, import TensorFlow     `import tensorflow` returned
    flags, gin, plan              `plugins.plan.make_plan` returned
    mesh                          `layout_core.layout.mesh.build_mesh` returned
    model variables               the last `LayoutScope` closed
    optimizer state, engine       `factory.make_trainer` returned
    dry step                      `check_step_compiles` returned (compiles the gradients)
    run record                    `plugins.record.record_run` returned
    step-0 eval                   the first training step began (compiles evaluate)
    first step                    its update's result is on the host (compiles apply)

The plain program (`plain_child`: no DTensor, one device, one `tf.function`
doing forward, backward, clipping and Adam) has three: import TensorFlow,
variables (parameters and Adam slots), first step. The same program runs
under DTensor too (`--hand_written`, default both): every variable a
replicated DVariable, the batch split over a `data` mesh of 1 or 8 virtual
CPUs; no meshgin code but the thread setting. That is the floor DTensor sets
on a mesh, which meshgin can approach but not pass. Times are wall seconds
since the parent started the process and CPU seconds of the process (both
columns: on a shared machine the CPU figure is the steadier one). Also
printed per step function: the first call (trace + compile + run) and the
best later call (run).

Measured on the 2-core machine, 2026-11-26, best of 3 rounds (wall s to the
first step; the plain program 2.95 s):

    quickstart (meshgin, data=8)          6.19   2.10x plain   1.13x hand-written data=8
    lm_2d (meshgin, data=2 x model=4)     6.82   2.31x plain   1.25x hand-written data=8
    hand-written under DTensor, data=1    3.43   1.16x plain
    hand-written under DTensor, data=8    5.45   1.85x plain

So an 8-device mesh costs the same hand-written program 1.85x the
one-device program's time to its first step: the first call of a DTensor
function compiles one copy per device (bench/limits/dtensor_compile_limit.py: an
Adam update of 30 variables, 957 ops, 0.15 s plain, 0.37 s on DTensor
data=1, 0.67 s on 4, 1.37 s on 8). The quickstart was at 7.18 s (2.37x)
before its variables were named by their last path part
(`layout_core.layout.variables.dvariable`: model variables and optimizer
state 1.04 -> 0.50 s).

`--without_grappler` adds each contender with TensorFlow's graph optimizer
switched off (`disable_meta_optimizer`), and says whether its training
losses stay bit-identical. Grappler is most of that per-device compile: the
quickstart's first step at 0.73x the wall time (5.25 s), the hand-written
data=8 program at 0.70x (4.05 s); but the quickstart's third loss moves in
its last bits without it (4.131618976 -> 4.131619453), and the steady
step of lm_2d was slower in a 100-step run (47 vs 42 ms), so meshgin leaves
Grappler on. (Switching off each Grappler pass but the arithmetic
optimizer kept the quickstart's losses, saved a quarter of the compile,
and made lm_2d's step 62 ms.)

Results go to bench/results/startup.json with the date, commit and machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import RESULTS, plain_lm_step, provenance, write_json  # noqa: E402

CONFIGS = {'quickstart': 'configs/experiments/quickstart.gin',
           'lm_2d': 'configs/experiments/lm_2d.gin'}
NUM_STEPS = 3
MESHGIN_PHASES = ('python, import TensorFlow', 'flags, gin, plan', 'mesh', 'model variables',
                  'optimizer state, engine', 'dry step', 'run record', 'step-0 eval',
                  'first step')
PLAIN_PHASES = ('python, import TensorFlow', 'variables', 'first step')
STEP_FUNCTIONS = ('loss_and_gradients', 'evaluate', 'apply_gradients')
NO_GRAPPLER = '/without_grappler'  # a contender's suffix
# The plain program under DTensor: name -> devices on its `data` mesh.
HAND_WRITTEN = {'dtensor data=1': 1, 'dtensor data=8': 8}


# ---------------------------------------------------------------- child side


class Clock:
  """Wall seconds since the parent's spawn time, and this process's CPU seconds."""

  def __init__(self, spawned: float):
    self.spawned = spawned
    self.marks: dict[str, tuple[float, float]] = {}

  def now(self) -> tuple[float, float]:
    return time.time() - self.spawned, time.process_time()

  def mark(self, name: str) -> None:
    self.marks[name] = self.now()


def _wrap(owner, name: str, before=None, after=None) -> None:
  """Replaces `owner.name` by a call of the original between two hooks."""
  original = getattr(owner, name, None)
  if original is None:
    raise SystemExit(f'bench/startup.py: {owner.__name__}.{name} is gone: update the '
                     'phases to the code path launch.train takes now')

  def timed(*args, **kwargs):
    if before:
      before()
    result = original(*args, **kwargs)
    if after:
      after(result)
    return result
  setattr(owner, name, timed)


def meshgin_child(gin_file: str, spawned: float, *, grappler: bool = True) -> dict:
  clock = Clock(spawned)
  import tensorflow  # pylint: disable=g-import-not-at-top
  clock.mark('python, import TensorFlow')
  if not grappler:
    tensorflow.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
  # pylint: disable=g-import-not-at-top
  from absl import app
  import launch
  from launch import train as launch_train
  from layout_core.layout import mesh as mesh_lib, scope as scope_lib
  from layout_core.layout.variables import to_numpy
  from plugins import plan as plan_lib, training
  calls: dict[str, list[tuple[float, float]]] = {}
  losses: list[float] = []  # every gradients call's loss (the dry step's first)

  def watch_engine(engine) -> None:
    for method in STEP_FUNCTIONS:
      original = getattr(engine, method)

      def call(*args, _original=original, _method=method):
        start = clock.now()
        result = _original(*args)
        first = _method not in calls
        if first:  # its compile ends when its first result is on the host
          to_numpy(result[0])
        if _method == 'loss_and_gradients':
          losses.append(float(to_numpy(result[0])))
        calls.setdefault(_method, []).append((start, clock.now()))
        if first and _method == 'apply_gradients':
          clock.mark('first step')
        return result
      setattr(engine, method, call)

  _wrap(plan_lib, 'make_plan', after=lambda _: clock.mark('flags, gin, plan'))
  _wrap(mesh_lib, 'build_mesh', after=lambda _: clock.mark('mesh'))
  _wrap(scope_lib.LayoutScope, '__exit__', after=lambda _: clock.mark('model variables'))

  def trainer_made(trainer):
    clock.mark('optimizer state, engine')
    watch_engine(trainer.engine)
  _wrap(training, 'make_trainer', after=trainer_made)
  _wrap(training, 'check_step_compiles', after=lambda _: clock.mark('dry step'))
  _wrap(training, 'record_run', after=lambda _: clock.mark('run record'))
  launch.install_start_up_handlers()
  model_dir = tempfile.mkdtemp(prefix='meshgin-startup-')
  argv = ['launch.train', f'--gin_file={gin_file}', f'--model_dir={model_dir}',
          f'--gin_bindings=train.num_steps = {NUM_STEPS}',
          '--gin_bindings=checkpoint.save_at_end = False']
  try:
    app.run(launch_train.main, argv=argv)
  except SystemExit as e:
    if e.code:
      raise
  gradients = calls['loss_and_gradients']
  # The step-0 eval ends where the first training step's gradients begin
  # (the dry step made the first call).
  clock.marks['step-0 eval'] = gradients[1][0]
  return {'phases': clock.marks, 'calls': calls, 'losses': losses}


def plain_child(spawned: float, *, devices: int = 0, grappler: bool = True) -> dict:
  """lm_tiny (111,936 parameters: vocab 64, width 64, 4 heads, ffn 256, 2
  layers, 64 positions) trained on batches of 32 x 64 tokens as a user would
  write it by hand: plain variables on one device, one tf.function. With
  `devices`, the same program under DTensor (`bench.common.plain_lm_step`),
  the batch split over a `data` mesh of that many virtual CPUs with
  meshgin's thread setting: what DTensor alone costs, no meshgin code run."""
  clock = Clock(spawned)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  clock.mark('python, import TensorFlow')
  tf.random.set_seed(0)  # the same initial values in every contender
  if not grappler:
    tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': True})
  mesh, place = None, lambda tokens: tokens
  if devices:
    from tensorflow.experimental import dtensor  # pylint: disable=g-import-not-at-top
    from bench.common import pack_rows  # pylint: disable=g-import-not-at-top
    from layout_core.layout.mesh import configure_virtual_cpus  # pylint: disable=g-import-not-at-top
    configure_virtual_cpus(devices)
    mesh = dtensor.create_mesh([('data', devices)], device_type='CPU')
    place = lambda tokens: pack_rows(tokens, mesh)  # noqa: E731
  vocab, seq, batch = 64, 64, 32
  step, variables = plain_lm_step(vocab=vocab, dim=64, heads=4, ffn=256, layers=2, seq=seq,
                                  mesh=mesh)
  clock.mark('variables')

  rng = np.random.default_rng(0)
  calls, losses = [], []
  for _ in range(NUM_STEPS):
    start = clock.now()
    losses.append(float(step(place(rng.integers(0, vocab, size=(batch, seq + 1),
                                                dtype=np.int32))).numpy()))
    calls.append((start, clock.now()))
    if len(calls) == 1:
      clock.mark('first step')
  parameters = sum(int(np.prod(v.shape)) for v in variables)
  return {'phases': clock.marks, 'calls': {'step': calls}, 'parameters': parameters,
          'losses': losses}


# ---------------------------------------------------------------- parent side


def run_child(kind: str, *args: str) -> dict:
  env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL='2')
  spawned = time.time()
  done = subprocess.run([sys.executable, os.path.abspath(__file__), '--child', kind,
                         '--spawned', repr(spawned), *args], cwd=REPO, env=env,
                        capture_output=True, text=True)
  if done.returncode or 'RESULT ' not in done.stdout:
    raise SystemExit(f'{kind} {" ".join(args)} failed (exit {done.returncode}):\n'
                     f'{done.stderr[-4000:]}')
  return json.loads(done.stdout.split('RESULT ', 1)[1])


def durations(result: dict, phases) -> dict[str, tuple[float, float]]:
  """Each phase's (wall, CPU) seconds: from the end of the one before."""
  out, previous = {}, (0.0, 0.0)
  for name in phases:
    wall, cpu = result['phases'][name]
    out[name] = (wall - previous[0], cpu - previous[1])
    previous = (wall, cpu)
  return out


def best(results: list[dict], phases) -> dict:
  """The round with the earliest first step (wall), and per phase the least."""
  first = min(results, key=lambda r: r['phases']['first step'][0])
  per_phase = {name: (min(durations(r, phases)[name][0] for r in results),
                      min(durations(r, phases)[name][1] for r in results)) for name in phases}
  calls = {}
  for name in first['calls']:
    spans = [[end[0] - start[0] for start, end in r['calls'][name]] for r in results]
    calls[name] = {'first': min(s[0] for s in spans),
                   'later': min(min(s[1:]) for s in spans if len(s) > 1)}
  return {'first_step': first['phases']['first step'],
          'first_step_cpu_best': min(r['phases']['first step'][1] for r in results),
          'phases': per_phase, 'calls': calls}


def print_table(name: str, summary: dict, phases, plain: dict) -> None:
  wall, cpu = summary['first_step'][0], summary['first_step_cpu_best']
  plain_wall, plain_cpu = plain['first_step'][0], plain['first_step_cpu_best']
  print(f'\n{name}: first step at {wall:.2f} s wall ({wall / plain_wall:.2f}x the plain '
        f'program\'s {plain_wall:.2f} s), {cpu:.2f} CPU-s ({cpu / plain_cpu:.2f}x its '
        f'{plain_cpu:.2f})')
  print(f'  {"phase (best round each)":32s} {"wall s":>7s} {"CPU s":>7s}')
  for phase in phases:
    w, c = summary['phases'][phase]
    print(f'  {phase:32s} {w:7.2f} {c:7.2f}')
  for function, spans in summary['calls'].items():
    print(f'  {function + " call":32s} first {spans["first"]:.2f} s, later {spans["later"]:.3f} s')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--configs', nargs='+', default=list(CONFIGS), choices=list(CONFIGS))
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'startup.json'))
  parser.add_argument('--hand_written', nargs='*', default=list(HAND_WRITTEN),
                      choices=list(HAND_WRITTEN),
                      help='the plain program under DTensor on these meshes')
  parser.add_argument('--without_grappler', action='store_true',
                      help='also each contender with Grappler off')
  parser.add_argument('--child', help=argparse.SUPPRESS)
  parser.add_argument('--spawned', type=float, help=argparse.SUPPRESS)
  args, rest = parser.parse_known_args()
  if args.child:
    name, without, _ = args.child.partition(NO_GRAPPLER)
    if name in CONFIGS:
      result = meshgin_child(CONFIGS[name], args.spawned, grappler=not without)
    else:
      result = plain_child(args.spawned, devices=HAND_WRITTEN.get(name, 0),
                           grappler=not without)
    print('RESULT ' + json.dumps(result), flush=True)
    os._exit(0)  # pylint: disable=protected-access
  if rest:
    parser.error(f'unexpected arguments: {rest}')
  record = provenance()
  print(f'{record["date"]}, {record["machine"]["cores"]} cores, load average '
        f'{record["machine"]["load_average_at_start"][0]:.1f} at start', flush=True)
  measured = [*args.configs, *args.hand_written]
  variants = [name + NO_GRAPPLER for name in measured] if args.without_grappler else []
  rounds: dict[str, list[dict]] = {name: [] for name in [*measured, *variants, 'plain']}
  for index in range(args.rounds):
    for name in rounds:
      result = run_child(name)
      rounds[name].append(result)
      print(f'round {index + 1} {name:28s} first step at '
            f'{result["phases"]["first step"][0]:6.2f} s wall, '
            f'{result["phases"]["first step"][1]:6.2f} CPU-s', flush=True)
  plain = best(rounds['plain'], PLAIN_PHASES)
  print_table('plain TensorFlow', plain, PLAIN_PHASES, plain)
  summaries = {'plain': plain}
  for name in [*measured, *variants]:
    phases = MESHGIN_PHASES if name.partition(NO_GRAPPLER)[0] in CONFIGS else PLAIN_PHASES
    summaries[name] = best(rounds[name], phases)
    print_table(name, summaries[name], phases, plain)
  for name in variants:
    base = name[:-len(NO_GRAPPLER)]
    same = rounds[name][0]['losses'] == rounds[base][0]['losses']
    summaries[name]['losses_bit_identical'] = same
    print(f'\n{base} without Grappler: first step at '
          f'{summaries[name]["first_step"][0] / summaries[base]["first_step"][0]:.2f}x the wall '
          f'time with it, {summaries[name]["first_step_cpu_best"] / summaries[base]["first_step_cpu_best"]:.2f}x'
          f' the CPU-s; losses {"bit-identical" if same else "DIFFER"}: '
          f'{rounds[name][0]["losses"]} vs {rounds[base][0]["losses"]}')
  for config in args.configs:
    for name in args.hand_written:
      print(f'\n{config} vs the hand-written program on {name}: first step at '
            f'{summaries[config]["first_step"][0] / summaries[name]["first_step"][0]:.2f}x '
            'its wall time')
  record.update(rounds_run=args.rounds, best=summaries, rounds=rounds,
                load_average_at_end=os.getloadavg(),
                ratio_first_step_wall={n: summaries[n]['first_step'][0] / plain['first_step'][0]
                                       for n in [*measured, *variants]},
                ratio_first_step_cpu={n: summaries[n]['first_step_cpu_best']
                                      / plain['first_step_cpu_best']
                                      for n in [*measured, *variants]})
  write_json(record, args.out)


if __name__ == '__main__':
  main()
