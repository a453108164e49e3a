"""docs/performance.md, rendered from the measured results in bench/results/.

    python -m bench.report > docs/performance.md

Every bench/results/*.json (sorted by name) becomes one section: the script
that measured it, when (date), on which commit and machine, the command as
run ('not recorded' for results written before bench/common.py's write_json
recorded it), and the headline figures as a table. tests/test_docs_figures.py
checks that the page on disk is exactly this output, so no figure in the docs
can drift from its measurement.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, 'bench', 'results')
COMMAND = 'python -m bench.report > docs/performance.md'


def _seconds(value: Any) -> str:
  return '' if value is None else f'{value:.2f}'


def _tenths(value: Any) -> str:
  return '' if value is None else f'{value:.1f}'


def _number(value: int | float) -> str:
  if isinstance(value, int):
    return str(value)
  if value != 0 and abs(value) < 0.01:
    return f'{value:.3g}'
  return f'{value:.2f}'


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  right = ['---'] + ['---:'] * (len(header) - 1)
  lines = ['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join(right) + ' |']
  lines += ['| ' + ' | '.join(cells) + ' |' for cells in rows]
  return lines


def _cell(text: Any) -> str:
  return str(text).replace('|', '\\|')


def _startup(results: dict) -> list[str]:
  best = results.get('best', {})
  ratios = results.get('ratio_first_step_wall', {})
  rows = []
  for name, figures in best.items():
    wall = (figures.get('first_step') or [None])[0]
    ratio = 1.0 if name == 'plain' else ratios.get(name)
    rows.append([_cell(name), _seconds(wall), _seconds(figures.get('first_step_cpu_best')),
                 '' if ratio is None else f'{ratio:.1f}x'])
  return _table(['contender', 'first step, wall s', 'first step, CPU s',
                 'wall vs plain'], rows)


def _dtensor_compile_limit(results: dict) -> list[str]:
  best = results.get('best', {})
  plain = best.get('plain', {}).get('first_call')
  rows = []
  for name, figures in best.items():
    first = figures.get('first_call')
    ratio = f'{first / plain:.1f}x' if first is not None and plain else ''
    later = figures.get('later_call')
    rows.append([_cell(name), str(figures.get('ops', '')), _seconds(figures.get('trace')),
                 _seconds(first), _seconds(figures.get('first_call_cpu')), ratio,
                 '' if later is None else _tenths(1000 * later)])
  lines = _table(['contender', 'ops', 'trace s', 'first call s', 'CPU s',
                  'first call vs plain', 'later call ms'], rows)
  variables = results.get('variables_ms_each')
  if variables:
    lines += ['', 'Making a DVariable (replicated, 8 devices), ms each:', '']
    lines += _table(['variables named', 'ms each'],
                    [[_cell(name), _tenths(ms)] for name, ms in variables.items()])
  return lines


PROVENANCE = ('date', 'commit', 'machine', 'command', 'rounds_run')


def _value(value: Any) -> str:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return _cell(value if not isinstance(value, (list, dict)) else json.dumps(value))
  return _number(value)


def _rows_table(rows: list[dict]) -> list[str]:
  """A list of flat dicts as one table, a column per key (first seen first)."""
  columns: list[str] = []
  for row in rows:
    columns += [key for key in row if key not in columns]
  return _table(columns, [[_value(row.get(key, '')) for key in columns] for row in rows])


def _generic(results: Any) -> list[str]:
  """Whatever a results file holds, as tables: top-level figures; a list of
  rows; a {name: {figure: value}} dict as a table per name's figures; a
  {name: value} dict as two columns; one level deeper, a table per key."""
  if isinstance(results, list):
    results = {'rows': results}
  lines: list[str] = []
  scalars = [(key, value) for key, value in results.items()
             if key not in PROVENANCE and not isinstance(value, (dict, list))]
  if scalars:
    lines += _table(['figure', 'value'], [[_cell(key), _value(value)] for key, value in scalars])
  for key, value in results.items():
    if key in PROVENANCE or not isinstance(value, (dict, list)) or not value:
      continue
    if isinstance(value, list) and all(isinstance(row, dict) for row in value):
      table = _rows_table(value)
    elif isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
      inner = list(value.values())
      if all(all(isinstance(v, dict) for v in row.values()) for row in inner):
        for name, row in value.items():  # one table per key, one level deeper
          lines += ['', f'{_cell(key)} / {_cell(name)}:', '']
          lines += _rows_table([{'': n, **r} for n, r in row.items()])
        continue
      table = _rows_table([{'': name, **row} for name, row in value.items()])
    elif isinstance(value, dict):
      table = _table(['', 'value'], [[_cell(k), _value(v)] for k, v in value.items()])
    else:
      table = _table(['value'], [[_value(v)] for v in value])
    lines += ['', f'{_cell(key)}:', ''] + table
  return lines or ['(no figures)']


def _small_input_recompile(results: dict) -> list[str]:
  measured = {k: v for k, v in results.items() if isinstance(v, dict) and 'calls' in v}
  values = [str(c.get('value')) for c in next(iter(measured.values()), {}).get('calls', [])]
  rows = [[_cell(name)] + [f"{'miss' if c.get('missed') else 'hit'}, {c.get('seconds', 0):.3f} s"
                           for c in figures['calls']]
          for name, figures in measured.items()]
  return _table(['extra input'] + [f'call {i + 1} (value {v})' for i, v in enumerate(values)],
                rows)


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
    'startup': _startup,
    'dtensor_compile_limit': _dtensor_compile_limit,
    'small_input_recompile': _small_input_recompile,
}


def _script(name: str, results: Any) -> str:
  command = results.get('command') if isinstance(results, dict) else None
  if command:
    for part in command.split():
      if part.endswith('.py'):
        return part
  if os.path.isfile(os.path.join(REPO, 'bench', f'{name}.py')):
    return f'bench/{name}.py'
  return f'{name}.json'


def _provenance(results: Any) -> list[str]:
  results = results if isinstance(results, dict) else {}
  machine = results.get('machine')
  if isinstance(machine, dict):
    where = (f'{machine.get("cores", "?")} cores, processor {machine.get("processor", "?")}, '
             f'host {machine.get("host", "?")}')
  else:
    where = 'not recorded'
  lines = [f'- date: {results.get("date") or "not recorded"}',
           f'- commit: {results.get("commit") or "not recorded"}',
           f'- machine: {where}']
  command = results.get('command')
  lines.append(f'- command: `{command}`' if command else '- command: not recorded')
  if isinstance(results.get('rounds_run'), int):
    lines.append(f'- best of {results["rounds_run"]} rounds')
  return lines


def performance_markdown(results_dir: str = RESULTS) -> str:
  """The page: one section per results file, in name order."""
  lines = ['# Performance', '',
           f'This page is generated by `{COMMAND}` from bench/results/*.json; '
           'each figure on it was measured by the script named in its section.']
  for path in sorted(glob.glob(os.path.join(results_dir, '*.json'))):
    name = os.path.splitext(os.path.basename(path))[0]
    with open(path) as f:
      results = json.load(f)
    render = RENDERERS.get(name, _generic)
    lines += ['', f'## {_script(name, results)}', '',
              f'Results: `bench/results/{os.path.basename(path)}`', '']
    lines += _provenance(results)
    lines += [''] + render(results)
  return '\n'.join(lines) + '\n'


def main() -> None:
  print(performance_markdown(), end='')


if __name__ == '__main__':
  main()
