r"""Benchmark: the layout suggester against the ground truth, every fitting candidate run.

For each model (lm_small, and bench/memory.py's wide quickstart LM at width
768, near this machine's 4 GiB ceiling; apart, lm_moe: bench/moe.py's routed
LM, 8 experts top-2, whose candidates also split the experts) on 8 virtual
CPU devices, and each budget of 1, 2 and 4 GiB per process, in two passes:

  1. the suggester's search with no memory margin (in this process, no
     TensorFlow): each layout with its fastest settings that fit by the
     estimate; every one of them trains a few steps in its own `launch.train`
     process (`plugins/suggest/measure.py`), several times (`trials`): the
     median of the runs' median step times, the highest peak resident
     memory. Their errors
     (measured peak / estimate - 1), worst per layout family (pipeline
     engine x state split), are the margins the suggester keeps
     (`memory_margins`, read by `launch.inspect --suggest`);
  2. the search as shipped, with those margins: its candidates (new ones
     trained too) against the ground truth, every candidate of either pass
     whose measured peak fits the budget; and the hand-written layouts of
     configs/experiments/ (quickstart's data=8, lm_2d's 2 x 4 Megatron,
     lm_pipeline's and lm_pipeline_spmd's pipelines) on the same model.

Reported per model and budget: whether the suggestion fits (measured peak <=
budget); its measured step time over the fastest fitting candidate's (<=
1.1); Spearman's rank correlation of predicted and measured step times over
the candidates of pass 2 (>= 0.8), and of the measurement with itself (the
median of odd-numbered trials against even-numbered ones); its step time
over each hand-written layout's that fits (<= 1); where nothing fits, the
smallest budget it names.
Also timed: `--suggest` on the 100B-parameter inspect config on 1,024
devices (no device touched). A candidate shared by budgets or passes trains once.

    python bench/suggest.py [--models lm_small lm_wide] [--reuse]
                            [--out bench/results/suggest.json]
    python bench/suggest.py --models lm_moe     # -> bench/results/suggest_moe.json
    python bench/suggest.py --estimate          # how long the trials would take here

It first prints how long each model's trials will take by the cost model's
own prediction. On a 2-core EPYC with AVX-512 the dense models' trials took
66 minutes and lm_moe's 39, where that machine's calibration predicts 106
and 53. On one with AVX2 alone, where a bfloat16 step takes 13x a float32
one and the tighter budgets fit only bfloat16 candidates, its calibration
predicts 159 (lm_small), 387 (lm_wide) and 344 (lm_moe): over 9 hours, even
at the AVX-512 machine's over-prediction.

--reuse keeps the trials of an earlier results file (or of a run that
stopped: bench/results/.suggest.partial.json) whose bindings match, where
they were measured on a machine like this one (processor, cores, vector
extensions, TensorFlow).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import MEGATRON, RESULTS, with_megatron, write_json  # noqa: E402

GIB = 2**30
STEPS, WARMUP = 8, 3  # each trial's timed steps, after its warm-up ones
START_UP_S = 25  # a trial's process start-up and first compile, for --estimate
BUDGETS_GIB = (1, 2, 4)
# `trials`: processes per candidate, its step time their median. One
# process's figure varies by 10-15%; lm_small's candidates lie within a few
# percent of each other, where 2 trials each ranked them only 0.77 alike
# twice over (Spearman of trial 1 against trial 2), lm_wide's 0.98.
MODELS = {
    'lm_small': dict(files=['configs/runs/train.gin', 'configs/models/lm_small.gin'],
                     bindings=[], trials=4),
    'lm_wide': dict(files=['configs/experiments/quickstart.gin'],
                    bindings=['transformer_lm.model_dim = 768',
                              'transformer_lm.ffn_dim = 3072'], trials=2),
    # bench/moe.py's model: quickstart's LM at width 256, every block routed
    # to 8 experts of 2 x width (top-2). Its candidates also split the
    # experts (over data, or an expert axis of their own); its hand-written
    # layouts are the shipped MoE ones. Results apart (--out, below).
    'lm_moe': dict(files=['configs/experiments/quickstart.gin'],
                   bindings=['transformer_lm.model_dim = 256', 'transformer_lm.ffn_dim = 1024',
                             'transformer_lm.moe = @moe_feed_forward()',
                             'moe_feed_forward.num_experts = 8',
                             'moe_feed_forward.experts_per_token = 2',
                             'moe_feed_forward.expert_dim = 512',
                             "moe_feed_forward.kind = 'mlp'",
                             "moe_feed_forward.activation = 'relu'"], trials=2,
                   hand_written='moe'),
}
MOE_RESULTS = 'suggest_moe.json'  # lm_moe's file: suggest.json keeps the dense models'
# margins, which launch.inspect --suggest reads
# The layouts of configs/experiments/, as bindings on any LM (their settings:
# float32, no remat, no accumulation); for a routed LM, the shipped MoE layouts.
EXPERTS = "layout_rules.rules = [(r'.*/moe/w_(in|out)', ('{}', 'unsharded', 'unsharded'))]"
HAND_WRITTEN_MOE = {
    'moe_tiny (expert=4 x data=2)': ["mesh.shape = {'expert': 4, 'data': 2}",
                                     "train.batch_axis = 'data'", EXPERTS.format('expert')],
    'GShard (data=8, experts over data)': ["mesh.shape = {'data': 8}", EXPERTS.format('data')],
}
HAND_WRITTEN = {
    'quickstart (data=8)': ["mesh.shape = {'data': 8}", 'layout_rules.rules = []'],
    'lm_2d (data=2 x model=4, Megatron)': ["mesh.shape = {'data': 2, 'model': 4}", MEGATRON],
    'lm_pipeline (stage=2 x data=2 x model=2, submesh, 4 micro-batches)': [
        "mesh.shape = {'stage': 2, 'data': 2, 'model': 2}",
        MEGATRON, 'pipeline.num_stages = 2',
        'pipeline.num_micro_batches = 4'],
    'lm_pipeline_spmd (stage=2 x data=2 x model=2, spmd, 4 micro-batches)': [
        "mesh.shape = {'stage': 2, 'data': 2, 'model': 2}",
        MEGATRON, "pipeline.engine = 'spmd'",
        'pipeline.num_stages = 2', 'pipeline.num_micro_batches = 4'],
}
KILL_ABOVE = 10 * GIB
PARTIAL = os.path.join(RESULTS, '.suggest.partial.json')  # a dotfile: not a result


def spearman(xs: list[float], ys: list[float]) -> float:
  def ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    result = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
      j = i
      while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
        j += 1
      for k in range(i, j + 1):
        result[order[k]] = (i + j) / 2
      i = j + 1
    return result
  rx, ry = ranks(xs), ranks(ys)
  mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
  return cov / var if var else 0.0


def suggestions(model: dict, budget_gib: float, margins):
  """The suggester's ranked candidates for `model` at `budget_gib` per process."""
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=import-outside-toplevel
  from plugins.suggest.planner import Suggester  # pylint: disable=import-outside-toplevel
  with gin_setup.parsed_config(files=model['files'], bindings=model['bindings'],
                               search_paths=[]):
    base = plan_lib.make_plan()
  suggester = Suggester.from_plan(base, num_devices=8, memory_gb=budget_gib, margins=margins)
  return suggester, suggester.run()


