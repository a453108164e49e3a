"""The `launch.inspect` report: layouts, rule matches and memory, from the plan.

    print(describe_plan(make_plan(), max_rows=200))

Built from the typed plan alone (nothing allocated, no device touched), so a
100B-parameter config inspects in seconds.
"""

from __future__ import annotations

import math

from layout_core.layout import scope as layout_scope
from layout_core.model import frozen as frozen_lib
from layout_core.model import moe
from layout_core.train import memory
from plugins.plan import RunPlan


def _gib(num_bytes: int) -> str:
  return f'{num_bytes / 2**30:,.3f} GiB'


def plan_memory(plan: RunPlan) -> memory.MemoryEstimate:
  """The memory estimate of a planned run (`layout_core.train.memory`)."""
  micro_batch = plan.train.batch_size // plan.train.grad_accum_steps
  return memory.estimate_memory(
      records=plan.records, params=plan.params,
      input_shapes=[shape for shape, _ in plan.task.input_specs(micro_batch)],
      config=plan.train, optimizer=plan.optimizer, mesh_axes=plan.mesh_spec.shape,
      pipeline=plan.pipeline, stage_axis=plan.pipeline_config.stage_axis)


def describe_memory(plan: RunPlan) -> list[str]:
  """The memory table (per device and total), the peak, and whether it fits."""
  estimate = plan_memory(plan)
  train, spec = plan.train, plan.mesh_spec
  optimizer, shard = plan.optimizer.name, estimate.state_axis
  micro = train.batch_size // train.grad_accum_steps
  split = estimate.fsdp_axis
  lines = [f'Memory (estimate: layout_core/train/memory.py; {optimizer}'
           f'{f", state sharded over {shard!r}" if shard else ""}'
           f'{f", parameters fully sharded over {split!r} (fsdp)" if split else ""}, '
           f'compute {train.compute_dtype}, remat {train.remat}, {micro} examples per '
           'micro-step):',
           f'  {"":22s} {"per device":>14s} {f"total ({estimate.num_devices} devices)":>22s}']
  for category, per_device in estimate.per_device.items():
    label = {'optimizer': f'optimizer ({optimizer})',
             'weight copies': 'gathered weights' if split else 'weight copies'}.get(category,
                                                                                 category)
    known = category != 'activations' or estimate.activations_known
    lines.append(f'  {label:22s} {_gib(per_device) if known else "not known":>14s} '
                 f'{_gib(estimate.total[category]) if known else "not known":>22s}')
  lines.append(f'  {"peak":22s} {_gib(estimate.peak_per_device):>14s} '
               f'{_gib(estimate.peak_total):>22s}')
  lines += [f'  {note}' for note in estimate.notes]
  if spec.device_type == 'CPU':
    lines.append(f'Host process peak (CPU: every device in this process; fitted, see '
                 f'memory.py): {_gib(estimate.host_peak)}')
  if spec.device_memory_gb is not None:
    capacity = int(spec.device_memory_gb * 2**30)  # GiB
    need = estimate.peak_per_device
    if need <= capacity:
      lines.append(f'Fits: peak {_gib(need)} per device of mesh.device_memory_gb = '
                   f'{spec.device_memory_gb:g} ({_gib(capacity - need)} to spare)')
    else:
      lines.append(f'DOES NOT FIT: peak {_gib(need)} per device is {_gib(need - capacity)} '
                   f'({need / capacity - 1:.0%}) over mesh.device_memory_gb = '
                   f'{spec.device_memory_gb:g}')
  return lines


def describe_plan(plan: RunPlan, *, max_rows: int = 0) -> str:
  """The inspect report: layout table, per-rule matches, memory per device."""
  records = plan.records
  rows = records if not max_rows or len(records) <= max_rows else records[:max_rows]
  lines = [f'Mesh: {plan.mesh_spec.describe()}']
  lines += [f'Warning: {warning}' for warning in plan.unsplit_axis_warnings()]
  lines.append('')
  if plan.meta is None:  # a Keras model: weights known, FLOPs not declared
    lines += [f'{plan.params.describe()}: weights listed from a stateless build '
              "(Keras' StatelessScope defers initialisers, so nothing is allocated); "
              'FLOPs are not known for Keras models.', '']
  lines += [layout_scope.table_markdown(rows).rstrip()]
  if len(rows) < len(records):
    lines.append(f'... {len(records) - len(rows)} more rows (--max_rows=0 shows all)')
  lines += ['', 'Rule matches (first match wins):']
  for use in plan.rules.rule_uses([r.path for r in records], [r.rule_index for r in records]):
    rule = use.rule
    note = f'   <- {use.describe()}' if use.unused else ''
    lines.append(f'  {use.matched:6d}  rule {rule.index}: {rule.pattern} -> {rule.spec}{note}')
  following = sum(r.rule_index is None and r.source.startswith('as ') for r in records)
  unmatched = sum(r.rule_index is None for r in records) - following
  if following:  # LoRA adapters no rule names
    lines.append(f'  {following:6d}  as the weight they adapt')
  lines.append(f'  {unmatched:6d}  default: replicated')
  frozen = [r for r in records if not r.trainable]
  if frozen:
    count = sum(math.prod(r.shape) for r in frozen if not frozen_lib.is_scale(r.path))
    lines.append(f'Trained: {plan.num_parameters - count:,} of the parameters; the rest '
                 'frozen (lora.*, train.trainable: no gradients, no optimizer state), stored '
                 f'in {plan.train.frozen_dtype} (train.frozen_dtype): '
                 f'{_gib(layout_scope.bytes_per_device(frozen))} per device')
  param_bytes = layout_scope.bytes_per_device(records)
  if plan.pipeline is not None:
    lines += ['', f'Pipeline: {plan.pipeline.num_micro_batches} micro-batches of '
                  f'{plan.pipeline.micro_batch_size}',
              plan.pipeline.partition.describe()]
  inactive = moe.inactive_parameters(plan.params)
  active = (f'; {plan.num_parameters - inactive:,} active per token (its experts only)'
            if inactive else '')
  lines += ['', f'Parameters: {plan.num_parameters:,} '
                f'({_gib(sum(r.bytes_total for r in records))} total){active}',
            'Forward cost of one global batch: ' + (
                f'{plan.meta.flops:.3e} FLOPs' if plan.meta else 'not known'),
            f'Parameters per device: {_gib(param_bytes)}', '']
  lines += describe_memory(plan)
  return '\n'.join(lines)
