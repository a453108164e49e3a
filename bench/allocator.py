"""What the C allocator costs a training run on CPU: glibc's malloc against jemalloc.

TensorFlow makes and frees many small objects while it compiles a step
function (graph nodes, attribute maps, protos), once per device on a
DTensor mesh; with glibc's malloc, a sixth of a test process's CPU samples
were in malloc and free (`perf record` of tests/test_fsdp.py). jemalloc is
a drop-in allocator (Debian's `libjemalloc2`), chosen per process with
`LD_PRELOAD`; `python -m tests.run` preloads it into the suite's processes
where it is installed. The contenders, each `python -m launch.train` of the
quickstart (8 CPU devices) in a fresh process, in turns round after round:

* `glibc malloc`: the process as started;
* `jemalloc`: the same command with `LD_PRELOAD=libjemalloc.so.2`.

Per run: the CPU seconds and wall seconds of the whole process (`wait4`),
the steps/s it logs over its steps, its peak resident memory, and its
losses as TensorBoard recorded them, which must be equal bit for bit: an
allocator changes where bytes live, not a value. Each figure is the best
round's.

    python bench/allocator.py [--rounds 3] [--steps 100]

Results go to bench/results/allocator.json.
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, read_tensors, write_json  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = ('glibc malloc', 'jemalloc')
KEYS = ('cpu_s', 'wall_s', 'peak_rss_mb')


def losses(model_dir: str) -> dict[str, list[str]]:
  """Every loss scalar the run recorded, as exact reprs, by tag."""
  found = {}
  for root, _, names in os.walk(model_dir):
    if any(n.startswith('events.out.tfevents') for n in names):
      for tag, events in read_tensors(root).items():
        if 'loss' in tag:
          found[f'{os.path.relpath(root, model_dir)}/{tag}'] = [repr(v.item()) for _, v in events]
  return found


def train(contender: str, steps: int, jemalloc: str) -> dict:
  """One fresh `launch.train` of the quickstart; its costs and its losses."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  env.pop('LD_PRELOAD', None)
  if contender == 'jemalloc':
    env['LD_PRELOAD'] = jemalloc
  with tempfile.TemporaryDirectory(prefix='allocator-') as model_dir:
    began = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, '-m', 'launch.train',
         '--gin_file=configs/experiments/quickstart.gin', f'--model_dir={model_dir}',
         f'--gin_bindings=train.num_steps = {steps}'],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)  # reaped here, with its rusage
    wall = time.monotonic() - began
    if os.waitstatus_to_exitcode(status):
      raise SystemExit(f'{contender}: launch.train exited {os.waitstatus_to_exitcode(status)}:'
                       f'\n{output[-3000:]}')
    rate = re.search(r'at ([0-9.]+) steps/s', output)
    return {'cpu_s': usage.ru_utime + usage.ru_stime, 'wall_s': wall,
            'peak_rss_mb': usage.ru_maxrss / 1024,
            'steps_per_s': float(rate.group(1)) if rate else None,
            'losses': losses(model_dir)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=100)
  args = parser.parse_args()
  jemalloc = ctypes.util.find_library('jemalloc')
  if jemalloc is None:
    raise SystemExit('jemalloc is not installed: apt-get install libjemalloc2')
  rounds = {name: [] for name in CONTENDERS}
  for number in range(args.rounds):
    for name in CONTENDERS:
      run = train(name, args.steps, jemalloc)
      rounds[name].append(run)
      print(f'round {number + 1} {name:13s} {run["cpu_s"]:6.2f} CPU-s  {run["wall_s"]:6.2f} s '
            f'wall  {run["steps_per_s"]} steps/s  {run["peak_rss_mb"]:.0f} MB', flush=True)
  best = {name: {**{key: min(r[key] for r in runs) for key in KEYS},
                 'steps_per_s': max(r['steps_per_s'] for r in runs)}
          for name, runs in rounds.items()}
  glibc, jem = best['glibc malloc'], best['jemalloc']
  ratios = {'cpu_glibc_over_jemalloc': glibc['cpu_s'] / jem['cpu_s'],
            'wall_glibc_over_jemalloc': glibc['wall_s'] / jem['wall_s'],
            'rate_jemalloc_over_glibc': jem['steps_per_s'] / glibc['steps_per_s'],
            'rss_jemalloc_over_glibc': jem['peak_rss_mb'] / glibc['peak_rss_mb']}
  same = len({repr(sorted(r['losses'].items())) for runs in rounds.values() for r in runs}) == 1
  recorded = sum(len(v) for v in rounds['glibc malloc'][0]['losses'].values())
  print(f'CPU {ratios["cpu_glibc_over_jemalloc"]:.2f}x with glibc, wall '
        f'{ratios["wall_glibc_over_jemalloc"]:.2f}x, steps/s '
        f'{ratios["rate_jemalloc_over_glibc"]:.2f}x with jemalloc, peak memory '
        f'{ratios["rss_jemalloc_over_glibc"]:.2f}x; {recorded} losses equal bit for bit: {same}')
  write_json({'steps': args.steps, 'best': best, 'ratios': ratios, 'same_losses': same,
              'losses_compared': recorded,
              'rounds': {n: [{k: v for k, v in r.items() if k != 'losses'} for r in runs]
                         for n, runs in rounds.items()}},
             os.path.join(RESULTS, 'allocator.json'))


if __name__ == '__main__':
  main()
