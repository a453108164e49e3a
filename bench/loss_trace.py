r"""Records the first N `train/loss` values of reference configs, and compares.

A refactoring that must not change behaviour is checked with it: record before
the first commit, compare after the last one (bit-identical means equal floats).

    python -m bench.loss_trace record --out=/tmp/trace_before.json
    python -m bench.loss_trace record --out=/tmp/trace_after.json
    python -m bench.loss_trace compare /tmp/trace_before.json /tmp/trace_after.json

Each config trains `--steps` steps (`train.log_every = 1`, a checkpoint every
`--steps // 2` steps) in `--work_dir/<name>`, kept so that `resume` can check
that those checkpoints restore into the current code: it removes the last
checkpoint, resumes from the middle one and compares the second half's losses
with the recorded ones.

    python -m bench.loss_trace resume --trace=/tmp/trace_before.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import read_tensors  # noqa: E402

# name -> (gin files, extra flags)
CONFIGS = {
    'quickstart': (['configs/experiments/quickstart.gin'], []),
    'lm_2d': (['configs/experiments/lm_2d.gin'], []),
    'lm_pipeline': (['configs/experiments/lm_pipeline.gin'], []),
    'lm_pipeline_spmd': (['configs/experiments/lm_pipeline_spmd.gin'], []),
    'classifier_tfrecord': (['configs/experiments/classifier_tfrecord.gin'], []),
    'keras': (['my_project/keras.gin'], ['--gin_search_paths=tests/fixtures']),
}
BLOBS = '/tmp/meshgin/blobs'


def _train(name: str, model_dir: str, steps: int) -> subprocess.CompletedProcess:
  gin_files, extra = CONFIGS[name]
  bindings = [f'train.num_steps = {steps}', 'train.log_every = 1', 'train.eval_every = 0',
              f'checkpoint.every_steps = {max(steps // 2, 1)}', 'checkpoint.keep = 5']
  command = [sys.executable, '-m', 'launch.train', f'--model_dir={model_dir}', *extra,
             *[f'--gin_file={f}' for f in gin_files],
             *[f'--gin_bindings={b}' for b in bindings]]
  env = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='2')
  done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env)
  if done.returncode:
    raise SystemExit(f'{name}: exit {done.returncode}\n{done.stderr[-3000:]}')
  return done


def _losses(model_dir: str) -> dict[int, float]:
  return {step: float(value) for step, value in read_tensors(model_dir)['train/loss']}


def record(args) -> None:
  if not os.path.isdir(BLOBS):
    subprocess.run([sys.executable, '-m', 'examples.classifier.write_data',
                    f'--out_dir={BLOBS}'], cwd=REPO_ROOT, check=True)
  trace = {'steps': args.steps, 'work_dir': args.work_dir, 'losses': {}}
  for name in args.configs or CONFIGS:
    model_dir = os.path.join(args.work_dir, name)
    shutil.rmtree(model_dir, ignore_errors=True)
    _train(name, model_dir, args.steps)
    losses = _losses(model_dir)
    trace['losses'][name] = [losses[s] for s in sorted(losses)]
    print(name, trace['losses'][name][:3], '...', flush=True)
  with open(args.out, 'w') as f:
    json.dump(trace, f, indent=1)


def compare(args) -> None:
  with open(args.before) as f:
    before = json.load(f)['losses']
  with open(args.after) as f:
    after = json.load(f)['losses']
  worst = 0
  for name, values in before.items():
    if name not in after:
      print(f'{name:22s} not recorded')
      continue
    same = after[name] == values
    print(f'{name:22s} {"bit-identical" if same else "DIFFERENT"} ({len(values)} losses)')
    if not same:
      worst = 1
      print('  before', values, '\n  after ', after.get(name))
  raise SystemExit(worst)


def resume(args) -> None:
  with open(args.trace) as f:
    trace = json.load(f)
  steps, half = trace['steps'], max(trace['steps'] // 2, 1)
  worst = 0
  for name, values in trace['losses'].items():
    model_dir = os.path.join(args.work_dir, f'{name}_resumed')
    shutil.rmtree(model_dir, ignore_errors=True)
    shutil.copytree(os.path.join(trace['work_dir'], name), model_dir)
    shutil.rmtree(os.path.join(model_dir, 'checkpoints', f'ckpt-{steps}'))
    with open(os.path.join(model_dir, 'checkpoints', 'checkpoint'), 'w') as f:
      f.write(f'model_checkpoint_path: "ckpt-{half}/ckpt"\n')
    for event_file in [n for n in os.listdir(model_dir) if 'tfevents' in n]:
      os.remove(os.path.join(model_dir, event_file))
    done = _train(name, model_dir, steps)
    losses = _losses(model_dir)
    resumed = [losses[s] for s in sorted(losses) if s > half]
    same = resumed == values[half:]
    print(f'{name:22s} resumed at {half}: {"bit-identical" if same else "DIFFERENT"}'
          f' ({"Resumed from" in done.stderr + done.stdout})')
    worst |= not same
  raise SystemExit(int(worst))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest='command', required=True)
  rec = commands.add_parser('record')
  rec.add_argument('--out', required=True)
  rec.add_argument('--steps', type=int, default=20)
  rec.add_argument('--work_dir', default='/tmp/meshgin/loss_trace')
  rec.add_argument('--configs', nargs='*')
  cmp_ = commands.add_parser('compare')
  cmp_.add_argument('before')
  cmp_.add_argument('after')
  res = commands.add_parser('resume')
  res.add_argument('--trace', required=True)
  res.add_argument('--work_dir', default='/tmp/meshgin/loss_trace_resume')
  args = parser.parse_args()
  {'record': record, 'compare': compare, 'resume': resume}[args.command](args)


if __name__ == '__main__':
  main()
