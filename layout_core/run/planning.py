"""A run's plan at config time: layouts, cost and the pipeline plan, nothing allocated.

    pipeline_plan = plan_pipeline_run(PipelineConfig(num_stages=2), model=lm, task=task,
                                      config=TrainConfig(), mesh_axes={'stage': 2, 'data': 4},
                                      batch_axis='data')
    records, meta = plan_model(lm, rules=rules, mesh_axes={'stage': 2, 'data': 4}, task=task,
                               config=TrainConfig(), pipeline_plan=pipeline_plan)

The typed run plan (`plugins.plan`, for `launch.train` and `launch.inspect`)
and the engine factory (`layout_core.run.factory`, for a library caller who
brings no plan) both plan through these functions, so a config is planned
by one set of rules whichever way it arrives. Plain Python: TensorFlow is
not imported.
"""

from __future__ import annotations

from typing import Mapping

from layout_core.errors import ConfigError
from layout_core.layout import fsdp
from layout_core.layout.rules import LayoutRules
from layout_core.layout.scope import LayoutRecord, plan_layouts
from layout_core.model import moe
from layout_core.model.base import LayerMeta, frozen_meta, leaf_layers
from layout_core.model.layers import Embedding
from layout_core.model.tuning import lora_of
from layout_core.params import Params
from layout_core.pipeline.config import PipelineConfig
from layout_core.pipeline.plan import (PipelinePlan, check_pipelinable, plan_layout_records,
                                       plan_pipeline)
from layout_core.tasks import Task
from layout_core.tasks.lm import LMTask
from layout_core.train.config import TrainConfig, batch_axis_for


def plan_pipeline_run(pipeline: PipelineConfig | None, *, model, task: Task,
                      config: TrainConfig, mesh_axes: Mapping[str, int],
                      batch_axis: str) -> PipelinePlan | None:
  """The pipeline plan of a run (None when pipelining is off): the model and
  task checked, the micro-batches cut from one accumulation micro-step
  (`config.batch_size / grad_accum_steps` rows). `batch_axis` is the resolved
  batch axis (`layout_core.train.config.batch_axis_for`)."""
  if pipeline is None or not pipeline.enabled:
    return None
  moe.check_supported(model, engine=pipeline.engine)
  check_pipelinable(model, task)
  return plan_pipeline(pipeline, params=model, mesh_axes=mesh_axes,
                       batch_size=config.batch_size // config.grad_accum_steps,
                       seq_len=task.seq_len, batch_axis=batch_axis)


def plan_model(model, *, rules: LayoutRules, mesh_axes: Mapping[str, int], task: Task,
               config: TrainConfig, pipeline_plan: PipelinePlan | None = None,
               stage_axis: str = 'stage') -> tuple[list[LayoutRecord], LayerMeta | None]:
  """Every variable's layout record, and the forward cost of one global batch
  (None for a Keras model: its FLOPs are not declared). Checks that a Params
  LM fits the task's vocabulary and length."""
  check_segments_supported(model, task, pipelined=pipeline_plan is not None)
  check_reference_supported(model, task, config=config, pipeline_plan=pipeline_plan)
  split_axis = fsdp_axis_of(model, config=config, mesh_axes=mesh_axes,
                            stage_axis=stage_axis if pipeline_plan is not None else None)
  if not isinstance(model, Params):
    from layout_core.model import keras  # pylint: disable=g-import-not-at-top
    return keras.plan(model, rules=rules, mesh_axes=mesh_axes,
                      input_specs=task.input_specs(config.batch_size), seed=config.seed), None
  _check_embedding_fits(model, task)
  meta = frozen_meta(model, tuple(tuple(shape) for shape, _ in
                                  task.input_specs(config.batch_size)))
  if pipeline_plan is not None:
    records = plan_layout_records(pipeline_plan, params=model, rules=rules,
                                  mesh_axes=mesh_axes, stage_axis=stage_axis,
                                  fsdp_axis=split_axis)
  else:
    records = plan_layouts(model.cls.variable_specs(model), rules, mesh_axes,
                           fsdp_axis=split_axis)
  return records, meta


