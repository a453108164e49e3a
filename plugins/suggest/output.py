"""What `launch.inspect --suggest` prints and writes: the ranking, bindings, JSON, a .gin file.

    print(describe(result, suggester, top_k=5))
    write_json('suggestions.json', result, suggester, top_k=5)
    text = gin_file_text(files=[...], bindings=[...], lines=suggester.bindings(best), note='...')
"""

from __future__ import annotations

import datetime
import json
import shlex
from typing import Sequence

from layout_core import durable
from layout_core.errors import ConfigError
from layout_core.suggest.search import Evaluation, SearchResult
from plugins.suggest.measure import Trial
from plugins.suggest.planner import Suggester

GIB = 2**30


def _gib(nbytes: float) -> str:
  return f'{nbytes / GIB:,.3f} GiB'


def _ms(seconds: float) -> str:
  return f'{seconds * 1e3:,.0f} ms' if seconds < 100 else f'{seconds:,.1f} s'


def budget_line(suggester: Suggester) -> str:
  budget = suggester.budget
  unit = 'per process' if budget.per_process else 'per device'
  return (f'{suggester.num_devices} {suggester.base.mesh_spec.device_type} devices on '
          f'{suggester.hosts} host{"s" if suggester.hosts > 1 else ""}, budget '
          f"{_gib(budget.limit)} {unit}; each layout keeps its family's margin free (the "
          "memory estimate's worst measured error for its pipeline engine and state split)")


def check_fits_somewhere(result: SearchResult, suggester: Suggester) -> None:
  """A ConfigError (exit 2) when no candidate fits: the smallest budget
  that would, and the candidate that needs it."""
  if result.ranked:
    return
  smallest = result.smallest_need(suggester.budget)
  if smallest is None:
    reasons = '; '.join(f'{why} ({len(layouts)} layouts)'
                        for why, layouts in result.refused.items())
    raise ConfigError(f'no layout of {suggester.num_devices} devices can run this config: '
                      f'{reasons}', where='--devices / the config',
                      fix='change what the reasons name, or the device count')
  budget = suggester.budget
  unit = 'per process' if budget.per_process else 'per device'
  layout = smallest.candidate.layout
  need = budget.smallest_limit(smallest.need, layout)
  train = suggester.base.train
  narrower = {'float32': "'bfloat16' or 'int8'", 'bfloat16': "'int8'"}.get(train.frozen_dtype)
  frozen = any(not r.trainable for r in suggester.base.records)
  hint = (f', a frozen base stored narrower (train.frozen_dtype = {narrower})'
          if frozen and narrower else '')
  raise ConfigError(
      f'no layout of {suggester.num_devices} devices fits {_gib(budget.limit)} {unit}: '
      f'the least any candidate needs is {_gib(smallest.need)} '
      f'({smallest.candidate.describe()}), {_gib(need)} with its {budget.margin(layout):.0%} '
      'margin',
      where='--memory_gb / mesh.device_memory_gb',
      fix=f'give at least {need / GIB:.2f} GiB {unit} (and use '
          f'{smallest.candidate.describe()}), more devices (--devices){hint}, or a '
          'smaller model or batch')


