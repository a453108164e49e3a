"""How the docs write benchmark results: formats, outcomes, and quoted figures.

A `Figure` names a results file in bench/results/ and renders one figure from
it exactly as the pages write it, so a page and its measurement cannot drift
apart unnoticed:

    results = json.load(open('bench/results/step.json'))
    FIGURES['pipeline.spmd'].render(results)   # -> '0.61'

The formats (`in_ms`: '593 ms', `times`: '1.08x', `in_bytes`: '61 MiB') and
`outcome` (a TensorFlow error message in a few plain words) serve
bench/report.py too, which shows every figure here on docs/performance.md
(those with a `what` in its summary table). tests/test_docs_figures.py checks
that each `quoted` figure is written on a docs page near the script that
measured it, and that every figure written near a bench/ script is one of
these. To quote a new figure on a page, add it here first.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

CLOCKS = 9  # clocks of an SPMD step in step.py's pipeline group: S + M - 1 (S=2, M=8)

Results = dict  # one results file's JSON


# Formats: the way the pages write each kind of figure.


def in_ms(ms: float) -> str:
  return f'{ms:.0f} ms' if ms >= 10 else f'{ms:.1f} ms' if ms >= 1 else f'{ms:.2f} ms'


def in_s(seconds: float) -> str:
  return f'{seconds:.2f} s'


def times(ratio: float) -> str:
  return f'{ratio:.2f}x'


def in_bytes(count: float) -> str:
  return f'{count / 2**30:.2f} GiB' if count >= 2**30 else f'{count / 2**20:.0f} MiB'


def in_millions(count: float) -> str:
  return f'{count / 1e6:.1f}M'


# A TensorFlow message in a few plain words: the page never shows one raw
# (they carry internal function names and hashes).
OUTCOMES = [
    ('values right', 'right'), ('wrong values', 'wrong values'), ('SIGSEGV', 'crashes (SIGSEGV)'),
    ("hosts don't match", 'fails to compile (send and receive hosts differ)'),
    ('SPMD expansion', 'fails to compile (SPMD expansion)'),
    ('CopyToMeshOp', 'fails to compile (cross-mesh copy needed)'),
    ('does not implement layout propagation', 'fails to compile (no layout propagation)'),
    ('does not match layout specified', 'fails to compile (relayout mismatch)'),
    ('number of elements', 'fails to compile (reshape size)'),
    ('Parameters and update must be the same size', 'fails (Grappler rewrite: sizes differ)'),
    ('custom_gradient', 'fails (custom_gradient needs eager)'),
    ('truncated record', 'error: truncated record'),
    ('corrupted record', 'error: corrupted record'),
]


def outcome(message: Any) -> str:
  """A short plain outcome for a result's message: 'ok', what failed, a note."""
  if message in (None, '', True, 'ok'):
    return 'ok'
  for needle, short in OUTCOMES:
    if needle in str(message):
      return short
  kind = re.match(r'(\w+(?:Error|Exception)):', str(message))
  return f'fails ({kind.group(1)})' if kind else str(message)[:60]


def row_where(rows: list[dict], **match) -> dict:
  return next(r for r in rows if all(r.get(k) == v for k, v in match.items()))


def _collectives(r: Results, case: str) -> str:
  """bench/moe_exchange.py's collectives per device in one exchange."""
  ops = r['cases'][case]['ops']
  return ', '.join(f'{n:g} {op}' for op, n in ops.items()) or 'no collective'


@dataclasses.dataclass(frozen=True)
class Figure:
  """A figure rendered from one results file, as the pages write it. With
  `what` it is a row of the summary (`against`: what it is compared with);
  `quoted`: another docs page quotes it (tests/test_docs_figures.py)."""
  file: str
  render: Callable[[Results], str]
  quoted: bool = True
  what: str = ''
  against: Callable[[Results], str] = lambda r: ''


def _loop_ms(name: str) -> Callable[[Results], str]:
  return lambda r: in_ms(r[name]['loop_step_ms'])


