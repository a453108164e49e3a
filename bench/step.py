"""Training-step rate side by side, in turns: meshgin on 1 device, 8 devices
and 2x4, the pipeline engines, a hand-written TensorFlow loop, and how the
split's overhead changes with model size.

Every contender is a child process that builds its trainer once (the path
`launch.train` takes: gin files -> typed plan -> `build_trainer`), compiles
and warms up, then waits. The parent then asks each child in turn for
`--steps` steps, `--rounds` times, so load drift hits every contender alike;
only one child runs at a time. Each figure is the best round's steps/s.

Groups (each contender's gin bindings are printed with its figure):

* `split`: lm_small (3.3M parameters, batch 32 x 64) on 1 device, `data=8`
  and `data=2 x model=4` (Megatron rules), each as configured by default and
  with the other `optimizer.shard_state`, with a fused step (gradients and
  update in one function; with XLA), and on 2x4 with the residual stream
  left to DTensor; the plain TF loop (graph, XLA) of the same model.
* `pipeline`: lm_small on `stage=2 x data=2 x model=2` with M=8 micro-batches,
  the SPMD engine against the same model unpipelined on `data=2 x model=4`,
  and the sub-mesh engine against serial (unpipelined on one stage's
  `data=2 x model=2`); and both unpipelined models fed the same 8
  micro-batches one after another (`train.grad_accum_steps = 8`): what
  matmuls of a micro-batch's size cost before any pipelining.
* `size`: lm_tiny, lm_small and a 4x wider lm_small on 1 device, `data=8` and
  `2x4`: the fraction of the 1-device rate each split keeps.
* `fsdp`: fully sharded parameters (`train.fsdp = True`) against the default
  (ZeRO-1 on `data=8`) for lm_small and a 4x wider lm_small, and against
  Megatron alone on 2x4.

    python bench/step.py [--groups split pipeline size fsdp] [--steps 10 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import RESULTS, plain_lm_step, write_json  # noqa: E402

LM_SMALL = ['configs/runs/train.gin', 'configs/models/lm_small.gin']
MEGATRON = 'configs/layouts/megatron.gin'
DATA = ['data.vocab_size = 256', 'data.seq_len = 64', 'train.batch_size = 32',
        'transformer_lm.max_len = 64']
WIDE = ['transformer_lm.model_dim = 1024', 'transformer_lm.ffn_dim = 4096']
TINY = ['configs/runs/train.gin', 'configs/models/lm_tiny.gin']
MESHES = {'1 device': ["mesh.shape = {'data': 1}"], 'data=8': ["mesh.shape = {'data': 8}"],
          '2x4': ["mesh.shape = {'data': 2, 'model': 4}"]}
SHARD = ['optimizer.shard_state = True']
NO_SHARD = ['optimizer.shard_state = False']
STAGES = ["mesh.shape = {'stage': 2, 'data': 2, 'model': 2}", 'pipeline.num_stages = 2',
          'pipeline.num_micro_batches = 8']
MICRO_BATCHES = ['train.grad_accum_steps = 8']


def meshgin(files, *bindings):
  return {'kind': 'meshgin', 'gin': list(files), 'bindings': [*DATA, *bindings]}


def contenders(group: str) -> dict[str, dict]:
  """name -> child spec, for one group."""
  if group == 'split':
    one = meshgin(LM_SMALL, *MESHES['1 device'])
    return {
        'plain TF (graph)': {'kind': 'plain', 'jit': False, 'width': 1},
        'plain TF (XLA)': {'kind': 'plain', 'jit': True, 'width': 1},
        'meshgin 1 device': one,
        'meshgin data=8': meshgin(LM_SMALL, *MESHES['data=8']),
        'meshgin data=8, unsharded state': meshgin(LM_SMALL, *MESHES['data=8'], *NO_SHARD),
        'meshgin data=8, fused step': {**meshgin(LM_SMALL, *MESHES['data=8']), 'fused': True},
        'meshgin data=8, fused step, XLA': {
            **meshgin(LM_SMALL, *MESHES['data=8']), 'fused': True, 'jit': True},
        'meshgin 2x4': meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4']),
        'meshgin 2x4, residual left to DTensor': {
            **meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4']), 'free_residual': True},
        'meshgin 2x4, fused step': {**meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4']),
                                    'fused': True},
        'meshgin 2x4, shard_state': meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4'], *SHARD),
    }
  if group == 'pipeline':
    return {
        'unpipelined data=2 x model=4': meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4']),
        'spmd S=2 M=8': meshgin(LM_SMALL + [MEGATRON], *STAGES, "pipeline.engine = 'spmd'"),
        'serial data=2 x model=2': meshgin(LM_SMALL + [MEGATRON],
                                           "mesh.shape = {'data': 2, 'model': 2}"),
        'submesh S=2 M=8': meshgin(LM_SMALL + [MEGATRON], *STAGES,
                                   "pipeline.engine = 'submesh'"),
        # The micro-batch bound: the same unpipelined models fed 8 micro-batches of 4
        # rows one after another (gradient accumulation), the pipelines' matmul sizes.
        'unpipelined data=2 x model=4, M=8': meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4'],
                                                     *MICRO_BATCHES),
        'serial data=2 x model=2, M=8': meshgin(LM_SMALL + [MEGATRON],
                                                "mesh.shape = {'data': 2, 'model': 2}",
                                                *MICRO_BATCHES),
    }
  if group == 'fsdp':
    fsdp = 'train.fsdp = True'
    return {
        'lm_small data=8 (default: ZeRO-1)': meshgin(LM_SMALL, *MESHES['data=8']),
        'lm_small data=8, fsdp': meshgin(LM_SMALL, *MESHES['data=8'], fsdp),
        'lm_small x4 wide data=8, ZeRO-1': meshgin(LM_SMALL, *MESHES['data=8'], *WIDE, *SHARD),
        'lm_small x4 wide data=8, fsdp': meshgin(LM_SMALL, *MESHES['data=8'], *WIDE, fsdp),
        'lm_small 2x4 Megatron': meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4']),
        'lm_small 2x4 Megatron, fsdp': meshgin(LM_SMALL + [MEGATRON], *MESHES['2x4'], fsdp),
    }
  if group == 'size':
    models = {'lm_tiny': (TINY, ['data.vocab_size = 64', 'data.seq_len = 64',
                                 'train.batch_size = 32']),
              'lm_small': (LM_SMALL, DATA), 'lm_small x4 wide': (LM_SMALL, DATA + WIDE)}
    specs = {}
    for model, (files, data) in models.items():
      for mesh, binding in MESHES.items():
        layout = [MEGATRON] if mesh == '2x4' else []
        specs[f'{model} {mesh}'] = {'kind': 'meshgin', 'gin': files + layout,
                                    'bindings': data + binding}
    return specs
  raise ValueError(f'unknown group {group!r}')


class Child:
  """A contender's process: builds and warms up, then runs `steps` on request."""

  def __init__(self, name: str, spec: dict):
    self.name, self.spec = name, spec
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', PYTHONPATH=REPO)
    self.process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--child', json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=REPO)
    self.info = json.loads(self._expect('READY'))

  def _expect(self, word: str) -> str:
    for line in self.process.stdout:
      if line.startswith(word + ' '):
        return line[len(word) + 1:]
    raise RuntimeError(f'{self.name} exited: {self.process.stderr.read()[-3000:]}')

  def run(self, steps: int) -> float:
    self.process.stdin.write(f'{steps}\n')
    self.process.stdin.flush()
    return float(self._expect('TIME'))

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait(timeout=60)


