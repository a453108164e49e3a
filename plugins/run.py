"""One training run from the parsed gin config: the path every launcher shares.

    parse_gin(files=[...], bindings=[...])
    result = run_training(model_dir='/tmp/run')

Order matters and is the data flow of the whole system: gin -> mesh (virtual
CPU devices are created before TF touches a device) -> Params tree + rules ->
model built in the layout scope -> train loop -> summaries. The operative gin
config, the params tree and the layout table are written to `model_dir` and to
TensorBoard before the first step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import gin
from absl import logging

from layout_core import layout_scope
from layout_core.checkpoint import CheckpointEvent, Checkpointer
from layout_core.preemption import PreemptionWatcher
from layout_core import mesh as mesh_lib
from layout_core.data import LMTask
from layout_core.errors import ConfigError
from layout_core.layers import Embedding, LayerMeta, flatten_layers
from layout_core.params import Params
from layout_core.pipeline.trainer import (PipelinePlan, make_pipeline_trainer,
                                          plan_layout_records, plan_pipeline)
from layout_core.rules import LayoutRules
from layout_core import trainer as trainer_lib
from layout_core.summaries import SummaryWriter, code_block
from layout_core.trainer import TrainConfig, Trainer, TrainResult
from plugins import configurables


def write_text(model_dir: str, name: str, text: str) -> str:
  """Writes model_dir/name atomically (temp file + rename)."""
  path = os.path.join(model_dir, name)
  temporary = path + '.tmp'
  with open(temporary, 'w') as f:
    f.write(text)
  os.replace(temporary, path)
  return path


@dataclasses.dataclass
class RunPlan:
  """Everything the config decides, resolved without allocating the model."""
  mesh_spec: mesh_lib.MeshSpec
  params: Params
  rules: LayoutRules
  task: LMTask
  train_config: TrainConfig
  records: list[layout_scope.LayoutRecord]
  meta: LayerMeta  # forward cost of one global batch
  pipeline: PipelinePlan | None = None


def check_model_fits_data(params: Params, task: LMTask, batch_size: int) -> LayerMeta:
  """Vocabulary and sequence-length agreement, plus the model's cost report."""
  embeddings = [p for p in flatten_layers(params) if p.cls is Embedding]
  if embeddings and embeddings[0].vocab_size < task.vocab_size:
    raise ConfigError(
        f'model vocabulary {embeddings[0].vocab_size} is smaller than the data '
        f'vocabulary {task.vocab_size}', where='transformer_lm.vocab_size',
        fix=f'set transformer_lm.vocab_size = {task.vocab_size}')
  return params.cls.fprop_meta(params, (batch_size, task.seq_len))


def plan_run() -> RunPlan:
  """Resolves the gin config into a plan: no devices touched, nothing allocated."""
  spec = configurables.mesh()
  params = configurables.model()
  rules = configurables.layout_rules()
  task = configurables.data()
  train_config = configurables.train()
  configurables.optimizer()
  meta = check_model_fits_data(params, task, train_config.batch_size)
  pipeline = None
  pipeline_config = configurables.pipeline()
  if pipeline_config.enabled:
    pipeline = plan_pipeline(pipeline_config, params=params, mesh_axes=spec.shape,
                             batch_size=train_config.batch_size, seq_len=task.seq_len,
                             batch_axis=train_config.batch_axis)
    records = plan_layout_records(pipeline, params=params, rules=rules,
                                  mesh_axes=spec.shape, stage_axis=pipeline_config.stage_axis)
  else:
    records = layout_scope.plan_layouts(params.cls.variable_specs(params), rules, spec.shape)
  return RunPlan(mesh_spec=spec, params=params, rules=rules, task=task,
                 train_config=train_config, records=records, meta=meta,
                 pipeline=pipeline)



def _gib(num_bytes: int) -> str:
  return f'{num_bytes / 2**30:,.3f} GiB'


def describe_plan(plan: RunPlan, *, max_rows: int = 0) -> str:
  """The inspect report: layout table, per-rule matches, memory per device."""
  records = plan.records
  rows = records if not max_rows or len(records) <= max_rows else records[:max_rows]
  lines = [f'Mesh: {plan.mesh_spec.describe()}', '',
           layout_scope.table_markdown(rows).rstrip()]
  if len(rows) < len(records):
    lines.append(f'... {len(records) - len(rows)} more rows (--max_rows=0 shows all)')
  lines += ['', 'Rule matches:']
  for rule, count in zip(plan.rules.rules, plan.rules.match_counts):
    note = '' if count else '   <- matched nothing'
    lines.append(f'  {count:6d}  rule {rule.index}: {rule.pattern} -> {rule.spec}{note}')
  unmatched = sum(r.source.startswith('default') for r in records)
  lines.append(f'  {unmatched:6d}  default: replicated')
  num_params = sum(math.prod(r.shape) for r in records)
  param_bytes = trainer_lib.bytes_per_device(records)
  if plan.pipeline is not None:
    lines += ['', f'Pipeline: {plan.pipeline.num_micro_batches} micro-batches of '
                  f'{plan.pipeline.micro_batch_size}',
              plan.pipeline.partition.describe()]
  lines += ['', f'Parameters: {num_params:,} ({_gib(sum(r.bytes_total for r in records))} total)',
            f'Forward cost of one global batch: {plan.meta.flops:.3e} FLOPs',
            'Per device:',
            f'  parameters        {_gib(param_bytes)}',
            f'  Adam slots (m, v) {_gib(2 * param_bytes)}',
            f'  total             {_gib(3 * param_bytes)}']
  return '\n'.join(lines)