def _matmul(form: str) -> Callable[[Results], str]:
  return lambda r: times(row_where(r['rows'], form=form, threads='meshgin')['ratio_to_one_device'])


def _ratio(name: str) -> Callable[[Results], str]:
  return lambda r: f"{r['pipeline'][name]['ratio']['value']:.2f}"


def _kept(engine: str, bound: str) -> Callable[[Results], str]:
  """An engine's rate over its micro-batches' rate (both against one model)."""
  def render(r: Results) -> str:
    runs = r['pipeline']
    return f"{runs[engine]['ratio']['value'] / runs[bound]['ratio']['value']:.2f}"
  return render


# The rates of lm_small fed 8 micro-batches, pipelined or not, over the whole batch's.
PIPELINE_RATIOS = ('spmd S=2 M=8', 'submesh S=2 M=8', 'unpipelined data=2 x model=4, M=8',
                   'serial data=2 x model=2, M=8')


def _shift(r: Results, name: str) -> float:
  return r['shift'][name]['ms']


def _fsdp(name: str) -> Callable[[Results], str]:
  return lambda r: times(r['fsdp'][name]['ratio']['value'])


def _largest(r: Results, setting: str) -> int:
  """The parameters of the largest model that fit the budget with `setting`."""
  return r['settings'][setting]['largest_parameters']


def _setting(name: str, key: str, form: Callable = str) -> Callable[[Results], str]:
  return lambda r: form(r['settings'][name][key])


def _whole(way: str) -> Callable[[Results], str]:
  return lambda r: f"{r['ways'][way]['peak_in_whole_bf16_weights']:.3g} whole"


def _gathered(setting: str) -> Callable[[Results], str]:
  return lambda r: in_bytes(row_where(r['rows'], setting=setting)['first_call_bytes'])


def _bf16_range(r: Results) -> str:
  ups = [row['bf16_speedup'] for row in r['rows']
         if row['onednn'] and not row['jit_compile'] and row['intra_op_threads'] == 2]
  return f'{min(ups):.2f}-{max(ups):.2f}x'


def row_spread(r: Results, key: str) -> str:
  """The range of `key` over a results file's rows, as ratios: '5.7-7.7x'."""
  values = [row[key] for row in r['rows']]
  return f'{min(values):.1f}-{max(values):.1f}x'


def _first_step(name: str) -> Callable[[Results], str]:
  return lambda r: in_s(r['best'][name]['first_step'][0])


def _first_call(name: str) -> Callable[[Results], str]:
  return lambda r: in_s(r['best'][name]['first_call'])


def _split_rate(name: str) -> Callable[[Results], str]:
  """A contender's rate as a share of meshgin on one device's (step.py's split group)."""
  return lambda r: f"{r['split'][name]['ratio']['value']:.2f}"


def _split_slower(name: str, than: str) -> Callable[[Results], str]:
  """How many times `than`'s step time `name`'s takes."""
  return lambda r: times(r['split'][name]['ms_per_step'] / r['split'][than]['ms_per_step'])


def narrow_peak(dtype: str | None, way: str, lowering: str = 'CollectiveGatherV2'
                ) -> Callable[[Results], str]:
  """bench/limits/narrow_gather_limit.py: the most bytes live at a call's peak
  over the rows of `dtype` (None: any) gathered `way` under `lowering`."""
  return lambda r: in_bytes(max(row['peak_bytes'] for row in r['lowerings'][lowering]['rows']
                                if row['way'] == way and dtype in (None, row['dtype'])))


def _before(r: Results, dtype: str) -> float:
  """frozen_memory.json: a narrow base's FSDP peak over float32's, measured
  before a narrow weight was widened ahead of its gather."""
  peaks = r['before_widened_gather']['data=8 + FSDP']
  return peaks[f'{dtype}_peak_gib'] / peaks['float32_peak_gib']


def _alone(r: Results, dtype: str) -> float:
  """calibration.json: the one-device run's step seconds in `dtype`."""
  return row_where(r['runs'], label=f'data=1, {dtype}')['measured_s']


