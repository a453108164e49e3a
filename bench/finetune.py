r"""Benchmark: full fine-tuning vs LoRA in one host-memory budget.

The LM of bench/memory.py (quickstart's Markov task, 2 blocks, ffn = 4 x
width, batch 32 x 64 tokens, data-parallel on 8 virtual CPU devices, float32,
optimizer state whole) trains `--steps` steps in a fresh `launch.train`
child, in two settings side by side:

    full   every weight trains (gradients and Adam's two moments for all)
    lora   the base frozen; rank-8 adapters on attention's queries and values
           (`lora.rank = 8`, `lora.targets = [r'.*/attn/w[qv]']`)
    lora_bf16, lora_int8   the same with the base stored in bfloat16, or in
           int8 with a float32 scale per output channel (`train.frozen_dtype`)

Measured: at `--width`, each child's peak RSS, steps/s and trainable
parameters; the LoRA settings' speed again in turns (`--rounds` rounds of
`SPEED_STEPS` steps each, the best steps/s of the last half of each run;
a 3-step child's rate is one step's and noisy); then the largest width (multiples of 64) each trains within
`--budget_gib` (doubling from its `START` width, then bisection, as
bench/memory.py searches), and the ratio of each LoRA setting's largest
model's parameter count to full fine-tuning's (goals: at least 3x for
LoRA, 20x with a narrow base), and each narrow base's steps/s against the
float32 base's.

    python bench/finetune.py [--quick] [--budget_gib 4] [--out bench/results/finetune.json]
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import write_json  # noqa: E402
from bench.memory import WHOLE_STATE, inspect, largest, lm_bindings, train  # noqa: E402

RANK = 8
_LORA = WHOLE_STATE + [f'lora.rank = {RANK}', "lora.targets = [r'.*/attn/w[qv]']"]
SETTINGS = {
    'full': WHOLE_STATE,
    'lora': _LORA,
    'lora_bf16': _LORA + ["train.frozen_dtype = 'bfloat16'"],
    'lora_int8': _LORA + ["train.frozen_dtype = 'int8'"],
}
SPEED_STEPS = 12  # per child of the speed comparison; the rate is of its last 6 steps
# Where each search starts doubling (near the largest measured before: fewer children).
START = {'full': 512, 'lora': 1024, 'lora_bf16': 1536, 'lora_int8': 2048}


def trainable(bindings: list[str]) -> int:
  """Parameters that train with `bindings`, from the plan's model (no TensorFlow)."""
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=g-import-not-at-top
  with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'], bindings=bindings,
                               search_paths=[]):
    params = plan_lib.make_plan().params
  return sum(s.num_elements for s in params.cls.variable_specs(params) if s.trainable)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true',
                      help='smoke run: width 128 side by side only, no largest-model search')
  parser.add_argument('--budget_gib', type=float, default=4.0)
  parser.add_argument('--width', type=int, default=1024, help='the width compared side by side')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--bisect', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=2, help='turns of the speed comparison')
  parser.add_argument('--out', default=os.path.join(REPO_ROOT, 'bench', 'results',
                                                    'finetune.json'))
  args = parser.parse_args()
  if args.quick:
    args.width = 128
  budget = int(args.budget_gib * 2**30)
  results = {'budget_gib': args.budget_gib, 'width': args.width, 'steps': args.steps,
             'rank': RANK, 'settings': {}}
  print(f'LM: 2 blocks, ffn 4 x width, batch 32 x 64 tokens, 8 CPU devices (data), float32, '
        f'{args.steps} steps; budget {args.budget_gib} GiB', flush=True)
  cache: dict = {}
  for name, setting in SETTINGS.items():
    run = train(setting + lm_bindings(args.width, args.steps), budget=2**62)
    cache[(tuple(setting), args.width)] = dict(run, fits=run['fits']
                                               and run['peak_bytes'] <= budget)
    entry = {'bindings': setting, 'at_width': run,
             'parameters': inspect(setting + lm_bindings(args.width, args.steps))['parameters']}
    entry['trainable'] = trainable(setting + lm_bindings(args.width, args.steps))
    print(f'{name}: width {args.width}: {run["peak_bytes"] / 2**30:.2f} GiB, '
          f'{run["steps_per_sec"]:.2f} steps/s, {entry["trainable"]:,} of '
          f'{entry["parameters"]:,} parameters trained', flush=True)
    if not args.quick and run['ok']:
      width, _ = largest(setting, budget=budget, steps=args.steps, bisect=args.bisect,
                         start=START[name], cache=cache)
      entry['largest_width'] = width
      entry['largest_parameters'] = (inspect(setting + lm_bindings(width, args.steps))[
          'parameters'] if width else None)
      # Each width the search tried, and its peak: a width within a few MiB of
      # the budget fits in one run and not the next, and moves every ratio.
      entry['searched_peak_bytes'] = {
          str(w): run['peak_bytes'] for (s, w), run in sorted(cache.items())
          if s == tuple(setting) and w != args.width}
    results['settings'][name] = entry
  speed = {name: 0.0 for name in ('lora', 'lora_bf16', 'lora_int8')}
  for number in range(args.rounds):
    for name in speed:
      run = train(SETTINGS[name] + lm_bindings(args.width, SPEED_STEPS)
                  + [f'train.log_every = {SPEED_STEPS // 2}'], budget=2**62)
      speed[name] = max(speed[name], run['steps_per_sec'])
      print(f'  speed round {number + 1} {name}: {run["steps_per_sec"]:.3f} steps/s', flush=True)
  results['steps_per_sec_in_turns'] = speed
  full = results['settings']['full']
  for name in ('lora', 'lora_bf16', 'lora_int8'):
    tuned = results['settings'][name]
    results[f'peak_full / peak_{name}'] = (full['at_width']['peak_bytes']
                                           / max(tuned['at_width']['peak_bytes'], 1))
    results[f'steps_{name} / steps_full'] = (tuned['at_width']['steps_per_sec']
                                             / max(full['at_width']['steps_per_sec'], 1e-9))
    if full.get('largest_parameters') and tuned.get('largest_parameters'):
      results[f'largest_{name} / largest_full'] = (tuned['largest_parameters']
                                                   / full['largest_parameters'])
  lora = results['settings']['lora']
  for name in ('lora_bf16', 'lora_int8'):
    narrow = results['settings'][name]
    results[f'steps_{name} / steps_lora'] = speed[name] / max(speed['lora'], 1e-9)
    results[f'peak_{name} / peak_lora'] = (narrow['at_width']['peak_bytes']
                                           / max(lora['at_width']['peak_bytes'], 1))
  print(f'\nat width {args.width}:')
  for name in ('lora', 'lora_bf16', 'lora_int8'):
    print(f"  {name}: full / {name} peak memory {results[f'peak_full / peak_{name}']:.2f}x, "
          f"{name} / full steps/s {results[f'steps_{name} / steps_full']:.2f}x")
  for name in ('lora_bf16', 'lora_int8'):
    print(f"  {name} against the float32 base: steps/s "
          f"{results[f'steps_{name} / steps_lora']:.2f}x, peak "
          f"{results[f'peak_{name} / peak_lora']:.2f}x")
  for name in ('lora', 'lora_bf16', 'lora_int8'):
    key = f'largest_{name} / largest_full'
    if key in results:
      tuned = results['settings'][name]
      print(f"largest in {args.budget_gib} GiB: full width {full['largest_width']} "
            f"({full['largest_parameters']:,} parameters), {name} width "
            f"{tuned['largest_width']} ({tuned['largest_parameters']:,}): "
            f"{results[key]:.2f}x (goal {3 if name == 'lora' else 20}x)")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  write_json(results, args.out)


if __name__ == '__main__':
  main()
