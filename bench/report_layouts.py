"""docs/performance.md's sections on choosing a layout (bench/report.py's SECTIONS).

    shows, table = calibration_section(results['calibration.json'])
    shows, table = suggest_section(results['suggest.json'])
    shows, table = spmd_repeats_section(results['spmd_repeats.json'])
"""

from __future__ import annotations

from bench.figures import Results, in_ms, in_s, times


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:  # noqa: D103
  return (['| ' + ' | '.join(header) + ' |', '| ' + ' | '.join(['---'] * len(header)) + ' |']
          + ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows])


def calibration_section(r: Results) -> tuple[str, list[str]]:
  """The rates the cost model divides by, measured on this machine."""
  top = {dtype: table[-1][1] for dtype, table in r['matmul'].items()}
  blocks = r['block_device_s']
  tensor = ' / '.join(in_ms(r['tensor_s'][k] * 1e3) for k in ('2', '4', '8'))
  share = r.get('matmul_efficiency', {})
  reduce8 = r['collectives']['all_reduce']['8']
  shows = (f"With every device busy a matmul runs at {top['float32'] / 1e9:.0f} GFLOP/s per "
           f"device in float32 and {top['bfloat16'] / 1e9:.0f} in bfloat16; a real step gets "
           f"{share.get('float32', 1):.0%} and {share.get('bfloat16', 1):.0%} of that. An "
           f"all-reduce over 8 devices takes {in_ms(reduce8['latency_s'] * 1e3)} plus "
           f"{reduce8['bytes_per_s'] / 1e9:.2f} GB/s. Fixed costs, from tiny models: a block run "
           f"{in_ms(blocks['plain'] * 8e3)} (no pipeline, 8 devices), "
           f"{in_ms(blocks['submesh'] * 4e3)} on a 4-device sub-mesh, an SPMD cell "
           f"{in_ms(blocks['spmd'] * 8e3)} (its tick included), a variable's own gradient sum per "
           f"tick {in_ms((r.get('spmd_sum_variable_s') or 0.0) * 1e3)}; a "
           f"tensor all-reduce over 2 / 4 / 8 devices {tensor}; an FSDP variable "
           f"{in_ms(r['fsdp_variable_s'] * 1e3)}, a ZeRO-1 one {in_ms(r['zero_variable_s'] * 1e3)}; "
           f"a step {in_ms(r['step_s'] * 1e3)}. Each is fitted to its runs through the cost "
           f"model's own prediction; predicted back, the {len(r.get('runs', []))} runs are within "
           f"{r.get('fit_error', 0.0):.1%} of their measured step times.")
  wide = r.get('wide_dtype', 'bfloat16')
  shows += f" The larger model's runs trained in {wide}, whose one-device step was faster here."
  return shows, []


def suggest_moe_section(r: Results) -> tuple[str, list[str]]:
  """The same for the routed model, in words (its budgets agree)."""
  shows, table = suggest_section(r, with_100b=False)
  said = [f"{row[1].strip()}: {row[2].strip()} (fits: {row[3].strip()}; {row[4].strip()} the "
          f"fastest fitting; Spearman {row[5].strip()}; {row[6].strip()} the best "
          'hand-written layout)' for row in (line.strip('|').split('|') for line in table[2:])]
  return shows + ' ' + '; '.join(said) + '.', []


def suggest_section(r: Results, with_100b: bool = True) -> tuple[str, list[str]]:
  """The suggester against every candidate trained, per model and budget."""
  margins = ', '.join(f'{family} {margin:.0%}' for family, margin in
                      r['memory_margins'].items())
  big = r.get('suggest_100b', {}) if with_100b else {}
  timed = ', '.join(f"{in_s(run['seconds'])} on {hosts.split('=')[1]} host(s)"
                    for hosts, run in big.items() if run.get('exit') == 0)
  shows = (f'The memory margins measured per family: {margins}.'
           + (f' `--suggest` on the 100B inspect config, 1,024 devices: {timed}.'
              if timed else ''))
  rows, nowhere = [], []
  for model, info in r['models'].items():
    for budget, s in info['budgets'].items():
      if 'suggestion' not in s:
        need = (s.get('fits_nowhere') or {}).get('smallest_budget_bytes') or 0
        nowhere.append(f'{model} in {budget} GiB (it names {need / 2**30:.2f} GiB)')
        continue
      hand = [h['suggestion_over_this'] for h in s['hand_written'].values()
              if 'suggestion_over_this' in h]
      ratio = s.get('suggestion_over_fastest_in_turns', s.get('suggestion_over_fastest'))
      rows.append([model, f'{budget} GiB', s['suggestion'],
                   'yes' if s['suggestion_fits'] else 'NO',
                   times(ratio) if ratio is not None else '',
                   (f"{s['spearman']:.2f}" + (f" ({s['spearman_retest']:.2f})"
                                               if 'spearman_retest' in s else ''))
                   if 'spearman' in s else '',
                   times(max(hand)) if hand else 'none fits'])
  if nowhere:
    shows += ' Fits nowhere, exit 2: ' + ', '.join(nowhere) + '.'
  return shows, _markdown_table(
      ['model', 'budget', 'suggestion', 'fits', 'its time / fastest fitting (in turns)',
       'Spearman, predicted vs measured (measured vs itself)',
       'its time / hand-written (worst)'], rows)


def accumulation_section(r: Results) -> tuple[str, list[str]]:
  """Peak memory against micro-steps, per setting."""
  rows = r['rows']
  steps = sorted({row['micro_steps'] for row in rows})
  settings = list(dict.fromkeys(row['setting'] for row in rows))
  peak = {(row['setting'], row['micro_steps']): row for row in rows}
  worst = max((row['peak_over_one'] or 0) for row in rows)
  shows = (f'The peak grows with the micro-steps in every setting, up to {times(worst)} the '
           'one-step peak at 4, also with one inter-op thread (so not from micro-steps run at '
           'once); the step time grows too.')
  table = [[name] + [f"{peak[(name, k)]['peak_bytes'] / 2**30:.2f} GiB, "
                     f"{in_ms(peak[(name, k)]['step_seconds'] * 1e3)}" for k in steps]
           for name in settings]
  return shows, _markdown_table(['peak, step time'] + [f'{k} micro-step{"s" * (k > 1)}'
                                                       for k in steps], table)


def spmd_repeats_section(r: Results) -> tuple[str, list[str]]:
  """The SPMD engine at 1 and 2 circular repeats: step time, gradient sums."""
  one, two = r['rows']
  shows = (f"1 repeat: {in_ms(one['step_seconds'] * 1e3)} a step, "
           f"{one['gradient_sums']:.0f} gradient all-reduces ({one['combined_after_addn']:.0f} "
           f"combined after an AddN); 2 repeats: {in_ms(two['step_seconds'] * 1e3)} "
           f"({times(r['step_ratio_2_over_1'])}), {two['gradient_sums']:.0f} "
           f"({two['combined_after_addn']:.0f}): with 2 repeats each tick's weight gradients "
           'are summed on their own.')
  return shows, []