def build_trainer(*, model_dir: str | None) -> Trainer:
  """Builds mesh, model and optimizer from gin; writes the run's records."""
  spec = configurables.mesh()
  mesh = mesh_lib.build_mesh(spec)
  logging.info('Mesh: %s', spec.describe())
  params = configurables.model()
  rules = configurables.layout_rules()
  task = configurables.data()
  logging.info('Data: %s', task.describe())
  train_config = configurables.train()
  check_model_fits_data(params, task, train_config.batch_size)
  writer = SummaryWriter(model_dir) if model_dir else None
  kwargs = dict(model_params=params, mesh=mesh, rules=rules, task=task,
                optimizer=configurables.optimizer(), config=train_config, writer=writer)
  pipeline_config = configurables.pipeline()
  if pipeline_config.enabled:
    trainer = make_pipeline_trainer(pipeline=pipeline_config, **kwargs)
  else:
    trainer = Trainer(**kwargs)
  layout_scope.report_unused_rules(rules)
  logging.info('Model: %s parameters in %d variables', f'{trainer.num_parameters():,}',
               len(trainer.variables))
  if model_dir:
    record_run(trainer, model_dir)
  return trainer


def record_run(trainer: Trainer, model_dir: str) -> None:
  operative = gin.operative_config_str()
  params_text = trainer.model_params.ToText()
  write_text(model_dir, 'config.gin', operative)
  write_text(model_dir, 'params.txt', params_text)
  table = trainer.write_layouts()
  write_text(model_dir, 'layouts.txt', table)
  trainer.writer.text(step=0, tag='config/gin', markdown=code_block(operative))
  trainer.writer.text(step=0, tag='config/params', markdown=code_block(params_text))
  trainer.writer.flush()
  logging.info('Operative config:\n%s', operative)


def checkpoint_event_recorder(writer) -> Callable[[CheckpointEvent], None]:
  def record(event: CheckpointEvent) -> None:
    if event.reason in ('resume', 'init_from'):
      values = {'checkpoint/restore_seconds': event.seconds}
    else:
      values = {'checkpoint/save_seconds': event.seconds,
                'checkpoint/size_bytes': event.size_bytes}
    writer.scalars(step=event.step, values=values)
    writer.text(step=event.step, tag='checkpoint/events', markdown=event.line())
    writer.flush()
  return record


def run_training(*, model_dir: str) -> TrainResult:
  """Trains from the gin config in `model_dir`, resuming from its checkpoints."""
  os.makedirs(model_dir, exist_ok=True)
  checkpoint_config = configurables.checkpoint()
  trainer = build_trainer(model_dir=model_dir)
  checkpointer = Checkpointer(
      directory=os.path.join(model_dir, 'checkpoints'), state=trainer.state(),
      config=checkpoint_config, extra_files={'config.gin': gin.operative_config_str()},
      on_event=checkpoint_event_recorder(trainer.writer))
  if checkpointer.restore_latest() is None and checkpoint_config.init_from:
    checkpointer.init_from(checkpoint_config.init_from, trainer.variables)

  with PreemptionWatcher() as watcher:
    def after_step(step: int) -> bool:
      if watcher.requested:
        path = checkpointer.save(step, reason='preemption')
        checkpointer.wait()
        message = (f'Preempted by {watcher.signal_name} at step {step}: saved '
                   f'{path or "(already saved)"}. Run the same command to resume.')
        logging.warning(message)
        print(message, flush=True)
        return True
      checkpointer.maybe_save(step)
      return False

    try:
      result = trainer.train(after_step=after_step)
      if checkpoint_config.save_at_end and not watcher.requested:
        checkpointer.save(result.final_step, reason='final')
    finally:
      checkpointer.wait()
  if result.eval_losses:
    first, last = result.eval_losses[0][1], result.eval_losses[-1][1]
    logging.info('Done at step %d: eval loss %.4f (first %.4f, %.0f%%), %.2f steps/s',
                 result.final_step, last, first, 100 * last / first, result.steps_per_sec)
  trainer.writer.close()
  return result
