r"""Benchmark: peak memory of the "fit bigger models" settings, measured vs predicted.

For one LM (quickstart's Markov task, 2 blocks, ffn = 4 x width, batch 32 x 64
tokens, data-parallel on 8 virtual CPU devices), each setting

    float32 | bf16 | bf16 + remat 'block' | bf16 + remat + sharded optimizer state
    | fully sharded parameters (FSDP) | bf16 + remat + FSDP

trains `--steps` steps in a fresh `python -m launch.train` subprocess (its own
temporary model_dir, no checkpoints). Measured: the child's peak RSS
(`os.wait4`'s ru_maxrss; the run is killed, and counts as not fitting, as soon
as its RSS passes `--budget_gib`) and its steps/s. Side by side, in one run:

  * at `--width`: measured peak vs `launch.inspect`'s predicted host peak
    (ratio), and steps/s of each setting vs float32;
  * the largest width (multiples of 64) that trains within the budget: width
    doubling from 256, then `--bisect` halvings of the gap; parameter counts and
    the full combination's largest model vs float32's (parameter ratio).

A setting the build does not support (exit 2, e.g. `optimizer.shard_state`
before it is merged) is reported as failed with its error, and the rest go on.

    python bench/memory.py [--quick] [--budget_gib 4] [--out bench/results/memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from bench.common import write_json  # noqa: E402
BF16 = ["train.compute_dtype = 'bfloat16'"]
WHOLE_STATE = ['optimizer.shard_state = False']  # not 'auto': these settings compare with zero
SETTINGS = {
    'float32': WHOLE_STATE,
    'bf16': BF16 + WHOLE_STATE,
    'bf16+remat': BF16 + ["train.remat = 'block'"] + WHOLE_STATE,
    'bf16+remat+zero': BF16 + ["train.remat = 'block'", 'optimizer.shard_state = True'],
    'fsdp': ['train.fsdp = True'],
    'bf16+remat+fsdp': BF16 + ["train.remat = 'block'", 'train.fsdp = True'],
}
ENV = dict(os.environ, PYTHONPATH=REPO_ROOT, TF_CPP_MIN_LOG_LEVEL='2')


def lm_bindings(width: int, steps: int) -> list[str]:
  return [f'transformer_lm.model_dim = {width}', f'transformer_lm.ffn_dim = {4 * width}',
          f'train.num_steps = {steps}', 'train.log_every = 1', 'train.eval_every = 0',
          'train.eval_batches = 1', 'checkpoint.every_steps = 0',
          'checkpoint.save_at_end = False']


def flags(bindings: list[str], gin_file: str = 'configs/experiments/quickstart.gin'
          ) -> list[str]:
  return [f'--gin_file={gin_file}', *[f'--gin_bindings={b}' for b in bindings]]


def train(bindings: list[str], *, budget: int,
          gin_file: str = 'configs/experiments/quickstart.gin') -> dict:
  """One launch.train child of `gin_file` and `bindings`: {ok, fits,
  peak_bytes, steps_per_sec, seconds, error}."""
  from plugins.suggest.measure import error_line, watch  # pylint: disable=import-outside-toplevel
  model_dir = tempfile.mkdtemp(prefix='meshgin_mem_')
  child = watch([sys.executable, '-m', 'launch.train', f'--model_dir={model_dir}',
                 *flags(bindings, gin_file)], env=ENV, kill_above=budget, cwd=REPO_ROOT)
  rate = 0.0
  try:
    with open(os.path.join(model_dir, 'run_status.json')) as f:
      rate = float(json.load(f).get('metrics', {}).get('steps_per_sec', 0.0))
  except (OSError, ValueError):
    pass
  shutil.rmtree(model_dir, ignore_errors=True)
  code, over, peak = child.exit_code, child.killed_over, child.peak_bytes
  return {'ok': code == 0, 'fits': code == 0 and not over and peak <= budget,
          'killed_over_budget': over, 'exit': code, 'peak_bytes': peak,
          'steps_per_sec': rate, 'seconds': child.seconds,
          'error': error_line(child.stderr) if code and not over else ''}


def inspect(bindings: list[str]) -> dict:
  """launch.inspect's predicted host peak and parameter count."""
  done = subprocess.run([sys.executable, '-m', 'launch.inspect', '--max_rows=1',
                         *flags(bindings)], cwd=REPO_ROOT, env=ENV, capture_output=True,
                        text=True)
  if done.returncode:
    return {'predicted_bytes': None, 'parameters': None}
  peak = re.search(r'Host process peak[^:]*:[^:]*: ([\d.,]+) GiB', done.stdout)
  params = re.search(r'Parameters: ([\d,]+)', done.stdout)
  return {'predicted_bytes': float(peak.group(1).replace(',', '')) * 2**30 if peak else None,
          'parameters': int(params.group(1).replace(',', '')) if params else None}


