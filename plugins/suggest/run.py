"""`launch.inspect --suggest`: search, print, optionally measure, write JSON and a .gin file.

    suggest(plan, files=['configs/models/lm_small.gin'], bindings=[], search_paths=[],
            devices=8, hosts=1, memory_gb=2.0, top_k=5, json_path='suggestions.json',
            gin_path='', measure=False, measure_steps=8, calibration=None, env=os.environ)
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from layout_core.errors import ConfigError
from plugins.plan import RunPlan
from plugins.suggest import measure as measure_lib
from plugins.suggest import output
from plugins.suggest.planner import Suggester


def suggest(base: RunPlan, *, files: Sequence[str], bindings: Sequence[str],
            search_paths: Sequence[str], devices: int, hosts: int, memory_gb: float | None,
            top_k: int, json_path: str, gin_path: str, measure: bool, measure_steps: int,
            calibration: str | None, env: Mapping[str, str]) -> None:
  """See the module docstring; ConfigError (exit 2) for what the user can fix."""
  if top_k < 1:
    raise ConfigError(f'--top_k={top_k}', where='--top_k', fix='give at least 1')
  if measure and hosts > 1:
    raise ConfigError(f'--measure trains on this machine, which is one host, not --hosts={hosts}',
                      where='--measure / --hosts',
                      fix='measure with --hosts=1, or train the suggestions under your '
                          'scheduler with launch.train')
  if measure and measure_steps < 5:
    raise ConfigError(f'--measure_steps={measure_steps}: the first 3 steps are not timed',
                      where='--measure_steps', fix='give at least 5')
  if gin_path and os.path.exists(gin_path):
    raise ConfigError(f'--suggest_gin={gin_path} exists', where='--suggest_gin',
                      fix='name a new file (nothing is overwritten)')
  suggester = Suggester.from_plan(base, num_devices=devices or None, hosts=hosts,
                                  memory_gb=memory_gb, calibration_file=calibration)
  result = suggester.run()
  output.check_fits_somewhere(result, suggester)
  top = result.ranked[:top_k]
  trials: list[measure_lib.Trial] = []
  if measure:
    for rank, e in enumerate(top, 1):
      print(f'measuring #{rank}/{len(top)}: {e.candidate.describe()} ...', flush=True)
      trials.append(measure_lib.measure(
          files=files, bindings=bindings, candidate_bindings=suggester.bindings(e.candidate),
          steps=measure_steps, kill_above=suggester.budget.limit, env=env,
          search_paths=search_paths))
  print(output.describe(result, suggester, top_k=top_k, trials=trials))
  chosen, note = _choose(top, trials, suggester)
  print(f'\nChosen: {note}')
  if json_path:
    output.write_json(json_path, output.as_json(result, suggester, top_k=top_k, trials=trials))
    print(f'Wrote {json_path}')
  if gin_path:
    text = output.gin_file_text(files=files, bindings=bindings,
                                lines=suggester.bindings(chosen.candidate), note=note)
    with open(gin_path, 'x') as f:
      f.write(text)
    print(f'Wrote {gin_path}: python -m launch.train --gin_file={gin_path} --model_dir=...')


def _choose(top, trials, suggester):
  """The predicted best, or with measurements the fastest that fit."""
  best = top[0]
  if not trials:
    return best, (f'{best.candidate.describe()} (predicted {best.seconds * 1e3:.0f} ms/step, '
                  f'{best.need / 2**30:.3f} GiB)')
  fits = [(t.step_seconds, i) for i, t in enumerate(trials)
          if t.ok and t.peak_bytes <= suggester.budget.limit]
  if not fits:
    raise ConfigError(
        f'none of the {len(trials)} measured layouts trained within '
        f'{suggester.budget.limit / 2**30:.3f} GiB: '
        + '; '.join(f'#{i + 1} {t.error or "over the budget"}' for i, t in enumerate(trials)),
        where='--measure', fix='raise --memory_gb or --top_k, or read the errors above')
  seconds, index = min(fits)
  chosen, trial = top[index], trials[index]
  return chosen, (f'{chosen.candidate.describe()} (measured {seconds * 1e3:.0f} ms/step, '
                  f'peak {trial.peak_bytes / 2**30:.3f} GiB; predicted '
                  f'{chosen.seconds * 1e3:.0f} ms/step)')