def fsdp_axis_of(model, *, config: TrainConfig, mesh_axes: Mapping[str, int],
                 stage_axis: str | None = None) -> str | None:
  """The axis `train.fsdp` splits `model`'s parameters over (None: off), or a
  ConfigError: a bad axis (`layout_core.layout.fsdp.fsdp_axis`), or a Keras
  model, whose layers read their weights themselves, so nothing can gather
  them where they are used (split, DTensor fails to compile the step)."""
  axis = fsdp.fsdp_axis(config.fsdp, batch_axis=batch_axis_for(config, mesh_axes),
                        mesh_axes=mesh_axes, stage_axis=stage_axis)
  if axis is not None and not isinstance(model, Params):
    raise ConfigError(
        'train.fsdp does not cover Keras models: Keras layers read their weights '
        'themselves, so meshgin cannot gather a split weight where it is used (and '
        'DTensor cannot compile the step with the weights split)', where='train.fsdp',
        fix='set train.fsdp = False for a Keras model; optimizer.shard_state = True '
            'splits its optimizer state, layout rules its weights over a model axis')
  return axis


def check_segments_supported(model, task: Task, *, pipelined: bool) -> None:
  """Packed rows (several documents each) need attention that stays inside
  a document: the library's layers do it on the whole-mesh engine; a Keras
  model or a pipeline engine would attend across documents, so say so."""
  if not task.needs_segments:
    return
  if pipelined or not isinstance(model, Params):
    what = 'a pipeline engine' if pipelined else 'a Keras model'
    setting = f'{task.settings_name}.pack'  # the task the user bound: instruct.pack, ...
    raise ConfigError(f'packed documents ({setting} = True) need attention that stays '
                      f'within each document, which {what} does not get',
                      where=setting,
                      fix=f'set {setting} = False (one document per row, padded: '
                          'works with every engine and model), or train a Params model '
                          'without a pipeline')


def check_reference_supported(model, task: Task, *, config: TrainConfig,
                              pipeline_plan: PipelinePlan | None) -> None:
  """A task that compares the model with its reference (preference tuning)
  needs the reference, the model with its LoRA adapters off; and every part
  of a split batch (micro-step, pipeline micro-batch) must hold whole pairs."""
  if not task.needs_reference:
    return
  setting = task.settings_name
  if not isinstance(model, Params):
    raise ConfigError(f'{setting} compares the model with its reference, the model with its '
                      "LoRA adapters off, and meshgin's LoRA adapters are a Params model's; "
                      'this is a Keras model', where='model.params',
                      fix='train preference pairs on a Params model (model.params = '
                          '@transformer_lm(), or one imported with launch.import_hf)')
  lora = lora_of(model)
  if lora is None or not lora.rank:
    raise ConfigError(
        f'{setting} compares the model with its reference, the model before tuning, which '
        'meshgin runs as the same model with its LoRA adapters off; this model has none',
        where='lora.rank',
        fix='fine-tune with LoRA (set lora.rank, e.g. 8, and lora.targets), or set '
            'dpo.precompute_reference = True: the reference log-probabilities computed once '
            'from the starting weights, and every weight may train')
  micro_batches = pipeline_plan.num_micro_batches if pipeline_plan is not None else 1
  parts = config.grad_accum_steps * micro_batches
  if config.batch_size % (2 * parts):
    split = f'train.grad_accum_steps = {config.grad_accum_steps}' + (
        f' x pipeline.num_micro_batches = {micro_batches}' if pipeline_plan is not None else '')
    raise ConfigError(f'train.batch_size = {config.batch_size} cut into {parts} part(s) '
                      f'({split}) leaves an odd number of rows in a part, so a pair of answers '
                      '(two rows) would be split', where='train.batch_size',
                      fix=f'use a train.batch_size that is a multiple of {2 * parts}')


def _check_embedding_fits(params: Params, task: Task) -> None:
  """The model's vocabulary and longest sequence against an LM task's."""
  embeddings = [p for _, p in leaf_layers(params) if p.cls is Embedding]
  if not embeddings or not isinstance(task, LMTask):
    return
  embedding = embeddings[0]
  data = task.settings_name  # the configurable the user set the task's values on
  if embedding.vocab_size < task.vocab_size:
    raise ConfigError(
        f'model vocabulary {embedding.vocab_size} is smaller than the data '
        f'vocabulary {task.vocab_size}', where=f'transformer_lm.vocab_size / {data}.vocab_size',
        fix=f'set transformer_lm.vocab_size = {task.vocab_size}')
  if embedding.max_len and task.seq_len > embedding.max_len:
    raise ConfigError(
        f'{data}.seq_len={task.seq_len} is longer than the model\'s longest sequence, '
        f'transformer_lm.max_len={embedding.max_len}',
        where=f'{data}.seq_len / transformer_lm.max_len',
        fix=f'set transformer_lm.max_len >= {task.seq_len} or {data}.seq_len <= '
            f'{embedding.max_len}')