def components(bindings: list[str]) -> dict:
  """The estimator's totals (all devices) for the quickstart LM with `bindings`,
  computed in this process (no TensorFlow: the plan and the memory model)."""
  sys.path.insert(0, REPO_ROOT)
  from plugins import gin_setup, plan as plan_lib, report  # pylint: disable=g-import-not-at-top
  with gin_setup.parsed_config(files=['configs/experiments/quickstart.gin'], bindings=bindings,
                               search_paths=[]):
    estimate = report.plan_memory(plan_lib.make_plan())
  return {'layers': estimate.num_layers, **estimate.total, 'host_peak': estimate.host_peak}


FIT_GRID = [(name, width, layers) for name in SETTINGS for width, layers in
            ((256, 2), (768, 2), (384, 6))] + [('float32', 1024, 2), ('float32', 128, 8)]


def fit(steps: int) -> dict:
  """Measured peak RSS of a grid of runs and the least-squares host model
  peak = base + per_layer x leaf layers + state_factor x (parameters +
  optimizer + gradients) + copies_factor x weight copies + activation_factor
  x activations (the constants of layout_core/train/memory.py)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  rows = []
  for name, width, layers in FIT_GRID:
    bindings = SETTINGS[name] + lm_bindings(width, steps) + [
        f'transformer_lm.num_layers = {layers}']
    parts = components(bindings)
    run = train(bindings, budget=2**62)
    rows.append({'setting': name, 'width': width, 'layers': layers, **parts,
                 'measured': run['peak_bytes'], 'ok': run['ok']})
    print(f'  {name:16s} width {width:4d} x {layers} layers: measured '
          f'{run["peak_bytes"] / 2**30:.3f} GiB, model now {parts["host_peak"] / 2**30:.3f}',
          flush=True)
  good = [r for r in rows if r['ok']]
  features = np.array([[1.0, r['layers'], r['parameters'] + r['optimizer'] + r['gradients'],
                        r.get('weight copies', 0), r.get('activations', 0)] for r in good])
  measured = np.array([r['measured'] for r in good], dtype=float)
  coefficients, *_ = np.linalg.lstsq(features, measured, rcond=None)
  predicted = features @ coefficients
  for r, p in zip(good, predicted):
    r['fitted'] = float(p)
  names = ['base_bytes', 'per_layer_bytes', 'state_factor', 'copies_factor',
           'activation_factor']
  result = {'coefficients': dict(zip(names, map(float, coefficients))), 'runs': rows,
            'worst_fit_ratio': float(max(abs(p / m - 1) for p, m in zip(predicted, measured)))}
  print('fit: ' + ', '.join(f'{k} {v / 2**20 if k.endswith("bytes") else v:.3f}'
                            f'{" MiB" if k.endswith("bytes") else ""}'
                            for k, v in result['coefficients'].items())
        + f'; worst |fitted / measured - 1| {result["worst_fit_ratio"]:.3f}')
  return result


def largest(setting: list[str], *, budget: int, steps: int, bisect: int, start: int,
            cache: dict, bindings_of=lm_bindings, gin_file: str | None = None
            ) -> tuple[int | None, dict]:
  """The largest width (multiple of 64) within budget: doubling, then
  bisection. `bindings_of(width, steps)`: the model's bindings at a width."""
  def fits(width):
    key = (tuple(setting), width)
    if key not in cache:
      cache[key] = train(setting + bindings_of(width, steps), budget=budget,
                         **({'gin_file': gin_file} if gin_file else {}))
      print(f'    width {width}: {"fits" if cache[key]["fits"] else "no"} '
            f'({cache[key]["peak_bytes"] / 2**30:.2f} GiB, {cache[key]["seconds"]:.0f} s)',
            flush=True)
    return cache[key]['fits']
  good = bad = None
  width = start
  while True:
    if fits(width):
      good = width
      if bad is not None:
        break
      width *= 2
    else:
      bad = width
      if good is not None:
        break
      width //= 2
      if width < 64:
        return None, {}
  for _ in range(bisect):
    middle = (good + bad) // 2 // 64 * 64
    if middle in (good, bad):
      break
    good, bad = (middle, bad) if fits(middle) else (good, middle)
  return good, cache[(tuple(setting), good)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true',
                      help='smoke run: width 128 side by side only, no largest-model search')
  parser.add_argument('--budget_gib', type=float, default=4.0)
  parser.add_argument('--width', type=int, default=512, help='the width compared side by side')
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--bisect', type=int, default=1)
  parser.add_argument('--settings', nargs='*', default=list(SETTINGS))
  parser.add_argument('--search', nargs='*', default=None,
                      help='settings whose largest model is searched (default: all of --settings)')
  parser.add_argument('--fit', action='store_true',
                      help='refit the host-memory model of layout_core/train/memory.py '
                           'on a grid of runs (writes bench/results/memory_fit.json)')
  parser.add_argument('--out', default=os.path.join(REPO_ROOT, 'bench', 'results', 'memory.json'))
  args = parser.parse_args()
  if args.fit:
    result = fit(args.steps)
    out = os.path.join(os.path.dirname(args.out), 'memory_fit.json')
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_json(result, out)
    print(f'wrote {out}')
    return
  if args.quick:
    args.width = 128
  budget = int(args.budget_gib * 2**30)
  start = min(256, args.width)
  cache: dict = {}
  results = {'budget_gib': args.budget_gib, 'width': args.width, 'steps': args.steps,
             'settings': {}}
  print(f'LM: 2 blocks, ffn 4 x width, batch 32 x 64 tokens, 8 CPU devices (data), '
        f'{args.steps} steps; budget {args.budget_gib} GiB', flush=True)
  for name in args.settings:
    setting = SETTINGS[name]
    print(f'{name}:', flush=True)
    at_width = train(setting + lm_bindings(args.width, args.steps), budget=2**62)
    cache[(tuple(setting), args.width)] = dict(at_width, fits=at_width['fits']
                                               and at_width['peak_bytes'] <= budget)
    predicted = inspect(setting + lm_bindings(args.width, args.steps))
    entry = {'bindings': setting, 'at_width': at_width, **predicted}
    if not at_width['ok']:
      print(f'  FAILED (exit {at_width["exit"]}): {at_width["error"]}', flush=True)
      results['settings'][name] = entry
      continue
    if args.quick or (args.search is not None and name not in args.search):
      results['settings'][name] = entry
      continue
    width, run = largest(setting, budget=budget, steps=args.steps, bisect=args.bisect,
                         start=start, cache=cache)
    entry['largest_width'] = width
    entry['largest_parameters'] = inspect(setting + lm_bindings(width, args.steps))[
        'parameters'] if width else None
    entry['largest_run'] = run
    results['settings'][name] = entry
  report(results)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  write_json(results, args.out)
  print(f'wrote {args.out}')