def _large_logits(r) -> dict:
  """frozen_accuracy.json's logit errors of its largest model."""
  return r['logit_errors_by_layers'][max(r['logit_errors_by_layers'], key=int)]


FIGURES: dict[str, Figure] = {
    'step.data8': Figure('step_breakdown.json', _loop_ms('data=8 (sharded state)'),
                         what='lm_small training step on `data=8` (8 CPU devices)',
                         against=lambda r: f"{_loop_ms('1 device')(r)} on one device"),
    'step.one_device': Figure('step_breakdown.json', _loop_ms('1 device')),
    'step.data8_unsharded': Figure('step_breakdown.json', _loop_ms('data=8, unsharded state')),
    'step.2x4': Figure('step_breakdown.json', _loop_ms('data=2 x model=4')),
    'step.2x4_sharded': Figure('step_breakdown.json', _loop_ms('data=2 x model=4, sharded state')),
    'matmul.dtensor': Figure('split_matmul_limit.json', _matmul('DTensor data=8'),
                             what="lm_small's matmuls cut 8 ways on DTensor `data=8` (time)",
                             against=lambda r: 'the same on one device'),
    'matmul.tf_devices': Figure('split_matmul_limit.json', _matmul('8 tf.devices')),
    'split.data8': Figure('step_split.json', _split_rate('meshgin data=8')),
    'split.fused': Figure('step_split.json', _split_rate('meshgin data=8, fused step')),
    'split.fused_xla': Figure('step_split.json', _split_rate('meshgin data=8, fused step, XLA')),
    'split.residual': Figure(
        'step_split.json', _split_slower('meshgin 2x4, residual left to DTensor', 'meshgin 2x4'),
        what='lm_small on `data=2 x model=4`, residual stream left to DTensor (step time)',
        against=lambda r: 'the stream pinned, as meshgin runs it'),
    'split.unsharded_state': Figure(
        'step_split.json', _split_slower('meshgin data=8, unsharded state', 'meshgin data=8')),
    'pipeline.spmd': Figure('step.json', _ratio('spmd S=2 M=8'),
                            what='SPMD pipeline engine, lm_small, S=2, M=8 (rate)',
                            against=lambda r: 'unpipelined on `data=2 x model=4`'),
    'pipeline.submesh': Figure('step.json', _ratio('submesh S=2 M=8'),
                               what='sub-mesh pipeline engine, the same (rate)',
                               against=lambda r: 'serial on `data=2 x model=2`'),
    'pipeline.unpipelined_m8': Figure('step.json', _ratio('unpipelined data=2 x model=4, M=8')),
    'pipeline.serial_m8': Figure('step.json', _ratio('serial data=2 x model=2, M=8')),
    'pipeline.spmd_kept': Figure('step.json', _kept('spmd S=2 M=8',
                                                    'unpipelined data=2 x model=4, M=8')),
    'pipeline.submesh_kept': Figure('step.json', _kept('submesh S=2 M=8',
                                                       'serial data=2 x model=2, M=8')),
    'pipeline.about': Figure('step.json', lambda r: 'about {:.1f}'.format(sum(
        r['pipeline'][name]['ratio']['value'] for name in PIPELINE_RATIOS) / len(PIPELINE_RATIOS))),
    'pipeline.spmd_step': Figure('step.json',
                                 lambda r: in_ms(r['pipeline']['spmd S=2 M=8']['ms_per_step'])),
    'shift.all_to_all': Figure('shift.json',
                               lambda r: times(r['shift']['all_to_all_gather']['vs_einsum'])),
    'shift.per_step': Figure('shift.json', lambda r: f"{CLOCKS * _shift(r, 'einsum'):.0f} ms"),
    'shift.saving': Figure('shift.json', lambda r: (
        f"{CLOCKS * (_shift(r, 'einsum') - _shift(r, 'all_to_all_gather')):.0f} ms")),
    'fsdp.lm_small': Figure('step_fsdp.json', _fsdp('lm_small data=8, fsdp')),
    'fsdp.wide': Figure('step_fsdp.json', _fsdp('lm_small x4 wide data=8, fsdp'),
                        what='`train.fsdp`, a 4x wider lm_small on `data=8` (rate)',
                        against=lambda r: 'ZeRO-1 (sharded optimizer state)'),
    'fsdp.megatron': Figure('step_fsdp.json', _fsdp('lm_small 2x4 Megatron, fsdp')),
    'memory.budget': Figure('memory.json', lambda r: f"{r['budget_gib']:g} GiB"),
    'memory.largest_params': Figure(
        'memory.json', _setting('bf16+remat+fsdp', 'largest_parameters', in_millions),
        what='the largest model that fits, bf16 + remat + FSDP (parameters)',
        against=lambda r: (f"{_setting('float32', 'largest_parameters', in_millions)(r)} in "
                           f"float32 data parallel, in {r['budget_gib']:g} GiB")),
    'memory.largest_width': Figure('memory.json', _setting('bf16+remat+fsdp', 'largest_width',
                                                           lambda w: f'width {w}')),
    'memory.float32_params': Figure('memory.json',
                                    _setting('float32', 'largest_parameters', in_millions)),
    'memory.largest_vs_float32': Figure('memory.json', lambda r: '{:.1f}x'.format(
        _largest(r, 'bf16+remat+fsdp') / _largest(r, 'float32'))),
    'memory.fsdp_width': Figure('memory.json',
                                _setting('fsdp', 'largest_width', lambda w: f'width {w}')),
    'collectives.per_replica': Figure(
        'fsdp_collectives.json', _whole('per_replica'),
        what="bf16 weights live at the peak of one weight's FSDP gradients, by all-to-alls",
        against=lambda r: f"{_whole('dtensor')(r)} by DTensor's collectives"),
    'collectives.dtensor': Figure('fsdp_collectives.json', _whole('dtensor')),
    'gather.first_call': Figure(
        'all_gather_memory.json', _gathered('CollectiveGatherV2'), quoted=False,
        what='memory to gather 4 sharded [1024, 4096] tensors, CollectiveGatherV2',
        against=lambda r: f"{_gathered('default (all-reduce)')(r)} by the default lowering"),
    'grappler.first_failing': Figure(
        'grappler_addn.json', lambda r: next(row['weight'] for row in r['rows'] if not row['ok'])),
    'moe.budget': Figure('moe.json', lambda r: f"{r['budget_gib']:g} GiB"),
    'moe.expert_bytes': Figure(
        'moe.json', lambda r: f"{r['expert_bytes: expert=8 / replicated']:.3f}x",
        what='expert weights + Adam state per device, `expert=8`',
        against=lambda r: 'every expert on every device (goal 1/8)'),
    'moe.speed_replicated': Figure(
        'moe.json', lambda r: f"{r['steps: expert=8 / replicated']:.2f}x",
        what='an 8-expert top-2 LM on `expert=8` (steps/s)',
        against=lambda r: 'every expert on every device, `data=8`'),
    'moe.speed_dense': Figure('moe.json', lambda r: f"{r['steps: expert=8 / dense']:.2f}x"),
    'moe.largest_ep': Figure(
        'moe.json', lambda r: in_millions(r['settings']['expert=8'].get('largest_parameters'))),
    'moe.largest_replicated': Figure(
        'moe.json', lambda r: in_millions(r['settings']['replicated'].get('largest_parameters'))),
    'moe.largest_ratio': Figure(
        'moe.json', lambda r: f"{r.get('largest: expert=8 / replicated', 0):.2f}x",
        what='the largest MoE model in 4 GiB per process, `expert=8`',
        against=lambda r: 'every expert on every device'),
    'moe_exchange.same': Figure('moe_exchange.json', lambda r: _collectives(r, 'same axis')),
    'moe_exchange.two': Figure('moe_exchange.json', lambda r: _collectives(r, 'two axes')),
    'startup.quickstart': Figure(
        'startup.json', _first_step('quickstart'), quoted=False,
        what='start-up to the first step of the quickstart (wall)',
        against=lambda r: f"{_first_step('plain')(r)} for plain TF on one device"),
    'compile.dtensor8': Figure(
        'dtensor_compile_limit.json', _first_call('dtensor 8'), quoted=False,
        what='first call of an Adam update on 8 DTensor devices',
        against=lambda r: f"{_first_call('plain')(r)} in plain TF"),
    'checkpoint.save': Figure(
        'checkpoint.json', lambda r: f"{r['meshgin_save_mib_s']:.0f} MiB/s", quoted=False,
        what='checkpoint save of a sharded state on 2x4',
        against=lambda r: f"{r['raw_write_fsync_mib_s']:.0f} MiB/s raw disk write + fsync"),
    'finetune.budget': Figure('finetune.json', lambda r: f"{r['budget_gib']:g} GiB"),
    'finetune.lora_params': Figure(
        'finetune.json', lambda r: f"{r['settings']['lora']['largest_parameters'] / 1e6:.0f}M"),
    'finetune.full_params': Figure(
        'finetune.json', lambda r: f"{r['settings']['full']['largest_parameters'] / 1e6:.0f}M"),
    'finetune.largest_ratio': Figure('finetune.json',
                                     lambda r: f"{r['largest_lora / largest_full']:.1f}x"),
    'finetune.peak_ratio': Figure('finetune.json',
                                  lambda r: f"{r['peak_full / peak_lora']:.1f}x"),
    'finetune.speed': Figure('finetune.json', lambda r: f"{r['steps_lora / steps_full']:.1f}x"),
    'finetune.bf16_params': Figure(
        'finetune.json',
        lambda r: f"{r['settings']['lora_bf16']['largest_parameters'] / 1e6:.0f}M"),
    'finetune.int8_params': Figure(
        'finetune.json',
        lambda r: f"{r['settings']['lora_int8']['largest_parameters'] / 1e6:.0f}M"),
    'finetune.bf16_ratio': Figure('finetune.json',
                                  lambda r: f"{r['largest_lora_bf16 / largest_full']:.1f}x"),
    'finetune.int8_ratio': Figure('finetune.json',
                                  lambda r: f"{r['largest_lora_int8 / largest_full']:.1f}x"),
    'finetune.int8_vs_lora': Figure('finetune.json', lambda r: times(
        r['settings']['lora_int8']['largest_parameters']
        / r['settings']['lora']['largest_parameters'])),
    'finetune.bf16_speed': Figure('finetune.json',
                                  lambda r: f"{r['steps_lora_bf16 / steps_lora']:.2f}x"),
    'finetune.int8_speed': Figure('finetune.json',
                                  lambda r: f"{r['steps_lora_int8 / steps_lora']:.2f}x"),
    'narrow_gather.float32': Figure('narrow_gather_limit.json', narrow_peak('float32', 'narrow')),
    'narrow_gather.bf16': Figure('narrow_gather_limit.json', narrow_peak('bfloat16', 'narrow')),
    'narrow_gather.int8': Figure('narrow_gather_limit.json', narrow_peak('int8', 'narrow')),
    'narrow_gather.widened': Figure('narrow_gather_limit.json', narrow_peak(None, 'widened')),
    'frozen_memory.fsdp_bf16': Figure('frozen_memory.json', lambda r: times(
        r['meshes']['data=8 + FSDP']['bfloat16']['peak / float32'])),
    'frozen_memory.fsdp_int8': Figure('frozen_memory.json', lambda r: times(
        r['meshes']['data=8 + FSDP']['int8']['peak / float32'])),
    # bench/calibrate.py: its one-device bfloat16 step over its float32 one
    'calibrate.bf16_step': Figure('calibration.json', lambda r: '%.0fx' % (
        _alone(r, 'bfloat16') / _alone(r, 'float32'))),
    'frozen_memory.before_bf16': Figure('frozen_memory.json', lambda r: times(
        _before(r, 'bfloat16'))),
    'frozen_memory.before_int8': Figure('frozen_memory.json', lambda r: times(
        _before(r, 'int8'))),
    'frozen_memory.megatron_bf16': Figure('frozen_memory.json', lambda r: times(
        r['meshes']['2x4 Megatron']['bfloat16']['peak / float32'])),
    'frozen_memory.megatron_int8': Figure('frozen_memory.json', lambda r: times(
        r['meshes']['2x4 Megatron']['int8']['peak / float32'])),
    'frozen_accuracy.bf16_logits': Figure(  # 0 for a bfloat16 checkpoint: prose says 'exactly'
        'frozen_accuracy.json', lambda r: f"{_large_logits(r)['bfloat16']:.1e}", quoted=False),
    'frozen_accuracy.int8_logits': Figure(
        'frozen_accuracy.json', lambda r: f"{_large_logits(r)['int8']:.1e}"),
    'frozen_accuracy.bf16_eval': Figure(
        'frozen_accuracy.json',
        lambda r: f"{100 * r['lora']['bfloat16']['max_relative_eval_difference']:.3f}%"),
    'frozen_accuracy.int8_eval': Figure(
        'frozen_accuracy.json',
        lambda r: f"{100 * r['lora']['int8']['max_relative_eval_difference']:.3f}%"),
    'frozen_accuracy.bf16_speed': Figure(
        'frozen_accuracy.json', lambda r: times(r['lora']['bfloat16']['steps_per_sec / float32'])),
    'frozen_accuracy.int8_speed': Figure(
        'frozen_accuracy.json', lambda r: times(r['lora']['int8']['steps_per_sec / float32'])),
    'dpo.peak_ratio': Figure('dpo.json', lambda r: f"{r['peak lora_dpo / lora_sft']:.2f}x"),
    'dpo.speed': Figure('dpo.json', lambda r: f"{r['steps/s lora_dpo / lora_sft']:.2f}x"),
    'dpo.precomputed_speed': Figure('dpo.json',
                                    lambda r: f"{r['steps/s lora_dpo_pre / lora_dpo']:.2f}x"),
    'dpo.full_peak': Figure('dpo.json', lambda r: f"{r['peak full_dpo_pre / lora_dpo_pre']:.1f}x"),
    'import_hf.checkpoint': Figure('import_hf.json', lambda r: f"{r['checkpoint_gib']:.2f} GiB"),
    'import_hf.peak': Figure('import_hf.json', lambda r: f"{r['import']['peak_gib']:.1f} GiB"),
    'import_hf.ratio': Figure('import_hf.json', lambda r: f"{r['import_peak / checkpoint']:.1f}x"),
    'import_hf.seconds': Figure('import_hf.json', lambda r: f"{r['import']['seconds']:.1f} s"),
    'import_hf.parameters': Figure('import_hf.json',
                                   lambda r: f"{r['parameters'] / 1e9:.2f}B"),
    'bf16.speedup': Figure('bf16_matmul.json', _bf16_range, quoted=False,
                           what='bf16 MatMul speed, oneDNN on, no XLA, 2 threads',
                           against=lambda r: 'float32 (sizes 512 to 2048)'),
    'bf16_einsum.slowdown': Figure('bf16_einsum.json',
                                   lambda r: row_spread(r, 'bf16_einsum_over_matmul')),
    'layouts.speedup': Figure('layout_resolution.json', lambda r: f"{r['speedup']:.1f}x",
                              quoted=False, what="meshgin's layout rule resolver (speed)",
                              against=lambda r: 'a per-rule `re.fullmatch` loop'),
    'allocator.cpu': Figure(
        'allocator.json', lambda r: times(r['ratios']['cpu_glibc_over_jemalloc']),
        what="a fresh quickstart run's CPU seconds (100 steps) with glibc's malloc",
        against=lambda r: 'the same run with jemalloc preloaded'),
    'input.ratio': Figure('input.json', lambda r: times(r['ratio']), quoted=False,
                          what="meshgin's record reader (examples/s)",
                          against=lambda r: 'a bare `tf.data` read of the same files'),
}


def figure(name: str, r: Results) -> str:
  return FIGURES[name].render(r)