@functools.cache
def this_machine() -> dict:
  """What a step time depends on besides the candidate: --reuse keeps
  another run's trials only where these match (without AVX-512 a bfloat16
  step took 13x a float32 one; with it, about half)."""
  from layout_core.suggest.calibration import machine_facts  # pylint: disable=import-outside-toplevel
  facts = machine_facts()
  return {key: facts[key] for key in ('processor', 'cores', 'isa', 'tensorflow')}


def key_of(bindings: list[str]) -> str:
  return '\n'.join(bindings)


def run_trial(model: dict, bindings: list[str], cache: dict, *, label: str) -> dict:
  from plugins.suggest.measure import measure  # pylint: disable=import-outside-toplevel
  bindings = with_megatron(bindings)
  key = key_of(model['bindings'] + bindings)
  have = cache.get(key)
  done = have.get('step_seconds_each', [have['step_seconds']]) if have else []
  if have and (not have['ok'] or len(done) >= model['trials']):
    return have
  runs = []  # the trials it lacks (an earlier file's count may be lower)
  for _ in range(model['trials'] - len(done)):
    runs.append(measure(files=model['files'], bindings=model['bindings'],
                        candidate_bindings=bindings, steps=STEPS, warmup=WARMUP, kill_above=KILL_ABOVE,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')).as_dict())
    if not runs[-1]['ok']:
      break
  cache[key] = trial = combined(have, runs)
  with open(PARTIAL, 'w') as f:  # a crash loses no trial: --reuse reads it back
    json.dump({'trials': cache, 'trials_machine': this_machine()}, f)
  each = ', '.join(f'{t * 1e3:.0f}' for t in trial['step_seconds_each'])
  print(f'  {label}: {"ok" if trial["ok"] else "FAILED " + trial["error"][:120]} '
        f'{trial["step_seconds"] * 1e3:.0f} ms/step ({each}), '
        f'peak {trial["peak_bytes"] / GIB:.2f} GiB', flush=True)
  return trial


def combined(have: dict | None, runs: list[dict]) -> dict:
  """A candidate's trials (`have`, those already run, combined; and the new
  `runs`) as one: the median step time, the highest peak; failed if any
  failed (then that one's account)."""
  each = ((have or {}).get('step_seconds_each', [have['step_seconds']] if have else [])
          + [r['step_seconds'] for r in runs if r['ok']])
  failed = [r for r in runs if not r['ok']]
  if failed:
    return {**failed[0], 'step_seconds_each': each}
  first = have or runs[0]
  return {**first, 'step_seconds': statistics.median(each),
          'peak_bytes': max([r['peak_bytes'] for r in runs] + [first['peak_bytes']]),
          'seconds': (have['seconds'] if have else 0.0) + sum(r['seconds'] for r in runs),
          'step_seconds_each': each}


def measured_rows(name, model, budget, cache, margins) -> tuple[list, object, object]:
  """Every candidate the suggester ranks at `budget`, each trained."""
  suggester, result = suggestions(model, budget, margins)
  rows = []
  print(f'{name} at {budget} GiB: {len(result.ranked)} candidates fit (predicted)', flush=True)
  for rank, e in enumerate(result.ranked):
    bindings = suggester.bindings(e.candidate)
    trial = run_trial(model, bindings, cache, label=f'#{rank + 1} {e.candidate.describe()}')
    rows.append({'rank': rank + 1, 'candidate': e.candidate.describe(),
                 'family': e.candidate.layout.family, 'bindings': bindings,
                 'predicted_seconds': e.seconds, 'predicted_bytes': e.need,
                 'margin': suggester.budget.margin(e.candidate.layout), 'terms': e.terms,
                 **{f'measured_{k}': v for k, v in trial.items()}})
  return rows, suggester, result


def memory_margins(raw: dict) -> dict:
  """Per layout family, the estimate's worst under-estimate (measured peak /
  estimate - 1, at least 0) over every candidate that trained."""
  worst: dict[str, float] = {}
  for rows in raw.values():
    for r in rows:
      if r['measured_ok']:
        error = r['measured_peak_bytes'] / r['predicted_bytes'] - 1
        worst[r['family']] = max(worst.get(r['family'], 0.0), error)
  return {family: round(error + 0.005, 2) for family, error in sorted(worst.items())}


def bench_model(name: str, model: dict, cache: dict, margins, raw_rows) -> dict:
  out = {'files': model['files'], 'bindings': model['bindings'], 'trials': model['trials'],
         'budgets': {}}
  for budget in BUDGETS_GIB:
    rows, suggester, result = measured_rows(name, model, budget, cache, margins)
    out['budgets'][str(budget)] = summarise(rows, limit=budget * GIB, model=model, cache=cache,
                                            smallest=result.smallest_need(suggester.budget),
                                            budget=suggester.budget,
                                            ground_truth=raw_rows + rows)
  return out


def summarise(rows, *, limit, model, cache, smallest, budget, ground_truth) -> dict:
  ran = [r for r in rows if r['measured_ok']]
  fitting = {r['candidate']: r for r in ground_truth
             if r['measured_ok'] and r['measured_peak_bytes'] <= limit}
  summary = {'candidates': rows, 'predicted_fitting': len(rows), 'ran': len(ran),
             'measured_fitting_ground_truth': len(fitting)}
  if not rows:
    summary['fits_nowhere'] = {
        'smallest_budget_bytes': (budget.smallest_limit(smallest.need, smallest.candidate.layout)
                                  if smallest else None),
        'candidate': smallest.candidate.describe() if smallest else None,
        'any_candidate_fits_measured': bool(fitting)}
    return summary
  top = rows[0]
  summary['suggestion'] = top['candidate']
  summary['suggestion_fits'] = bool(top['measured_ok'] and top['measured_peak_bytes'] <= limit)
  if fitting and top['measured_ok']:
    fastest = min(fitting.values(), key=lambda r: r['measured_step_seconds'])
    summary['fastest_fitting'] = fastest['candidate']
    summary['suggestion_over_fastest'] = (top['measured_step_seconds']
                                          / fastest['measured_step_seconds'])
    if fastest['candidate'] != top['candidate']:  # a single trial is +-10%: in turns
      summary['in_turns'] = in_turns(model, top['bindings'], fastest['bindings'])
      summary['suggestion_over_fastest_in_turns'] = summary['in_turns']['ratio']
  if len(ran) >= 3:
    summary['spearman'] = spearman([r['predicted_seconds'] for r in ran],
                                   [r['measured_step_seconds'] for r in ran])
    each = [r.get('measured_step_seconds_each') or [] for r in ran]
    if all(len(e) >= 2 for e in each):  # the measurement against itself: odd vs even trials
      summary['spearman_retest'] = spearman([statistics.median(e[0::2]) for e in each],
                                            [statistics.median(e[1::2]) for e in each])
  hand = {}
  layouts = HAND_WRITTEN_MOE if model.get('hand_written') == 'moe' else HAND_WRITTEN
  for label, bindings in layouts.items():
    trial = run_trial(model, bindings, cache, label=f'hand-written {label}')
    fits = trial['ok'] and trial['peak_bytes'] <= limit
    hand[label] = {'fits': fits, 'step_seconds': trial['step_seconds'],
                   'peak_bytes': trial['peak_bytes'], 'error': trial['error']}
    if fits and top['measured_ok']:
      hand[label]['suggestion_over_this'] = top['measured_step_seconds'] / trial['step_seconds']
  summary['hand_written'] = hand
  return summary


def in_turns(model: dict, first: list[str], second: list[str], rounds: int = 3) -> dict:
  """The two candidates trained in turns, `rounds` times each: median step
  times and their ratio (first / second)."""
  from plugins.suggest.measure import measure  # pylint: disable=import-outside-toplevel
  times: dict[int, list[float]] = {0: [], 1: []}
  for _ in range(rounds):
    for index, bindings in enumerate((first, second)):
      trial = measure(files=model['files'], bindings=model['bindings'],
                      candidate_bindings=bindings, steps=STEPS, warmup=WARMUP, kill_above=KILL_ABOVE,
                      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
      if trial.ok:
        times[index].append(trial.step_seconds)
  medians = [statistics.median(times[i]) if times[i] else float('nan') for i in (0, 1)]
  print(f'  in turns: {medians[0] * 1e3:.0f} vs {medians[1] * 1e3:.0f} ms/step', flush=True)
  return {'suggestion_seconds': times[0], 'fastest_seconds': times[1],
          'ratio': medians[0] / medians[1]}


def estimate_minutes(name: str, model: dict) -> float:
  """Minutes of trials `name` takes here, by the cost model's own prediction
  (this machine's calibration): every candidate of pass 1 (and of pass 2,
  with the margins of the checked-in results), `trials` processes of
  WARMUP + STEPS steps and START_UP_S each; in-turns reruns and
  hand-written layouts not counted."""
  margins = [({}, 0.0)]
  shipped = os.path.join(RESULTS, MOE_RESULTS if name == 'lm_moe' else 'suggest.json')
  if os.path.exists(shipped):
    with open(shipped) as f:
      kept = json.load(f)['memory_margins']
    margins.append((kept, max(kept.values())))
  seconds = {}
  for budget in BUDGETS_GIB:
    for margin in margins:
      suggester, result = suggestions(model, budget, margin)
      seconds.update({key_of(suggester.bindings(e.candidate)): e.seconds for e in result.ranked})
  return sum(model['trials'] * ((WARMUP + STEPS) * step + START_UP_S)
             for step in seconds.values()) / 60


def time_100b() -> dict:
  """Wall time of `launch.inspect --suggest` on the 100B config, 1,024 devices,
  on one host (every layout) and on 128 hosts of 8 (the model axis within one)."""
  found = {}
  for hosts in (1, 128):
    command = [sys.executable, '-m', 'launch.inspect',
               '--gin_file=configs/experiments/lm_100b_inspect.gin', '--suggest',
               '--devices=1024', f'--hosts={hosts}', '--memory_gb=80', '--suggest_json=']
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    found[f'hosts={hosts}'] = {
        'command': ' '.join(command[1:]), 'seconds': time.perf_counter() - start,
        'exit': done.returncode, 'output_head': done.stdout[:3000] or done.stderr[-2000:]}
  return found


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--models', nargs='+', default=['lm_small', 'lm_wide'])
  parser.add_argument('--reuse', action='store_true')
  parser.add_argument('--out', default='',
                      help=f'default: bench/results/suggest.json, or {MOE_RESULTS} for '
                           '--models lm_moe')
  parser.add_argument('--estimate', action='store_true',
                      help="print how long each model's trials would take here (the cost "
                           "model's prediction) and stop")
  parser.add_argument('--only_100b', action='store_true',
                      help="time the 100B config's suggestion again, into --out")
  args = parser.parse_args()
  if 'lm_moe' in args.models and len(args.models) > 1:
    parser.error(f'--models lm_moe runs alone (its results go to {MOE_RESULTS}; '
                 "suggest.json's margins are the dense models')")
  args.out = args.out or os.path.join(
      RESULTS, MOE_RESULTS if args.models == ['lm_moe'] else 'suggest.json')
  if args.only_100b:
    with open(args.out) as f:
      results = json.load(f)
    results['suggest_100b'] = time_100b()
    with open(args.out, 'w') as f:
      json.dump(results, f, indent=1)
    return
  for name in args.models:  # before hours of trials: what they will take
    print(f'{name}: about {estimate_minutes(name, MODELS[name]):.0f} minutes of trials on this '
          "machine, by the cost model's prediction", flush=True)
  if args.estimate:
    return
  cache: dict = {}
  for path in (args.out, PARTIAL) if args.reuse else ():
    if os.path.exists(path):
      with open(path) as f:
        kept = json.load(f)
      if kept.get('trials_machine') != this_machine():
        print(f"--reuse: not {path}'s trials: measured on {kept.get('trials_machine')}, "
              f'not on this {this_machine()}', flush=True)
        continue
      cache.update(kept.get('trials', {}))
  # Pass 1: the estimate without margins, every candidate it ranks trained:
  # its errors per family are the margins.
  raw = {}
  for name in args.models:
    for budget in BUDGETS_GIB:
      rows, _, _ = measured_rows(name, MODELS[name], budget, cache, ({}, 0.0))
      raw.setdefault(name, []).extend(rows)
  margins = memory_margins(raw)
  print('memory margins per family:', margins, flush=True)
  # Pass 2: the suggester as shipped (with those margins) against the truth.
  models = {name: bench_model(name, MODELS[name], cache, (margins, max(margins.values())),
                              raw[name])
            for name in args.models}
  errors = [r['measured_peak_bytes'] / r['predicted_bytes'] - 1
            for rows in raw.values() for r in rows if r['measured_ok']]
  results = {'models': models, 'memory_margins': margins,
             'memory_error_signed': {'min': min(errors, default=None),
                                     'max': max(errors, default=None)},
             'raw_candidates': raw, 'suggest_100b': time_100b(), 'trials': cache,
             'trials_machine': this_machine()}
  write_json(results, args.out)


if __name__ == '__main__':
  main()
