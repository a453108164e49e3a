r"""Why the SPMD engine's circular repeats cost more than their ticks: gradient sums per tick.

bench/suggest.py measured every SPMD layout with 2 circular repeats 1.3-1.6x
slower than the cost model predicted, and slower than the same layout with 1
repeat, though repeats shrink the bubble. This isolates it on lm_small
(stage=2 x data=4, bfloat16, 4 micro-batches: 1 repeat runs 5 ticks of 2
cells, 2 repeats 9 ticks of 1 cell), each in a fresh `launch.train` process
with a TensorFlow profiler trace of 2 steps:

  * median step time;
  * the data axis's gradient sums per step: DTensor all-reduces made for a
    weight's gradient (`gradient_tape/einsum.../DTensorAllReduceOp`, one op
    per device counted once), and the sums DTensor combined after an AddN.

With 1 repeat every tick reads a cell's weights whole, so DTensor moves the
batch's sum past the AddN of their gradients and sums each weight once per
step. With 2 repeats the ticks where the two stages run different repeats
pick their weights by slot masks (`SpmdStack._weights`): the sum cannot move
past a mask, and every tick's weight gradients are summed on their own. The
cost model counts that (`SPMD per-tick sums`).

    python bench/spmd_repeats.py [--out bench/results/spmd_repeats.json]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.calibrate import STEP_LINE  # noqa: E402
from bench.common import RESULTS, read_trace, write_json  # noqa: E402

LAYOUT = ["mesh.shape = {'stage': 2, 'data': 4}", 'layout_rules.rules = []',
          "train.compute_dtype = 'bfloat16'", 'pipeline.num_stages = 2',
          "pipeline.engine = 'spmd'", 'pipeline.num_micro_batches = 4']
PROFILED = 2  # steps


def run(repeats: int, devices: int = 8) -> dict:
  model_dir = tempfile.mkdtemp(prefix='meshgin_spmd_repeats_')
  bindings = LAYOUT + [f'pipeline.circular_repeats = {repeats}', 'train.num_steps = 12',
                       'train.log_every = 1', 'train.eval_every = 0',
                       f'train.profile_steps = (8, {8 + PROFILED})',
                       'checkpoint.every_steps = 0', 'checkpoint.save_at_end = False']
  done = subprocess.run(
      [sys.executable, '-m', 'launch.train', f'--model_dir={model_dir}',
       '--gin_file=configs/runs/train.gin', '--gin_file=configs/models/lm_small.gin',
       *[f'--gin_bindings={b}' for b in bindings]],
      cwd=REPO, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'), capture_output=True,
      text=True, check=False)
  if done.returncode:
    raise RuntimeError(done.stderr[-2000:])
  rates = [float(m.group(2)) for m in STEP_LINE.finditer(done.stderr) if 3 < int(m.group(1)) < 8]
  ops = collections.Counter()
  for plane in read_trace(model_dir).planes:
    names = {k: v.name for k, v in plane.event_metadata.items()}
    for line in plane.lines:
      if line.name.startswith('tf_Compute'):
        for event in line.events:
          name = names.get(event.metadata_id, '')
          if name.endswith(':TensorStridedSliceUpdate') and 'DTensorAllReduceOp/' in name:
            ops['gradient_sums' if '/gradient_tape/' in name else 'other_sums'] += 1
          elif name.endswith(':TensorStridedSliceUpdate') and '/AddN' in name:
            ops['combined_after_addn'] += 1
  return {'repeats': repeats, 'step_seconds': statistics.median(1 / r for r in rates),
          **{k: v / devices / PROFILED for k, v in sorted(ops.items())}}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'spmd_repeats.json'))
  args = parser.parse_args()
  rows = []
  for repeats in (1, 2):
    rows.append(run(repeats))
    print(rows[-1], flush=True)
  write_json({'layout': LAYOUT, 'rows': rows,
              'step_ratio_2_over_1': rows[1]['step_seconds'] / rows[0]['step_seconds']},
             args.out)


if __name__ == '__main__':
  main()