# ---------------------------------------------------------------- child side


def plain_step(spec: dict):
  """The lm_small forward, backward and Adam update written in plain TF (no
  DTensor, no meshgin): the contender a user would write by hand."""
  import tensorflow as tf
  vocab, seq, batch = 256, 64, 32
  step, variables = plain_lm_step(vocab=vocab, dim=256 * spec['width'], heads=8,
                                  ffn=1024 * spec['width'], layers=4, seq=seq - 1,
                                  jit=spec['jit'])
  rng = tf.random.Generator.from_seed(0)
  batches = [rng.uniform([batch, seq], 0, vocab, tf.int32) for _ in range(8)]
  count = iter(range(10**9))
  return (lambda: step(batches[next(count) % 8])), (lambda loss: loss.numpy()), {
      'parameters': sum(int(tf.size(v)) for v in variables), 'names': len(variables)}


def meshgin_step(spec: dict):
  """The trainer `launch.train` would build for the gin files and bindings;
  with `fused`, a candidate measured here, not built into meshgin: the
  engine's gradients and update traced into one function (`jit`: compiled
  with XLA); with `free_residual`, the transformer blocks' residual stream
  not pinned (`layout_core.model.activations`), as before it was."""
  from plugins import registry  # noqa: F401  (registers the configurables)
  from plugins.gin_setup import parsed_config
  from plugins.plan import make_plan
  from plugins.training import build_trainer
  from layout_core.layout.variables import to_numpy
  if spec.get('free_residual'):  # the residual stream's layout left to DTensor, as before
    from layout_core.model import layers
    layers.residual = lambda x, pin=None: x
  with parsed_config(files=spec['gin'], bindings=spec['bindings']):
    plan = make_plan()
  trainer = build_trainer(plan)
  batch_size = plan.train.batch_size
  batches = [plan.task.features(split='train', step=s, batch_size=batch_size)
             for s in range(8)]
  count = iter(range(10**9))
  step = lambda: trainer.train_step(batches[next(count) % 8])[0]  # noqa: E731
  if spec.get('fused'):
    import tensorflow as tf
    engine = trainer.engine

    @tf.function(jit_compile=spec.get('jit', False))
    def fused(packed):
      loss, _, grads = engine._gradients_fn(packed)  # pylint: disable=protected-access
      engine._apply_fn(grads)  # pylint: disable=protected-access
      return loss

    def step():  # compiled with the process's gather lowering (build_mesh decided it)
      return fused(engine.pack(batches[next(count) % 8]))
  return step, to_numpy, {'parameters': plan.num_parameters,
                          'mesh': plan.mesh_spec.describe()}


