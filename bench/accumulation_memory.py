r"""Does gradient accumulation lower a CPU run's peak memory? (measured, with variations)

bench/suggest.py saw the peak grow with `train.grad_accum_steps` in every layout
it trained. This isolates it: bench/memory.py's quickstart LM at width 768
(bfloat16, batch 32 x 64 tokens, 8 virtual CPU devices), trained for 8 steps
in a fresh `launch.train` process per run, at 1, 2 and 4 micro-steps, under

  * data=8, replicated state (the plain data-parallel run);
  * data=4 x model=2, ZeRO-1 (where bench/suggest.py saw it most);
  * data=8 with one inter-op thread (TF_NUM_INTEROP_THREADS=1): if the
    micro-steps' work overlapped in time, this would serialise it.

Reported: each run's peak resident memory (`wait4`) and median step time,
and the peak at k micro-steps over the peak at 1.

    python bench/accumulation_memory.py [--out bench/results/accumulation_memory.json]
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import RESULTS, write_json  # noqa: E402

MODEL = ['transformer_lm.model_dim = 768', 'transformer_lm.ffn_dim = 3072',
         "train.compute_dtype = 'bfloat16'"]
SETTINGS = {
    'data=8': (["mesh.shape = {'data': 8}", 'optimizer.shard_state = False'], {}),
    'data=4 x model=2, ZeRO-1': (["mesh.shape = {'data': 4, 'model': 2}",
                                  "include_megatron", 'optimizer.shard_state = True'], {}),
    'data=8, one inter-op thread': (["mesh.shape = {'data': 8}", 'optimizer.shard_state = False'],
                                    {'TF_NUM_INTEROP_THREADS': '1'}),
}
STEPS = (1, 2, 4)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'accumulation_memory.json'))
  args = parser.parse_args()
  from plugins.suggest.measure import measure  # pylint: disable=import-outside-toplevel
  from plugins.suggest.planner import megatron_binding  # pylint: disable=import-outside-toplevel
  rows = []
  for name, (bindings, env) in SETTINGS.items():
    bindings = [megatron_binding() if b == 'include_megatron' else b for b in bindings]
    for k in STEPS:
      trial = measure(files=['configs/experiments/quickstart.gin'], bindings=MODEL,
                      candidate_bindings=bindings + [f'train.grad_accum_steps = {k}'],
                      steps=8, warmup=3, kill_above=12 * 2**30,
                      env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', **env})
      rows.append({'setting': name, 'micro_steps': k, 'ok': trial.ok,
                   'peak_bytes': trial.peak_bytes, 'step_seconds': trial.step_seconds,
                   'error': trial.error})
      print(f'{name}, {k} micro-steps: peak {trial.peak_bytes / 2**30:.2f} GiB, '
            f'{trial.step_seconds * 1e3:.0f} ms/step', flush=True)
  for row in rows:
    first = next(r for r in rows if r['setting'] == row['setting'] and r['micro_steps'] == 1)
    row['peak_over_one'] = row['peak_bytes'] / first['peak_bytes'] if first['ok'] else None
  write_json(rows, args.out)


if __name__ == '__main__':
  main()
