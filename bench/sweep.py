r"""Sweep overhead: a 4-trial `launch.sweep` vs the same 4 `launch.train` runs in a row.

    python bench/sweep.py [--rounds=2] [--num_steps=4]

Both sides run the identical trial commands (taken from the sweep's own
`Sweep.train_command`), each in a fresh directory, timed in turns (sweep,
serial, sweep, serial, ...) so that load on a shared machine hits both alike.
Also times the sweep with --parallel=2 once per round. Prints the ratios and
writes bench/results/sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import write_json  # noqa: E402
from plugins.sweep import Sweep  # noqa: E402
from plugins.sweep.spec import parse_axis  # noqa: E402


def base_bindings(num_steps: int) -> list[str]:
  return [f'train.num_steps = {num_steps}', 'train.log_every = 2', 'train.eval_every = 0',
          'train.eval_batches = 1', 'checkpoint.every_steps = 0',
          "mesh.shape = {'data': 2}"]


def env() -> dict[str, str]:
  return dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='2')


def timed(command: list[str]) -> tuple[float, int]:
  start = time.perf_counter()
  code = subprocess.run(command, cwd=REPO_ROOT, env=env(), stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL).returncode
  return time.perf_counter() - start, code


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--num_steps', type=int, default=4)
  args = parser.parse_args()
  gin_file = 'configs/experiments/quickstart.gin'
  axis_specs = ['optimizer.learning_rate=[3e-3, 1e-3]', 'train.seed=[0, 1]']
  scratch = tempfile.mkdtemp(prefix='sweep_bench_')
  times = {'sweep': [], 'serial': [], 'sweep_parallel2': []}
  try:
    for round_index in range(args.rounds):
      for side in times:
        root = os.path.join(scratch, f'{side}{round_index}')
        if side == 'serial':
          sweep = Sweep(root=root, gin_files=[gin_file], gin_bindings=base_bindings(
              args.num_steps), axes=[parse_axis(a) for a in axis_specs])
          start = time.perf_counter()
          for trial in sweep.trials():
            _, code = timed(sweep.train_command(trial))
            assert code == 0, trial.name
          seconds = time.perf_counter() - start
        else:
          command = ([sys.executable, '-m', 'launch.sweep', f'--gin_file={gin_file}']
                     + [f'--gin_bindings={b}' for b in base_bindings(args.num_steps)]
                     + [f'--sweep={a}' for a in axis_specs] + [f'--model_dir={root}']
                     + (['--parallel=2'] if side == 'sweep_parallel2' else []))
          seconds, code = timed(command)
          assert code == 0, side
        times[side].append(seconds)
        print(f'round {round_index}: {side:16s} {seconds:7.1f} s', flush=True)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  median = {side: statistics.median(values) for side, values in times.items()}
  result = {
      'trials': 4, 'num_steps': args.num_steps, 'rounds': args.rounds,
      'mesh': "{'data': 2}", 'cpu_count': os.cpu_count(), 'seconds': times,
      'median_seconds': median,
      'sweep_overhead_seconds': median['sweep'] - median['serial'],
      'sweep_over_serial': median['sweep'] / median['serial'],
      'parallel2_over_serial': median['sweep_parallel2'] / median['serial'],
      'load_average_after': os.getloadavg()[0],
  }
  print(json.dumps(result, indent=1))
  write_json(result, os.path.join(REPO_ROOT, 'bench', 'results', 'sweep.json'))


if __name__ == '__main__':
  main()
