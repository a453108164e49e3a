"""The `launch.inspect` report: layouts, rule matches and memory, from the plan.

    print(describe_plan(make_plan(), max_rows=200))

Built from the typed plan alone (nothing allocated, no device touched), so a
100B-parameter config inspects in seconds.
"""

from __future__ import annotations

from layout_core.layout import scope as layout_scope
from plugins.plan import RunPlan


def _gib(num_bytes: int) -> str:
  return f'{num_bytes / 2**30:,.3f} GiB'


def describe_plan(plan: RunPlan, *, max_rows: int = 0) -> str:
  """The inspect report: layout table, per-rule matches, memory per device."""
  records = plan.records
  rows = records if not max_rows or len(records) <= max_rows else records[:max_rows]
  lines = [f'Mesh: {plan.mesh_spec.describe()}', '']
  if plan.meta is None:  # a Keras model: weights known, FLOPs not declared
    lines += [f'{plan.params.describe()}: weights listed from a stateless build '
              "(Keras' StatelessScope defers initialisers, so nothing is allocated); "
              'FLOPs are not known for Keras models.', '']
  lines += [layout_scope.table_markdown(rows).rstrip()]
  if len(rows) < len(records):
    lines.append(f'... {len(records) - len(rows)} more rows (--max_rows=0 shows all)')
  lines += ['', 'Rule matches:']
  counts = plan.rules.match_counts(r.rule_index for r in records)
  for rule, count in zip(plan.rules.rules, counts):
    note = '' if count else '   <- matched nothing'
    lines.append(f'  {count:6d}  rule {rule.index}: {rule.pattern} -> {rule.spec}{note}')
  unmatched = sum(r.rule_index is None for r in records)
  lines.append(f'  {unmatched:6d}  default: replicated')
  param_bytes = layout_scope.bytes_per_device(records)
  if plan.pipeline is not None:
    lines += ['', f'Pipeline: {plan.pipeline.num_micro_batches} micro-batches of '
                  f'{plan.pipeline.micro_batch_size}',
              plan.pipeline.partition.describe()]
  lines += ['', f'Parameters: {plan.num_parameters:,} '
                f'({_gib(sum(r.bytes_total for r in records))} total)',
            'Forward cost of one global batch: ' + (
                f'{plan.meta.flops:.3e} FLOPs' if plan.meta else 'not known'),
            'Per device:',
            f'  parameters        {_gib(param_bytes)}',
            f'  Adam slots (m, v) {_gib(2 * param_bytes)}',
            f'  total             {_gib(3 * param_bytes)}']
  return '\n'.join(lines)