def report(results: dict) -> None:
  settings = results['settings']
  base = settings.get('float32', {})
  base_rate = base.get('at_width', {}).get('steps_per_sec') or 0
  base_params = base.get('largest_parameters')
  print(f'\nat width {results["width"]}:')
  print(f'{"setting":18s} {"measured GiB":>12s} {"predicted GiB":>13s} {"pred/meas":>9s} '
        f'{"steps/s":>8s} {"vs f32":>7s} {"largest width":>13s} {"params":>12s} '
        f'{"vs f32":>7s}')
  for name, e in settings.items():
    run = e['at_width']
    if not run['ok']:
      print(f'{name:18s} FAILED: {run["error"][:100]}')
      continue
    meas, pred = run['peak_bytes'], e.get('predicted_bytes')
    rate = run['steps_per_sec']
    params = e.get('largest_parameters')
    print(f'{name:18s} {meas / 2**30:12.3f} {pred / 2**30 if pred else float("nan"):13.3f} '
          f'{pred / meas if pred else float("nan"):9.3f} {rate:8.2f} '
          f'{rate / base_rate if base_rate else float("nan"):7.2f} '
          f'{e.get("largest_width") or "-":>13} {params or 0:12,d} '
          f'{params / base_params if params and base_params else float("nan"):7.2f}')
  print('(a setting that measures the same as float32 may not be implemented in this build)')


if __name__ == '__main__':
  main()