def child(spec: dict) -> None:
  step, wait, info = (plain_step if spec['kind'] == 'plain' else meshgin_step)(spec)
  for _ in range(3):
    wait(step())
  print('READY ' + json.dumps(info), flush=True)
  for line in sys.stdin:
    steps = int(line)
    start = time.perf_counter()
    for _ in range(steps):
      out = step()
    wait(out)
    print(f'TIME {(time.perf_counter() - start) / steps}', flush=True)


# ---------------------------------------------------------------- parent side


def run_group(group: str, *, steps: int, rounds: int) -> dict:
  specs = contenders(group)
  children = {}
  for name, spec in specs.items():
    start = time.perf_counter()
    children[name] = Child(name, spec)
    print(f'  built {name} in {time.perf_counter() - start:.0f} s', flush=True)
  times = {name: [] for name in children}
  try:
    for round_ in range(rounds):
      for name, child_ in children.items():
        times[name].append(child_.run(steps))
  finally:
    for child_ in children.values():
      child_.close()
  results = {}
  for name, spec in specs.items():
    best = min(times[name])
    results[name] = {'steps_per_sec': 1 / best, 'ms_per_step': 1e3 * best,
                     'rounds_ms': [1e3 * t for t in times[name]], 'spec': spec,
                     **children[name].info}
  return results


def report(group: str, results: dict) -> None:
  base_name = {'split': 'meshgin 1 device'}.get(group)
  for name, result in results.items():
    line = f'  {name:34s} {result["steps_per_sec"]:6.2f} steps/s ({result["ms_per_step"]:7.1f} ms)'
    reference = None
    if group == 'split':
      reference = base_name
    elif group == 'pipeline':
      reference = {'spmd S=2 M=8': 'unpipelined data=2 x model=4',
                   'unpipelined data=2 x model=4, M=8': 'unpipelined data=2 x model=4',
                   'submesh S=2 M=8': 'serial data=2 x model=2',
                   'serial data=2 x model=2, M=8': 'serial data=2 x model=2'}.get(name)
    elif group == 'fsdp' and name.endswith(', fsdp'):
      reference = next(other for other in results
                       if other.startswith(name[:-len(', fsdp')]) and other != name)
    elif group == 'size' and not name.endswith('1 device'):
      reference = name.rsplit(' ', 1)[0] + ' 1 device'
    if reference and reference != name:
      ratio = result['steps_per_sec'] / results[reference]['steps_per_sec']
      result['ratio'] = {'to': reference, 'value': ratio}
      line += f'  {ratio:5.2f} of {reference}'
    print(line, flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--groups', nargs='+', default=['split', 'pipeline', 'size'])
  parser.add_argument('--steps', type=int, default=10, help='steps per timed round')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--child', help=argparse.SUPPRESS)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'step.json'))
  args = parser.parse_args()
  if args.child:
    child(json.loads(args.child))
    return
  results = {'cores': len(os.sched_getaffinity(0)), 'steps': args.steps,
             'rounds': args.rounds}
  for group in args.groups:
    print(f'{group}:', flush=True)
    results[group] = run_group(group, steps=args.steps, rounds=args.rounds)
    report(group, results[group])
  write_json(results, args.out)


if __name__ == '__main__':
  main()
