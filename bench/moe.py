r"""Benchmark: a mixture-of-experts LM with and without expert parallelism.

quickstart's LM (Markov task, 2 blocks, batch 32 x 64 tokens, float32, 8
virtual CPU devices, optimizer state whole) with each block's feed-forward
layer routed: 8 experts of width 2 x model_dim, 2 per token (ReLU MLP
experts, Mixtral's renormalised top-2, no token dropped). Three settings,
each a fresh `launch.train` child:

    expert=8     mesh {'expert': 8}, the batch and the experts split over it
                 (GShard: configs/layouts/moe_expert.gin, train.batch_axis =
                 'expert'); each device holds 1 expert of every MoE layer
    replicated   mesh {'data': 8}, every expert on every device
    dense        the same LM without routing, ffn_dim = 4 x model_dim: the
                 MoE's active parameters per token (2 experts x 2 x model_dim)

Measured: the expert weights and their Adam state per device, from the
layouts (goal: expert=8 holds 1/8 of replicated, within 10%); steps/s at
`--width` in turns (`--rounds` rounds of `SPEED_STEPS` steps, each child's
rate over the last half of its run, the best per setting); and the largest
width (multiple of 64) each MoE setting trains within `--budget_gib` per
process (bench/memory.py's search), with its parameter count.

    python bench/moe.py [--quick] [--width 256] [--budget_gib 4] [--out bench/results/moe.json]
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import write_json  # noqa: E402
from bench.memory import WHOLE_STATE, inspect, largest, lm_bindings, train  # noqa: E402

EXPERTS, PER_TOKEN = 8, 2
ROUTED = ['transformer_lm.moe = @moe_feed_forward()',
          f'moe_feed_forward.num_experts = {EXPERTS}',
          f'moe_feed_forward.experts_per_token = {PER_TOKEN}',
          "moe_feed_forward.kind = 'mlp'", "moe_feed_forward.activation = 'relu'"]
SETTINGS = {
    'expert=8': WHOLE_STATE + ROUTED + [
        "mesh.shape = {'expert': 8}", "train.batch_axis = 'expert'",
        "layout_rules.rules = [(r'.*/moe/w_(in|out)', ('expert', 'unsharded', 'unsharded'))]"],
    'replicated': WHOLE_STATE + ROUTED,
    'dense': WHOLE_STATE,
}
SPEED_STEPS = 12
START = {'expert=8': 512, 'replicated': 256}


def bindings_of(width: int, steps: int) -> list[str]:
  """quickstart's LM at `width`, its experts 2 x width wide (the dense
  setting's ffn_dim 4 x width is the active width of 2 of them)."""
  return lm_bindings(width, steps) + [f'moe_feed_forward.expert_dim = {2 * width}']


def expert_bytes_per_device(setting: list[str], width: int) -> int:
  """The expert weights' bytes per device, with Adam's two moments (whole state)."""
  from layout_core.layout import scope  # pylint: disable=import-outside-toplevel
  from layout_core.model import moe  # pylint: disable=import-outside-toplevel
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=import-outside-toplevel
  with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'],
                               bindings=setting + bindings_of(width, 1), search_paths=[]):
    records = plan_lib.make_plan().records
  experts = [r for r in records if moe.is_expert_weight(r.path)]
  return 3 * scope.bytes_per_device(experts)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true',
                      help='smoke run: width 64, one round, no largest-model search')
  parser.add_argument('--width', type=int, default=256, help='the width compared side by side')
  parser.add_argument('--budget_gib', type=float, default=4.0)
  parser.add_argument('--steps', type=int, default=3, help='steps of each search child')
  parser.add_argument('--bisect', type=int, default=2)
  parser.add_argument('--rounds', type=int, default=3, help='turns of the speed comparison')
  parser.add_argument('--out', default=os.path.join(REPO_ROOT, 'bench', 'results', 'moe.json'))
  args = parser.parse_args()
  if args.quick:
    args.width, args.rounds = 64, 1
  budget = int(args.budget_gib * 2**30)
  print(f'LM: 2 blocks, {EXPERTS} experts of 2 x width, top-{PER_TOKEN}, batch 32 x 64 tokens, '
        f'8 CPU devices, float32; width {args.width}; budget {args.budget_gib} GiB', flush=True)
  results = {'width': args.width, 'budget_gib': args.budget_gib, 'experts': EXPERTS,
             'experts_per_token': PER_TOKEN, 'settings': {}}
  for name, setting in SETTINGS.items():
    entry = {'bindings': setting,
             'parameters': inspect(setting + bindings_of(args.width, 1))['parameters']}
    if name != 'dense':
      entry['expert_bytes_per_device'] = expert_bytes_per_device(setting, args.width)
    results['settings'][name] = entry
  ep, rep = (results['settings'][n]['expert_bytes_per_device'] for n in ('expert=8',
                                                                          'replicated'))
  results['expert_bytes: expert=8 / replicated'] = ep / rep
  print(f'expert weights + Adam state per device: expert=8 {ep / 2**20:.2f} MiB, replicated '
        f'{rep / 2**20:.2f} MiB: {ep / rep:.4f}x (goal 1/8 = 0.125, within 10%)', flush=True)

  speed = {name: 0.0 for name in SETTINGS}
  peaks = {name: 0 for name in SETTINGS}
  for number in range(args.rounds):
    for name, setting in SETTINGS.items():
      run = train(setting + bindings_of(args.width, SPEED_STEPS)
                  + [f'train.log_every = {SPEED_STEPS // 2}'], budget=2**62)
      if not run['ok']:
        raise SystemExit(f'{name} failed: {run["error"]}')
      speed[name] = max(speed[name], run['steps_per_sec'])
      peaks[name] = max(peaks[name], run['peak_bytes'])
      print(f'  round {number + 1} {name:10s} {run["steps_per_sec"]:.3f} steps/s, peak '
            f'{run["peak_bytes"] / 2**30:.2f} GiB', flush=True)
  results['steps_per_sec_in_turns'] = speed
  results['peak_bytes_at_width'] = peaks
  for name in ('replicated', 'dense'):
    results[f'steps: expert=8 / {name}'] = speed['expert=8'] / max(speed[name], 1e-9)
    print(f"expert=8 / {name} steps/s: {results[f'steps: expert=8 / {name}']:.2f}x")

  if not args.quick:
    cache: dict = {}
    for name in ('expert=8', 'replicated'):
      width, _ = largest(SETTINGS[name], budget=budget, steps=args.steps, bisect=args.bisect,
                         start=START[name], cache=cache, bindings_of=bindings_of)
      entry = results['settings'][name]
      entry['largest_width'] = width
      entry['largest_parameters'] = (inspect(SETTINGS[name] + bindings_of(width, 1))[
          'parameters'] if width else None)
      print(f'largest in {args.budget_gib} GiB: {name} width {width} '
            f'({entry["largest_parameters"] or 0:,} parameters)', flush=True)
    ep, rep = (results['settings'][n].get('largest_parameters') for n in ('expert=8',
                                                                         'replicated'))
    if ep and rep:
      results['largest: expert=8 / replicated'] = ep / rep
      print(f'largest model: expert=8 / replicated {ep / rep:.2f}x')
  write_json(results, args.out)


if __name__ == '__main__':
  main()