def describe(result: SearchResult, suggester: Suggester, *, top_k: int,
             trials: Sequence[Trial] = ()) -> str:
  """The ranking table, the top candidates' bindings, what was dropped and why."""
  lines = [f'Layouts for {budget_line(suggester)}.',
           f'Cost model rates: {suggester.rates.describe()}.',
           f'{len(suggester.layouts())} layouts, {result.evaluated} candidates planned; '
           f'{len(result.ranked)} layouts fit, each with its fastest settings.', '']
  top = result.ranked[:top_k]
  header = f'{"rank":>4}  {"step (predicted)":>16}  {"memory":>11}  layout; settings'
  if trials:
    header = (f'{"rank":>4}  {"step (predicted)":>16}  {"measured":>9}  {"memory":>11}  '
              f'{"peak":>11}  layout; settings')
  lines.append(header)
  for rank, e in enumerate(top, 1):
    if trials:
      t = trials[rank - 1]
      measured = _ms(t.step_seconds) if t.ok else ('over' if t.killed_over else 'failed')
      lines.append(f'{rank:4d}  {_ms(e.seconds):>16}  {measured:>9}  {_gib(e.need):>11}  '
                   f'{_gib(t.peak_bytes):>11}  {e.candidate.describe()}')
    else:
      lines.append(f'{rank:4d}  {_ms(e.seconds):>16}  {_gib(e.need):>11}  '
                   f'{e.candidate.describe()}')
  for rank, e in enumerate(top, 1):
    lines += ['', f'#{rank} {e.candidate.describe()}: {_breakdown(e)}',
              *[f'  --gin_bindings={_shell(b)}' for b in suggester.bindings(e.candidate)]]
  if result.refused:
    lines += ['', 'Cannot run (as launch.train would refuse them):']
    for why, layouts in result.refused.items():
      names = ', '.join(l.describe() for l in layouts[:4])
      more = f' and {len(layouts) - 4} more' if len(layouts) > 4 else ''
      lines.append(f'  {len(layouts):3d} layouts: {why} ({names}{more})')
  if result.too_big:
    lines += ['', f'Do not fit with any settings ({len(result.too_big)} layouts; the least '
                  'each needs):']
    for e in sorted(result.too_big, key=lambda e: e.need)[:5]:
      lines.append(f'  {_gib(e.need):>11}  {e.candidate.describe()}')
  return '\n'.join(lines)


def _shell(binding: str) -> str:
  """`binding` quoted for a POSIX shell: in double quotes when nothing in it
  is special there (gin's strings are single-quoted), else shlex's."""
  if not any(c in binding for c in '"$`\\!'):
    return f'"{binding}"'
  return shlex.quote(binding)


def _breakdown(e: Evaluation) -> str:
  big = sorted(((v, k) for k, v in e.terms.items() if v > 0), reverse=True)[:4]
  return ', '.join(f'{name} {_ms(value)}' for value, name in big)


def as_json(result: SearchResult, suggester: Suggester, *, top_k: int,
            trials: Sequence[Trial] = ()) -> dict:
  rows = []
  for rank, e in enumerate(result.ranked[:top_k], 1):
    row = {'rank': rank, 'layout': e.candidate.layout.describe(),
           'settings': e.candidate.settings.describe(),
           'bindings': suggester.bindings(e.candidate),
           'predicted_step_seconds': e.seconds, 'predicted_memory_bytes': e.need,
           'margin': suggester.budget.margin(e.candidate.layout),
           'memory_per_device': e.memory, 'cost_terms_seconds': e.terms}
    if trials:
      row['measured'] = trials[rank - 1].as_dict()
    rows.append(row)
  budget = suggester.budget
  return {'devices': suggester.num_devices, 'hosts': suggester.hosts,
          'device_type': suggester.base.mesh_spec.device_type,
          'budget_bytes': budget.limit, 'budget_per_process': budget.per_process,
          'margins': dict(budget.margins), 'default_margin': budget.default_margin,
          'rates': suggester.rates.describe(),
          'candidates': rows,
          'refused': {why: [l.describe() for l in layouts]
                      for why, layouts in result.refused.items()},
          'too_big': [{'candidate': e.candidate.describe(), 'bytes': e.need}
                      for e in result.too_big]}


def write_json(path: str, data: dict) -> None:
  """Whole or not at all (`layout_core.durable`): a reader never sees half a file."""
  durable.write_atomically(path, json.dumps(data, indent=1).encode())


def gin_file_text(*, files: Sequence[str], bindings: Sequence[str], lines: Sequence[str],
                  note: str) -> str:
  """A .gin file that launch.train takes: the config's files and bindings,
  then the chosen layout's bindings (which win: gin keeps the last)."""
  date = datetime.date.today().isoformat()
  out = [f'# Written by launch.inspect --suggest on {date}: {note}', '']
  out += [f"include '{f}'" for f in files]
  out += [''] + list(bindings) + ([''] if bindings else []) + list(lines)
  return '\n'.join(out) + '\n'
