"""docs/performance.md: the results in bench/results/, as a page to read.

    python -m bench.report > docs/performance.md

The page opens with a summary table of the headline figures (bench/figures.py,
those with a `what`), then a section per results file, grouped by topic:
`SECTIONS` gives each file a heading, a sentence on what its script measures
and a small renderer that says what the figures show (in the words of
`FIGURES`, so every figure another page quotes is on this one) and picks the
columns that matter. A results file with no entry there is still shown, by
`_generic`. TensorFlow's error messages become a short plain `outcome`
(bench/figures.py); a commit measured with uncommitted changes is marked †,
explained once.

tests/test_docs_figures.py checks that the page on disk is exactly this
rendering: after a benchmark writes new results, run the command above.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any, Callable

from bench.figures import (CLOCKS, FIGURES, Results, figure, in_bytes, in_millions, in_ms, in_s,
                           narrow_peak, outcome, row_spread, times)
from bench.report_layouts import (accumulation_section, calibration_section,
                                  spmd_repeats_section, suggest_moe_section,
                                  suggest_section)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, 'bench', 'results')
COMMAND = 'python -m bench.report > docs/performance.md'
DIRTY = ' (with uncommitted changes)'  # how bench/common.py marks a commit
Rendered = tuple[str, list[str]]  # (what the figures show, table lines)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
  """A markdown table; columns of figures right-aligned."""
  cells = [[str(c).replace('|', '\\|') for c in row] for row in rows]
  numeric = [i > 0 and all(re.match(r'[\d.,+-]', row[i]) for row in cells if row[i])
             for i in range(len(header))]
  return (['| ' + ' | '.join(header) + ' |',
           '| ' + ' | '.join('---:' if n else '---' for n in numeric) + ' |']
          + ['| ' + ' | '.join(row) + ' |' for row in cells])


def _pivot(rows: list[dict], row_key: Callable, column_key: Callable, cell: Callable,
           first: str) -> list[str]:
  """A table of a row per row_key and a column per column_key, first seen first."""
  columns = list(dict.fromkeys(column_key(r) for r in rows))
  table: dict[str, dict] = {}
  for r in rows:
    table.setdefault(row_key(r), {})[column_key(r)] = cell(r)
  return _table([first] + columns,
                [[key] + [cells.get(c, '') for c in columns] for key, cells in table.items()])


def _ok(row: dict) -> str:
  return 'right' if row.get('ok') else outcome(row.get('error'))


# ------------------------------------------------------------------ sections


def _step_breakdown(r: Results) -> Rendered:
  shows = (f"One device takes {figure('step.one_device', r)} a step, `data=8` "
           f"{figure('step.data8', r)} ({figure('step.data8_unsharded', r)} with unsharded "
           f"optimizer state); on `data=2 x model=4` sharded state is slower: "
           f"{figure('step.2x4_sharded', r)} against {figure('step.2x4', r)}.")
  rows = [[name, in_ms(f['loop_step_ms']), in_ms(f['ms']['gradients']), in_ms(f['ms']['update']),
           in_ms(f['ms']['batch'] + f['ms']['pack'])]
          for name, f in r.items() if isinstance(f, dict) and 'loop_step_ms' in f]
  return shows, _table(['mesh', 'step', 'gradients', 'update', 'batch + pack'], rows)


# Each mesh's default optimizer state is the other of these (data=8 shards it).
SPLIT_VARIANTS = {'unsharded state': 'state sharding switched',
                  'shard_state': 'state sharding switched'}


def _step_split(r: Results) -> Rendered:
  shows = (f"`data=8` keeps {figure('split.data8', r)} of one device's rate (gradients and update "
           f"in one function: {figure('split.fused', r)}, with XLA {figure('split.fused_xla', r)}); "
           f"unsharded optimizer state makes its step {figure('split.unsharded_state', r)} as "
           f"long, and on 2x4 a residual stream left to DTensor {figure('split.residual', r)}.")
  runs = [(name,) + tuple(name.split(', ', 1)) + (f,) for name, f in r['split'].items()]
  return shows, _pivot(
      runs, lambda run: run[1],
      lambda run: SPLIT_VARIANTS.get(run[2], run[2]) if len(run) == 4 else 'as configured',
      lambda run: in_ms(run[-1]['ms_per_step']) + (
          f" ({run[-1]['ratio']['value']:.2f})" if 'ratio' in run[-1] else ''),
      'step (rate of meshgin 1 device)')


def _split_matmul(r: Results) -> Rendered:
  shows = (f"Cut 8 ways they take {figure('matmul.tf_devices', r)} one device's time on plain "
           f"`tf.device`s and {figure('matmul.dtensor', r)} on DTensor: the split itself costs.")
  names = {'meshgin': 'meshgin threads', 'TF default': 'TF default', '[1]': '1 thread',
           '[1, 8]': 'intra-op 1, inter-op 8', '[2, 2]': 'intra-op 2, inter-op 2'}
  return shows, _pivot(r['rows'], lambda row: row['form'].replace(', 1 thread', ''),
                       lambda row: names.get(str(row['threads']), str(row['threads'])),
                       lambda row: f"{in_ms(row['ms'])} ({times(row['ratio_to_one_device'])})",
                       'form')


def _devices_concurrent(r: Results) -> Rendered:
  settings = {k: v for k, v in r.items() if isinstance(v, dict) and 'one device' in v}
  header = [re.sub(r'x\[(\d+).*\]( \(.*?\))?, (.*?)( \(.*\))?$', r'\1 rows, \3', k)
            for k in settings]
  rows = [[name] + [times(s[name]['time_ratio']) for s in settings.values()]
          for name in next(iter(settings.values()))]
  return ("With meshgin's threads twice the work takes about the time of one at 256 rows: the "
          'devices run at once; at the 16-row micro-batch dispatch shows.'), _table(
              ['twice the work on'] + header, rows)


def _step_pipeline(r: Results) -> Rendered:
  shows = (f"The SPMD engine runs at {figure('pipeline.spmd', r)} of the unpipelined rate and "
           f"the sub-mesh engine at {figure('pipeline.submesh', r)} of serial; fed the same 8 "
           f"micro-batches one after another the unpipelined models run at "
           f"{figure('pipeline.unpipelined_m8', r)} and {figure('pipeline.serial_m8', r)}, so "
           f"the engines keep {figure('pipeline.spmd_kept', r)} and "
           f"{figure('pipeline.submesh_kept', r)} of what their micro-batches allow: cut into 8, "
           f"a batch runs at {figure('pipeline.about', r)} of its rate, pipelined or not. An "
           f"SPMD step takes {figure('pipeline.spmd_step', r)}.")
  rows = [[name, f['mesh'].replace('CPU mesh ', ''), in_ms(f['ms_per_step']),
           f"{f['ratio']['value']:.2f} of {f['ratio']['to']}" if 'ratio' in f else '']
          for name, f in r['pipeline'].items()]
  return shows, _table(['contender', 'mesh', 'step', 'rate'], rows)


def _pipeline(r: Results) -> Rendered:
  first = r['runtime_limits'][0]
  shows = (f"At a {first['rows']}-row micro-batch on 2 stages no engine can beat serial (at "
           f"best {times(first['max_speedup_any_engine'])}).")
  limits = [[row['stages'], row['rows'], f"{row['stage_concurrency']:.2f}",
             times(row['max_speedup_any_engine']), in_ms(row['fc_layer_ms']),
             in_ms(row['shift_ms'])] for row in r['runtime_limits']]
  balance = _pivot(r['balance'], lambda row: row['stack'], lambda row: f"{row['stages']} stages",
                   lambda row: f"{times(row['balanced'])} / {times(row['lingvo'])}",
                   'stack: slowest stage over ideal, balanced / lingvo')
  return shows, _table(['stages', 'rows', 'stage concurrency', 'best speed-up', 'FC layer',
                        'shift'], limits) + [''] + balance


def _shift_moves(r: Results) -> Rendered:
  shows = (f"Only the all-to-all route beats the engine's einsum shift, at "
           f"{figure('shift.all_to_all', r)}; the {CLOCKS} shifts of an SPMD lm_small step take "
           f"{figure('shift.per_step', r)}, of which it would save {figure('shift.saving', r)}.")

  def cell(f: dict | None) -> str:
    if not f:
      return 'not tried'
    return f"{in_ms(f['ms'])} ({times(f['vs_einsum'])})" if f.get('ok') else outcome(f['error'])

  rows = [[n, cell(r['shift'].get(n)), cell(r['take_last'].get(n))]
          for n in dict.fromkeys([*r['shift'], *r['take_last']])]
  return shows, _table(['move', 'shift a slot', 'take the last slot'], rows)


def _step_fsdp(r: Results) -> Rendered:
  shows = (f"FSDP runs at {figure('fsdp.lm_small', r)}, {figure('fsdp.wide', r)} and "
           f"{figure('fsdp.megatron', r)} the default's rate.")
  runs = r['fsdp']
  rows = [[name.removesuffix(', fsdp'), in_millions(f['parameters']),
           in_ms(runs[f['ratio']['to']]['ms_per_step']), in_ms(f['ms_per_step']),
           times(f['ratio']['value'])] for name, f in runs.items() if name.endswith(', fsdp')]
  return shows, _table(['model and mesh', 'parameters', 'default step', 'fsdp step',
                        'fsdp rate'], rows)


def _bf16_matmul(r: Results) -> Rendered:
  shows = (f"bf16 runs {figure('bf16.speedup', r)} as fast as float32 with oneDNN and without "
           'XLA (the default).')
  return shows, _pivot(
      r['rows'], lambda row: f"{'oneDNN' if row['onednn'] else 'no oneDNN'}, "
                             f"{row['intra_op_threads']} threads",
      lambda row: f"{row['size']}" + (', XLA' if row['jit_compile'] else ''),
      lambda row: times(row['bf16_speedup']), 'bf16 speed / float32; size')


def _bf16_einsum(r: Results) -> Rendered:
  return (f"A bf16 einsum took {figure('bf16_einsum.slowdown', r)} as long as the same "
          f"projection as a bf16 matmul, and {row_spread(r, 'bf16_einsum_over_float32')} as "
          'long as a float32 einsum, in every setting (oneDNN on or off, 1 or 2 threads, '
          'both shapes).', [])


def _memory(r: Results) -> Rendered:
  shows = (f"In {figure('memory.budget', r)}, bf16 + remat + FSDP trains "
           f"{figure('memory.largest_width', r)}, {figure('memory.largest_params', r)} "
           f"parameters: {figure('memory.largest_vs_float32', r)} the "
           f"{figure('memory.float32_params', r)} of float32 data parallelism; float32 FSDP "
           f"reaches {figure('memory.fsdp_width', r)}.")
  rows = [[name, in_bytes(f['at_width']['peak_bytes']), in_bytes(f['predicted_bytes']),
           f"{f['at_width']['steps_per_sec']:.2f}", f"width {f['largest_width']}",
           in_millions(f['largest_parameters'])] for name, f in r['settings'].items()]
  return shows, _table(['setting', f"peak at width {r['width']}", 'predicted', 'steps/s',
                        'largest that fits', 'its parameters'], rows)


def _finetune(r: Results) -> Rendered:
  goal = lambda key, at: 'met' if r[key] >= at else 'not met'  # noqa: E731
  shows = (f"In {figure('finetune.budget', r)}, LoRA (rank {r['rank']} on the queries and "
           f"values) trains a model of {figure('finetune.lora_params', r)} parameters, "
           f"{figure('finetune.largest_ratio', r)} the {figure('finetune.full_params', r)} "
           f"full fine-tuning can (goal 3x: {goal('largest_lora / largest_full', 3)}); with "
           f"the frozen base stored in bfloat16, {figure('finetune.bf16_params', r)} "
           f"({figure('finetune.bf16_ratio', r)}), and in int8, "
           f"{figure('finetune.int8_params', r)} ({figure('finetune.int8_ratio', r)}; goal 20x: "
           f"{goal('largest_lora_int8 / largest_full', 20)}; "
           f"{figure('finetune.int8_vs_lora', r)} a float32 base's). "
           f"At width {r['width']} full fine-tuning peaks at {figure('finetune.peak_ratio', r)} "
           f"LoRA's host memory, and LoRA runs {figure('finetune.speed', r)} its steps per "
           f"second; a bfloat16 base runs {figure('finetune.bf16_speed', r)} and an int8 one "
           f"{figure('finetune.int8_speed', r)} the steps per second of a float32 base, timed "
           'in turns (each use of a narrow weight widens it, forward and backward; the '
           "table's steps/s are single 3-step runs).")
  names = (('full fine-tuning', 'full'), (f"LoRA rank {r['rank']}, q and v", 'lora'),
           ('the same, bfloat16 base', 'lora_bf16'), ('the same, int8 base', 'lora_int8'))
  rows = [[name, f"{e['trainable']:,} of {e['parameters']:,}",
           in_bytes(e['at_width']['peak_bytes']), f"{e['at_width']['steps_per_sec']:.2f}",
           f"width {e.get('largest_width')}", in_millions(e.get('largest_parameters'))]
          for name, e in ((label, r['settings'][key]) for label, key in names
                          if key in r['settings'])]
  return shows, _table(['setting', f"trained parameters at width {r['width']}", 'peak',
                        'steps/s', 'largest that fits', 'its parameters'], rows)


def _frozen_memory(r: Results) -> Rendered:
  shows = (f"On 2x4 Megatron the process peaks at {figure('frozen_memory.megatron_bf16', r)} "
           f"(bfloat16 base) and {figure('frozen_memory.megatron_int8', r)} (int8) of a float32 "
           f"base's; with FSDP on data=8 at {figure('frozen_memory.fsdp_bf16', r)} and "
           f"{figure('frozen_memory.fsdp_int8', r)} (gathered as stored, on the same machine: "
           f"{figure('frozen_memory.before_bf16', r)} and {figure('frozen_memory.before_int8', r)})"
           ": there each layer's gathered float32 copy, "
           'the same for every base, outweighs the frozen bytes saved (a half and a quarter of '
           "a slice of the model per device; a narrow weight is gathered as float32, "
           '"Gathering a narrow weight" below).')
  rows = [[mesh, dtype, in_bytes(row['frozen_bytes_per_device']), in_bytes(row['peak_bytes'])]
          for mesh, rows in r['meshes'].items() for dtype, row in rows.items()]
  return shows, _table(['mesh', 'frozen base', 'frozen bytes per device', 'process peak'],
                       rows)


def _frozen_accuracy(r: Results) -> Rendered:
  layers = sorted(r['logit_errors_by_layers'], key=int)
  shows = (f"The checkpoints are bfloat16, so held in bfloat16 the largest model's logits "
           f"differ from its float32 import's by {figure('frozen_accuracy.bf16_logits', r)} of "
           f"the largest logit; in int8 by {figure('frozen_accuracy.int8_logits', r)} (random "
           f"weights). LoRA for "
           f"{r['lora_steps']} steps on a quickstart LM trained {r['base_steps']} steps reaches "
           f"eval losses within {figure('frozen_accuracy.bf16_eval', r)} (bfloat16 base) and "
           f"{figure('frozen_accuracy.int8_eval', r)} (int8) of the float32 base's, at "
           f"{figure('frozen_accuracy.bf16_speed', r)} and {figure('frozen_accuracy.int8_speed', r)} "
           "its steps per second (a tiny model: widening and tying each weight's use costs "
           'more beside its small matmuls).')
  rows = [[f'{n}-layer Llama-shaped logits', '',
           f"{r['logit_errors_by_layers'][n]['bfloat16']:.1e}",
           f"{r['logit_errors_by_layers'][n]['int8']:.1e}"] for n in layers]
  final = {d: r['lora'][d]['eval_loss'][-1][1] for d in ('float32', 'bfloat16', 'int8')}
  rows.append([f"LoRA's last eval loss (step {r['lora']['float32']['eval_loss'][-1][0]})",
               f"{final['float32']:.4f}", f"{final['bfloat16']:.4f}", f"{final['int8']:.4f}"])
  rows.append(['LoRA steps/s', f"{r['lora']['float32']['steps_per_sec']:.2f}",
               f"{r['lora']['bfloat16']['steps_per_sec']:.2f}",
               f"{r['lora']['int8']['steps_per_sec']:.2f}"])
  return shows, _table(['', 'float32 base', 'bfloat16 base', 'int8 base'], rows)


def _dpo(r: Results) -> Rendered:
  met = 'met' if r['peak lora_dpo / lora_sft'] <= 1.15 else 'not met'
  shows = (f"LoRA DPO with its reference in each step (the model with its adapters off, "
           f"forward only) peaks at {figure('dpo.peak_ratio', r)} the memory of LoRA SFT on the "
           f"same rows (goal at most 1.15x: {met}) and runs {figure('dpo.speed', r)} its steps "
           f"per second; a precomputed reference runs {figure('dpo.precomputed_speed', r)} as "
           f"fast as the in-step one. Full DPO (every weight, reference precomputed) peaks at "
           f"{figure('dpo.full_peak', r)} LoRA DPO's memory.")
  names = {'lora_sft': 'LoRA SFT on the same rows', 'lora_dpo': 'LoRA DPO, reference in the step',
           'lora_dpo_pre': 'LoRA DPO, reference precomputed',
           'full_dpo_pre': 'full DPO, reference precomputed'}
  rows = [[label, in_bytes(r[name]['peak_bytes']), f"{r[name]['steps_per_sec']:.2f}"]
          for name, label in names.items()]
  return shows, _table(['setting', 'peak', 'steps/s'], rows)


def _peak_breakdown(r: Results) -> Rendered:
  shows = (f"At width {r['width']} ({in_millions(r['parameters'])} parameters, {r['setting']}) "
           f"the allocator peaks at {in_bytes(r['allocator_peak_bytes'])}, "
           f"{in_bytes(r['held_before_call_bytes'])} of it held before the call.")
  rows = [[row['op'].split('/')[-1], in_bytes(row['bytes']), sum(row['tensors'].values())]
          for row in r['by_op']]
  return shows, _table(['made by op', 'live at the peak', 'tensors'], rows)


def _fsdp_collectives(r: Results) -> Rendered:
  shows = (f"All-to-alls leave {figure('collectives.per_replica', r)} bf16 weights live at the "
           f"peak against {figure('collectives.dtensor', r)}, at "
           f"{times(r['speed_ratio_per_replica_vs_dtensor'])} DTensor's speed; the gradients "
           f"are {'the same' if r.get('same_gradient') else 'NOT the same'}.")
  rows = [[name, in_bytes(f['peak_bytes']), f"{f['peak_in_whole_bf16_weights']:.3g}",
           in_ms(1000 * f['seconds_per_call'])] for name, f in r['ways'].items()]
  return shows, _table(['way', 'peak', 'in whole bf16 weights', 'per call'], rows)


def _all_gather(r: Results) -> Rendered:
  return 'RSS added by the first call and by later calls, and the time per call.', _pivot(
      r['rows'], lambda row: f"{row['shape']} on dim {row['dim']}", lambda row: row['setting'],
      lambda row: (f"{in_bytes(row['first_call_bytes'])}, {in_bytes(row['later_calls_bytes'])}, "
                   f"{in_ms(1000 * row['seconds_per_call'])}"), 'shape (4 variables)')


def _startup(r: Results) -> Rendered:
  shows = (f"The quickstart's first step comes {figure('startup.quickstart', r)} after start, "
           f"plain TF's {in_s(r['best']['plain']['first_step'][0])}.")
  ratios = r.get('ratio_first_step_wall', {})
  rows = [[name, in_s(f['first_step'][0]), in_s(f['first_step_cpu_best']),
           times(ratios.get(name, 1.0))] for name, f in r['best'].items()]
  return shows, _table(['contender', 'first step (wall)', 'CPU', 'wall vs plain'], rows)


def _dtensor_compile(r: Results) -> Rendered:
  plain = r['best']['plain']['first_call']
  named = ', '.join(f'{k} {in_ms(v)}' for k, v in r.get('variables_ms_each', {}).items())
  shows = (f"The first call grows with the devices: {figure('compile.dtensor8', r)} on 8, "
           f"{in_s(plain)} in plain TF. A DVariable takes {named} to make, by its name.")
  rows = [[name, in_s(f['trace']), in_s(f['first_call']), times(f['first_call'] / plain),
           in_ms(1000 * f['later_call'])] for name, f in r['best'].items()]
  return shows, _table(['contender', 'trace', 'first call', 'vs plain', 'later call'], rows)


def _export_trace(r: Results) -> Rendered:
  without, with_ = r['best']['without AutoGraph'], r['best']['with AutoGraph']
  shows = (f"Without AutoGraph an export traces and writes in {in_s(without['export_cpu'])} "
           f"of CPU ({in_s(without['process_cpu'])} the whole `launch.export`), with it in "
           f"{in_s(with_['export_cpu'])} ({in_s(with_['process_cpu'])}): "
           f"{times(r['ratio_export_cpu_with_autograph'])}; the logits differ by "
           f"{r['max_logit_difference']:g}.")
  return shows, []


def _dropout_trace(r: Results) -> Rendered:
  one, old = r['best']['one range'], r['best']['broadcast ranges']
  shows = (f"{r['layers']} dropouts and their gradient: {old['ops']} graph ops with broadcast "
           f"ranges, {one['ops']} with one range; trace and first call "
           f"{in_s(one['trace_cpu'] + one['first_call_cpu'])} of CPU against "
           f"{in_s(old['trace_cpu'] + old['first_call_cpu'])} "
           f"({times(r['ratio_trace_and_compile_cpu'])}); masks "
           f"{'equal bit for bit' if r['same_masks'] else 'DIFFERENT'}.")
  return shows, []


def _grappler_passes(r: Results) -> Rendered:
  parts = []
  for mesh, by_name in r['best'].items():
    every, trimmed = by_name['TensorFlow default'], by_name['trimmed']
    unfolded = by_name['trimmed, no constant folding']
    first = {name: in_s(run['first_step_cpu'] + run['first_eval_cpu'])
             for name, run in by_name.items()}
    parts.append(
        f"{mesh}: first step and evaluation {first['trimmed']} of CPU trimmed, "
        f"{first['TensorFlow default']} with every pass "
        f"({times(r['ratios'][mesh]['compile_cpu_default_over_trimmed'])}); a later step "
        f"{in_ms(trimmed['later_step_ms'])} against {in_ms(every['later_step_ms'])} "
        f"({in_ms(unfolded['later_step_ms'])} without constant folding)")
  same = all(r['same_losses'].values())
  return '; '.join(parts) + f"; losses {'equal bit for bit' if same else 'DIFFERENT'}.", []


def _import_gc(r: Results) -> Rendered:
  on, paused = r['best']['collector on'], r['best']['paused + frozen']
  return (f"With the collector on, the import takes {in_s(on['import_cpu'])} of CPU and "
          f"{on['full_collections']} full collections; paused and frozen, "
          f"{in_s(paused['import_cpu'])} ({times(r['ratios']['import_cpu_on_over_paused'])}). "
          f"A full collection after it walks {on['objects']:,} objects in "
          f"{in_ms(1000 * on['later_collection_cpu'])} unfrozen and skips them frozen "
          f"({in_ms(1000 * paused['later_collection_cpu'])}).", [])


def _stream_open(r: Results) -> Rendered:
  per_stream, shared = r['best']['traced per stream'], r['best']['shared']
  return (f"A reader of 8 streams opens in {in_s(shared['open_cpu'])} of CPU with one "
          f"pipeline traced for all of them, against {in_s(per_stream['open_cpu'])} traced "
          f"per stream ({times(r['ratios']['open_per_stream_over_shared'])}); the first "
          f"reader, which traces, {in_s(shared['first_open_cpu'])} against "
          f"{in_s(per_stream['first_open_cpu'])}. Both read the same batches.", [])


def _allocator(r: Results) -> Rendered:
  glibc, jemalloc = r['best']['glibc malloc'], r['best']['jemalloc']
  same = 'equal bit for bit' if r['same_losses'] else 'DIFFERENT'
  return (f"With glibc's malloc a run takes {in_s(glibc['cpu_s'])} of CPU, with jemalloc "
          f"preloaded {in_s(jemalloc['cpu_s'])} ({times(r['ratios']['cpu_glibc_over_jemalloc'])})"
          f"; {in_s(glibc['wall_s'])} of wall time against {in_s(jemalloc['wall_s'])}, "
          f"{glibc['steps_per_s']:.1f} steps/s against {jemalloc['steps_per_s']:.1f}, a peak of "
          f"{glibc['peak_rss_mb']:.0f} MB against {jemalloc['peak_rss_mb']:.0f}; the "
          f"{r['losses_compared']} recorded losses {same}.", [])


def _small_input(r: Results) -> Rendered:
  runs = {k: v for k, v in r.items() if isinstance(v, dict) and 'calls' in v}
  size = {k: int(k.split(' x ')[0]) for k in runs}
  recompiled = [size[k] for k, v in runs.items() if v['recompiled_at_new_value']]
  never = [size[k] for k, v in runs.items() if not v['recompiled_at_new_value']]
  shows = (f"An input of up to {max(recompiled, default=0)} elements recompiles the function "
           f"at every new value; from {min(never, default='none')} elements on it does not.")
  return shows, _pivot(
      list(runs.items()), lambda run: run[0].split(' x ')[0],
      lambda run: run[0].split(' x ')[1],
      lambda run: (f"{'recompiles' if run[1]['recompiled_at_new_value'] else 'no'} "
                   f"({times(run[1]['new_value_vs_same_value'])})"),
      'elements: recompiled at a new value (time / same value)')


def _checkpoint(r: Results) -> Rendered:
  shows = (f"Save and restore run at {r['save_vs_raw']:.2f} and {r['restore_vs_raw']:.2f} of "
           f"raw disk; a save adds {r['save_peak_extra_host_mib']:.0f} MiB of host memory "
           f"({r['save_peak_extra_host_fraction_of_state']:.0%} of the state; gathering it: "
           f"{r['host_gather_peak_extra_fraction_of_state']:.0%}).")
  rows = [[name] + [f'{r[key]:.0f}' if key in r else '' for key in keys] for name, *keys in [
      ('meshgin', 'meshgin_save_mib_s', 'meshgin_restore_mib_s'),
      ('plain `tf.train.Checkpoint`', 'plain_tf_save_mib_s', 'plain_tf_restore_mib_s'),
      ("DTensor's own write", 'dtensor_native_save_mib_s', ''),
      ('raw disk (write + fsync, read)', 'raw_write_fsync_mib_s', 'raw_read_mib_s')]]
  return shows, _table([f"{r['mib']:.0f} MiB of state", 'save MiB/s', 'restore MiB/s'], rows)


def _import_hf(r: Results) -> Rendered:
  met = 'met' if r['import_peak / checkpoint'] <= 1.3 else 'not met'
  shows = (f"Importing {figure('import_hf.parameters', r)} parameters "
           f"({figure('import_hf.checkpoint', r)} of bfloat16 "
           f"safetensors) peaked at {figure('import_hf.peak', r)} of host memory, "
           f"{figure('import_hf.ratio', r)} the checkpoint (goal at most 1.3x: {met}): the "
           'step-0 checkpoint is streamed to disk in bfloat16, each tensor written as it is '
           'converted, and the model is never held whole; '
           f"{r['import_peak - read_peak (GiB)']:.2f} GiB above reading every tensor alone. "
           f"It took {r['import_seconds / read_seconds']:.0f}x as long as reading the files.")
  shows += ' ' + '; '.join(f"{name} {r[key]['seconds']:.1f} s, peak {r[key]['peak_gib']:.2f} GiB"
                           for name, key in (('reading every tensor', 'read'),
                                             ('the import', 'import'))) + '.'
  return shows, []


def _input(r: Results) -> Rendered:
  lm = r['lm_small_input']
  rates = ' and '.join(f'{k} {v:,.0f}' for k, v in r['examples_per_sec'].items())
  shows = (f"meshgin's reader runs at {figure('input.ratio', r)} a bare read (examples/s: "
           f"{rates}); `next(reader)` is {lm['input_fraction']:.2%} of a "
           f"{in_ms(1000 * lm['step_seconds'])} lm_small step.")
  return shows, []  # no table: the page's 300 lines


def _layout_resolution(r: Results) -> Rendered:
  shows = (f"{figure('layouts.speedup', r)} faster ({in_s(r['meshgin_seconds'])} against a "
           f"per-rule loop's {in_s(r['naive_seconds'])}) over {r['paths']:,} paths and "
           f"{r['rules']} rules, with {r['mismatches']} different answers.")
  return shows, []  # no table: the page's 300 lines


def _outcomes(columns: list[str], result: Callable[[dict], str], shows: str) -> Callable:
  """Rows of settings and their outcome; identical rows are listed once."""
  def render(r: Results) -> Rendered:
    rows = dict.fromkeys(tuple([str(row.get(c, '')) for c in columns] + [result(row)])
                         for row in r['rows'])
    return shows, _table(columns + ['outcome'], [list(row) for row in rows])
  return render


def _gather_lowering(r: Results) -> Rendered:
  return 'CollectiveGatherV2 fails to compile most relayouts on `data=2 x model=4`.', _pivot(
      r['rows'], lambda row: f"{row['mesh']}, {row['mode']}", lambda row: row['lowering'],
      lambda row: f"{row['ok']} right, {row['error']} fail, {row['wrong']} wrong", 'relayouts')


def _grappler(r: Results) -> Rendered:
  shows = (f"From {figure('grappler.first_failing', r)} up the sharded sum fails with "
           "TensorFlow's default; with the optimizer off every case is right.")
  return shows, _pivot(r['rows'], lambda row: row['weight'],
                       lambda row: f"{row['layout']}, {row['setting'].split(' (')[0]}", _ok,
                       'weight')


def _cross_client(row: dict) -> str:
  first, second = outcome(row['client 0']), outcome(row['client 1'])
  return first if first == second else f'client 0: {first}; client 1: {second}'


def _in_words(cases: list[tuple[str, str]]) -> str:
  """(setting, outcome) pairs as one sentence, settings of one outcome
  together: where a table would say no more (the page's 300 lines)."""
  settings: dict[str, list[str]] = {}
  for setting, said in cases:
    settings.setdefault(said, []).append(setting)
  return 'Outcomes: ' + '; '.join(f"{' / '.join(names)}: {said}"
                                 for said, names in settings.items()) + '.'


def _keras_remat(r: Results) -> Rendered:
  return f"Keras {r['keras']}, TF {r['tensorflow']}. " + _in_words(
      [(k, outcome(v)) for k, v in r['results'].items()]), []


def _submesh_residual(r: Results) -> Rendered:
  return _in_words([(row['variation'], _ok(row)) for row in r['rows']]), []


def _moe_routing(r: Results) -> Rendered:
  """What fails in words; every other case in one count."""
  failed = [row for row in r['rows'] if not row.get('ok')]
  said = _in_words([(f"{row['case']}, {row['placing']}, {row['threads']}", _ok(row))
                    for row in failed]) if failed else 'Nothing fails.'
  return (f"{said} The other {len(r['rows']) - len(failed)} cases (each form, rows or "
          "experts split or neither, two thread settings) give one device's gradient."), []


def _narrow_gather(r: Results) -> Rendered:
  default = {(dtype, way): narrow_peak(dtype, way, 'default')(r)
             for dtype in ('bfloat16', 'int8') for way in ('narrow', 'widened')}
  same = all(all(found['same_values'].values()) for found in r['lowerings'].values())
  return (f"Under CollectiveGatherV2 a float32 weight holds "
          f"{figure('narrow_gather.float32', r)} at the call's peak; gathered as stored, a "
          f"bfloat16 one {figure('narrow_gather.bf16', r)} and an int8 one "
          f"{figure('narrow_gather.int8', r)} (a zero-padded all-reduce, int8's in 64-bit "
          f"integers); widened to float32 on each slice first, at most "
          f"{figure('narrow_gather.widened', r)}. Under the default lowering: bfloat16 "
          f"{default[('bfloat16', 'narrow')]} either way, int8 {default[('int8', 'narrow')]} "
          f"as stored and {default[('int8', 'widened')]} widened. "
          + ('The values are the same either way.' if same else 'The values differ.')), []


def _truncated(r: Results) -> Rendered:
  def cell(run: dict) -> str:
    return f"{run['records']} read, {outcome(run['error']) if run['error'] else 'no error'}"
  runs = [(*name.split(', buffer '), v) for name, v in r.items()
          if isinstance(v, dict) and 'records' in v]
  return "Cut inside a record's header a file reads as shorter, with no error.", _pivot(
      runs, lambda run: run[0], lambda run: f'buffer {run[1]}', lambda run: cell(run[2]),
      'damage in record 500')


def _while_loop(r: Results) -> Rendered:
  """A few rows: what fails, how often over every run, and what works."""
  def said(message: str) -> str:
    if 'Cannot add function' in message:
      return 'fails: a loop body of that name exists'
    if 'StridedSlice' in message or 'garbled' in message:
      return 'fails to compile (garbled layout error)'
    return outcome(message)

  def runs(rows: list[dict]) -> str:
    seen = [said(run['outcome']) for row in rows for run in row.get('runs', [row])]
    counts = {o: seen.count(o) for o in dict.fromkeys(seen)}
    if len(counts) == 1:
      return f'{seen[0]} in all {len(seen)} runs'
    return ', '.join(f'{o} in {n} of {len(seen)} runs' for o, n in counts.items())

  rows = r['rows']
  decoder_fails = [row for row in rows if row['claim'] == 'decoder' and 'layers' not in row
                   and 'cached' not in row and row['second'] != 'same call']
  second_ok = [row for row in rows if row['claim'] in ('second_loop', 'attention_loop', 'decoder')
               and row not in decoder_fails]
  relaid = [row for row in rows if row['claim'] == 'unchanged_variable'
            and row['returned'] in ('relaid out', 'times one, relaid out')]
  new_axis = [row for row in rows if row.get('how') == 'x[:, None]']
  rest = [row for row in rows if row['claim'] in ('unchanged_variable', 'slicing')
          and row not in relaid and row not in new_axis]
  table = [["a second function with `CachedLM.generate`'s loop (2 layers, cached), retraced "
            'or another decoder', runs(decoder_fails)],
           [f'a second function with any other loop ({len(second_ok)} variations)',
            runs(second_ok)],
           ['a loop variable returned unchanged through `relayout` (or `* 1`)', runs(relaid)],
           ['`x[:, None]` on a sharded DTensor', runs(new_axis)],
           ['the rest: that variable as is, or recomputed; `tf.expand_dims`, `x[:, -1]`', runs(rest)]]
  shows = ("A second function fails only with meshgin's own decoder loop, not with any minimal "
           'loop; the crash needs the relayout, not the unchanged variable alone.')
  return shows, _table(['in `tf.function` on a DTensor mesh', 'outcome'], table)


DECODERS = {'meshgin cached': 'meshgin, cached', 'meshgin recomputing': 'recomputing',
            'plain TF cached loop': 'plain TF loop', 'keras_hub GPT2CausalLM': 'keras_hub',
            'SavedModel generate': 'SavedModel', 'launch.decode path': 'launch.decode'}


def _decode(r: Results) -> Rendered:
  ratios = r.get('ratios', {})
  said = {'cached / recomputing': 'With the cache meshgin runs {} as fast as recomputing',
          'cached / plain TF cached loop': "at {} a hand-written plain-TF cached loop's rate",
          'cached / keras_hub': "at {} keras_hub's GPT2CausalLM's",
          'SavedModel / launch.decode path': "the exported SavedModel's `generate` runs at {} "
                                             "`launch.decode`'s path (DTensor, one device)"}
  parts = [words.format(times(ratios[k])) for k, words in said.items() if k in ratios]
  cells = []
  for name, info in r['contenders'].items():
    cell = (f"{info['tokens_per_sec']:,.0f}" if 'tokens_per_sec' in info else
            'not installed' if 'unavailable' in info else outcome(info.get('error')))
    cells.append((DECODERS.get(name, name), cell))
  setting = r['setting']
  exported = [p for p in parts if p.startswith("the exported")]
  shows = (f"{setting['batch']} prompts of {setting['prompt']} tokens, {setting['new_tokens']} "
           f"new tokens each, greedy. "
           + '; '.join([', '.join(p for p in parts if p not in exported)] + exported) + '.')
  return shows, _table(['decoder'] + [c[0] for c in cells],
                       [['new tokens/s'] + [c[1] for c in cells]])


def _moe(r: Results) -> Rendered:
  goal = 'met' if abs(r['expert_bytes: expert=8 / replicated'] - 0.125) <= 0.0125 else 'not met'
  largest = ''
  if 'largest: expert=8 / replicated' in r:
    largest = (f" In {r['budget_gib']:g} GiB per process, expert parallelism trains an MoE "
               f"model of {figure('moe.largest_ep', r)} parameters, "
               f"{figure('moe.largest_ratio', r)} the {figure('moe.largest_replicated', r)} "
               'that fits with every expert on every device.')
  shows = (f"On `expert=8` each device holds {figure('moe.expert_bytes', r)} of the expert "
           f"weights and Adam state it holds with the experts replicated (goal 1/8 within 10%: "
           f"{goal}). Timed in turns, `expert=8` runs {figure('moe.speed_replicated', r)} the "
           f"steps per second of the replicated experts and {figure('moe.speed_dense', r)} those "
           'of the dense model with the same active parameters (the routing einsums, two '
           'all-to-alls per routed block and the router cost more than the smaller '
           f'matmuls save at this size).{largest}')
  names = (('expert=8', '`expert=8`, the batch on it (GShard)'),
           ('replicated', '`data=8`, every expert on every device'),
           ('dense', 'dense, `ffn_dim` 4 x width (the active width)'))
  def maybe(value, render):
    return '' if value is None else render(value)
  rows = [[label, f"{r['settings'][key]['parameters']:,}",
           maybe(r['settings'][key].get('expert_bytes_per_device'), in_bytes),
           f"{r['steps_per_sec_in_turns'][key]:.2f}",
           in_bytes(r['peak_bytes_at_width'][key]),
           maybe(r['settings'][key].get('largest_parameters'), in_millions)]
          for key, label in names]
  return shows, _table(['setting', f"parameters at width {r['width']}",
                        'experts + Adam per device', 'steps/s (best in turns)', 'process peak',
                        'largest that fits'], rows)


def _moe_exchange(r: Results) -> Rendered:
  shows = (f"The batch's own axis: {figure('moe_exchange.same', r)} per device, forward (there "
           f"and back); an axis of its own: {figure('moe_exchange.two', r)} (the dispatch is "
           'a local slice of rows every expert shard holds).')
  def listed(ops: dict) -> str:
    return ', '.join(f'{n:g} x {op}' for op, n in ops.items()) or 'none'
  rows = [[name, listed(c['ops']), listed(c.get('ops_with_backward', {})),
           in_ms(1000 * c['seconds_per_call'])] for name, c in r['cases'].items()]
  return shows, _table(['exchange', 'collectives per device, forward',
                        'with the backward and the loss', 'forward per call'], rows)


@dataclasses.dataclass(frozen=True)
class Section:
  heading: str
  measures: str  # one sentence: what the script measures
  render: Callable[[Results], Rendered]


SECTIONS: dict[str, dict[str, Section]] = {  # group -> results file -> its section
    'Training speed': {
        'step_breakdown.json': Section("Where a step's time goes",
                                       "lm_small's step, part by part, on 1 and 8 devices.",
                                       _step_breakdown),
        'step_split.json': Section('Meshes and variants side by side', '`bench/step.py --groups '
                                   "split`: lm_small on 1 device, `data=8` and 2x4, in turns.",
                                   _step_split),
        'split_matmul_limit.json': Section('Matmuls cut over devices', "lm_small's matmuls, one "
                                           'device against cut 8 ways.', _split_matmul),
        'devices_concurrent.json': Section('Logical CPU devices at once', 'A matmul on each of 2 '
                                           'devices at once, against one.', _devices_concurrent),
        'step.json': Section('Pipeline engines', "`bench/step.py --groups pipeline`: lm_small, 8 "
                             'micro-batches, `stage=2 x data=2 x model=2`.', _step_pipeline),
        'pipeline.json': Section("The pipeline runtime's costs", 'FC cells, a device per stage; '
                                 "partitions' balance.", _pipeline),
        'shift.json': Section("The SPMD engine's per-clock moves", 'Each way DTensor offers to '
                              'move the stage buffer a slot, on 2x2x2.', _shift_moves),
        'step_fsdp.json': Section('Fully sharded parameters', '`bench/step.py --groups fsdp`: '
                                  '`train.fsdp = True` against the default.', _step_fsdp),
        'bf16_matmul.json': Section('bfloat16 matmuls', 'Square MatMuls, bf16 against float32.',
                                    _bf16_matmul),
        'bf16_einsum.json': Section('bfloat16 einsums', 'x[b, t, d] @ w[d, f] forward and '
                                    'backward, einsum against matmul.', _bf16_einsum),
    },
    'Memory': {
        'memory.json': Section('The largest model in a memory budget', 'Peak host memory of '
                               'training runs, predicted and measured.', _memory),
        'finetune.json': Section('Fine-tuning: full vs LoRA', '`bench/finetune.py`: the LM of '
                                 '`bench/memory.py` trained whole, or frozen with LoRA '
                                 'adapters, in one host-memory budget.', _finetune),
        'frozen_memory.json': Section(
            'A frozen base in bfloat16 or int8: memory', '`bench/frozen_memory.py`: LoRA '
            f"(rank 8, q and v) on bench/memory.py's LM at width {1536}, 3 steps, per mesh "
            'and frozen dtype.', _frozen_memory),
        'frozen_accuracy.json': Section(
            'A frozen base in bfloat16 or int8: accuracy', '`bench/frozen_accuracy.py`: '
            'logits of a random Llama-shaped import held narrow against float32 (relative to '
            'the largest logit), and LoRA from a trained quickstart LM on each base.',
            _frozen_accuracy),
        'dpo.json': Section('Preference tuning (DPO)', '`bench/dpo.py`: a width-1024, 4-block '
                            'LM on bytes, 16 rows (8 pairs) a step on `data=8`, LoRA rank 8 on '
                            'the queries and values unless full.', _dpo),
        'peak_breakdown.json': Section("What makes a step's peak", "Tensors live at a gradients "
                                       "call's allocator peak, by op.", _peak_breakdown),
        'fsdp_collectives.json': Section("FSDP's collectives on one weight", "A [2048, 8192] "
                                         "weight's bf16 gradients on `data=8`.", _fsdp_collectives),
        'all_gather_memory.json': Section('All-gather lowerings', 'A sharded -> replicated '
                                          'relayout on 8 devices, both lowerings.', _all_gather),
        'accumulation_memory.json': Section('Gradient accumulation on CPU', 'A width-768 LM in '
                                            'bf16 at 1, 2 and 4 micro-steps.',
                                            accumulation_section),
    },
    'Mixture of experts': {
        'moe.json': Section('Expert parallelism', '`bench/moe.py`: quickstart\'s LM with 8 '
                            'experts of 2 x width per block, top-2, on 8 CPU devices, float32.',
                            _moe),
        'moe_exchange.json': Section("The tokens' exchange", '`bench/moe_exchange.py`: the '
                                     '[rows, E, slots, D] dispatch buffer relaid to its experts '
                                     'and combined back, on 8 CPU devices.', _moe_exchange),
    },
    'Start-up': {
        'startup.json': Section('Time to the first step', '`launch.train` against a hand-written '
                                'TF program of the same model.', _startup),
        'dtensor_compile_limit.json': Section("A DTensor function's first call", 'One Adam update '
                                              'in a fresh process.', _dtensor_compile),
        'small_input_recompile.json': Section('Recompiles on a changed small input', 'A step '
                                              'function given an extra input.', _small_input),
        'export_trace.json': Section("Tracing an export's signatures", "The quickstart's "
                                     '`launch.export`, with and without AutoGraph.', _export_trace),
        'dropout_trace.json': Section("A dropout mask's element index", 'One range against '
                                      'broadcast ranges, 12 dropouts on 2x2.', _dropout_trace),
        'grappler_passes.json': Section("Grappler's passes on CPU", "The quickstart's model, "
                                        "every pass against `build_mesh`'s.", _grappler_passes),
        'import_gc.json': Section('The garbage collector and the import', 'Importing '
                                  'TensorFlow and DTensor, fresh processes in turns.',
                                  _import_gc),
        'stream_open.json': Section("Opening a reader's streams", 'A corpus of 8 files '
                                    'in 8 streams, fresh processes in turns.', _stream_open),
        'allocator.json': Section('The C allocator', "The quickstart's `launch.train`, 100 "
                                  'steps, fresh processes in turns.', _allocator),
    },
    'Choosing a layout': {
        'suggest.json': Section('The suggester against every candidate', '`bench/suggest.py`: '
                                'lm_small and a width-768 LM on 8 devices, every candidate '
                                'trained.', suggest_section),
        'suggest_moe.json': Section('The suggester on a mixture of experts', '`bench/suggest.py '
                                    "--models lm_moe`: bench/moe.py's 8-expert top-2 LM on 8 "
                                    'devices, its experts replicated or split (over data or an '
                                    'expert axis), every candidate trained.',
                                    suggest_moe_section),
        'calibration.json': Section("The cost model's rates", '`bench/calibrate.py`: this '
                                    "machine's 8 CPU devices.", calibration_section),
        'spmd_repeats.json': Section("Circular repeats' gradient sums", '`bench/spmd_repeats.py`'
                                     ': lm_small, `stage=2 x data=4`, SPMD engine, 4 '
                                     'micro-batches.', spmd_repeats_section),
    },
    'Inference': {
        'decode.json': Section('Decoding with the KV cache', '`bench/decode.py`: an lm_small-'
                               'sized LM (max_len 256), in turns.', _decode),
    },
    'Checkpoints, input and layouts': {
        'checkpoint.json': Section('Checkpoint throughput', 'Save and restore of a sharded state '
                                   'on 2x4.', _checkpoint),
        'import_hf.json': Section('Importing a Hugging Face checkpoint', '`bench/import_hf.py`: '
                                  'a random Llama-shaped bfloat16 checkpoint imported on 8 CPU '
                                  'devices with FSDP.', _import_hf),
        'input.json': Section('The input pipeline', "`tfrecord_task`'s reader alone, and its "
                              'share of a step.', _input),
        'layout_resolution.json': Section('Layout rule resolution', 'Many paths against many '
                                          'rules, answers compared.', _layout_resolution),
    },
    'TensorFlow limits': {
        'gather_lowering.json': Section('Relayouts under each gather lowering', 'Every relayout '
                                        'of a small tensor.', _gather_lowering),
        'grappler_addn.json': Section("Grappler's memory optimizer on a sharded sum", 'A weight '
                                      'used four times on `data=8`.', _grappler),
        'cross_client_submesh.json': Section('Sub-meshes across clients', 'A value moved between '
                                             'stage sub-meshes of 2 real clients.', _outcomes(
            ['placement', 'source layout'], _cross_client,
            'Only replicated values between stages that span every client move.')),
        'submesh_residual.json': Section("Pinning the sub-mesh engine's residual stream",
                                         'lm_pipeline.gin, 3 steps.', _submesh_residual),
        'narrow_gather_limit.json': Section(
            'Gathering a narrow weight', 'One [1536, 6144] weight stored split over `data=8` '
            'in float32, bfloat16 or int8, gathered and used in a matmul: bytes made in the '
            'call and live at its peak (all devices).', _narrow_gather),
        'moe_routing_limit.json': Section("An MoE router's gradient on split rows",
                                          'Router probabilities [16, 32, 8] on `data=8`, '
                                          'against one device.', _moe_routing),
        'keras_remat_limit.json': Section("Keras' remat under tf.function", 'Whole-layer and '
                                          'activation remat, eager and traced.', _keras_remat),
        'truncated_tfrecord.json': Section('Damaged TFRecord files', '`TFRecordDataset` on a file '
                                           'cut or changed.', _truncated),
        'dtensor_while_loop.json': Section('While loops on a mesh', 'A DTensor `tf.while_loop` run '
                                           'by a second function, or returning a variable '
                                           'unchanged; slicing.', _while_loop),
    },
}


# ------------------------------------------------------------------ the page


def _generic(r: Any) -> Rendered:
  """Any results file: its numbers and outcomes by key path (at most 30)."""
  rows: list[list[str]] = []
  def walk(value: Any, path: str) -> None:
    if isinstance(value, dict):
      for key, inner in value.items():
        if path or key not in ('date', 'commit', 'machine', 'command'):
          walk(inner, f'{path} / {key}' if path else str(key))
    elif isinstance(value, list) and all(isinstance(v, (dict, list)) for v in value):
      for i, inner in enumerate(value):
        walk(inner, f'{path} / {i + 1}')
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      rows.append([path, value if isinstance(value, int) else f'{value:.4g}'])
    else:
      rows.append([path, outcome(value) if isinstance(value, str) else value])
  walk(r if isinstance(r, dict) else {'rows': r}, '')
  return 'Shown by key (no renderer in bench/report.py yet).', (
      _table(['figure', 'value'], rows[:30]) if rows else ['(no figures)'])


def script_of(r: Results, name: str) -> str:
  for part in str(r.get('command') or '').split():
    if part.endswith('.py'):
      return part
  return f"bench/{name.removesuffix('.json')}.py"


def _machine(r: Results) -> str:
  machine = r.get('machine') or {}
  isa = machine.get('vector_extensions')  # recorded since 2026-12-07
  return (f"{machine.get('cores', '?')} cores, {machine.get('processor', '?')}"
          + (f" ({isa})" if isa else ''))


def _measured(r: Results, name: str) -> str:
  commit = str(r.get('commit') or 'not recorded')
  command = f"`{r['command']}`" if r.get('command') else 'a command not recorded'
  return (f"Measured {str(r.get('date') or 'on a date not recorded')[:10]} by {command}, commit "
          f"`{commit.removesuffix(DIRTY)[:7]}`{'†' if commit.endswith(DIRTY) else ''}, "
          f"{_machine(r)}: `bench/results/{name}`.")


def load(results_dir: str = RESULTS) -> dict[str, Results]:
  """Every results file in results_dir, by file name."""
  loaded = {}
  for path in sorted(glob.glob(os.path.join(results_dir, '*.json'))):
    with open(path) as f:
      loaded[os.path.basename(path)] = json.load(f)
  return loaded


def performance_markdown(results_dir: str = RESULTS) -> str:
  """The page, from every results file in results_dir."""
  results = load(results_dir)
  summary = [[f.what, f.render(results[f.file]), f.against(results[f.file]),
              _machine(results[f.file]), f'`{script_of(results[f.file], f.file)}`']
             for f in FIGURES.values() if f.what and f.file in results]
  lines = ['# Performance', '',
           'What the scripts in `bench/` measured ([what each measures](benchmarks.md)), on '
           'small shared virtual machines: absolute times are noisy, and the ratios, measured '
           'side by side in turns, are the figures to compare. Generated from '
           f'`bench/results/*.json` by `{COMMAND}`.', '', '## Summary', '']
  lines += _table(['what was measured', 'figure', 'against', 'machine', 'script'], summary)
  known = {name for group in SECTIONS.values() for name in group}
  others = {name: Section(f'Other results: {name}', f'`{script_of(r, name)}`.', _generic)
            for name, r in results.items() if name not in known}
  for group, sections in {**SECTIONS, 'Other results': others}.items():
    present = [(name, section) for name, section in sections.items() if name in results]
    lines += ['', f'## {group}'] if present else []
    for name, section in present:
      shows, table = section.render(results[name])
      lines += ['', f'### {section.heading}',
                f'{section.measures} {shows} {_measured(results[name], name)}']
      lines += [''] + table if table else []
  if any(str(r.get('commit', '')).endswith(DIRTY) for r in results.values()):
    lines += ['', '† measured with uncommitted changes on top of that commit.']
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  print(performance_markdown(), end='')
