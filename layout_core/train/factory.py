"""The one place that picks a step engine, from the model and the pipeline plan.

    trainer = make_trainer(model=lm_params, mesh=mesh, rules=rules, task=task,
                           optimizer=OptimizerConfig(), config=TrainConfig(),
                           pipeline=PipelineConfig(num_stages=2, num_micro_batches=4))
    trainer.train()

Which engine runs a step depends only on what the plan says: a pipeline plan
picks its engine (`'submesh'`: GPipe, `'spmd'`: the stage axis); otherwise a
Params tree or a Keras 3 model runs as one program (`SingleProgramEngine`
with a `ModelProgram`). With
`plan_model` (config time: layout records and cost, nothing allocated) this is
the one module that asks what kind of model it has.
"""

from __future__ import annotations

from typing import Mapping

from layout_core.errors import ConfigError
from layout_core.layout import mesh as mesh_lib
from layout_core.layout.scope import LayoutRecord, plan_layouts
from layout_core.layout.rules import LayoutRules
from layout_core.model.base import LayerMeta, compute_params, leaf_layers
from layout_core.model.built import build_params_model
from layout_core.model.layers import Embedding
from layout_core.params import Params
from layout_core.pipeline.config import PipelineConfig
from layout_core.pipeline.plan import (PipelinePlan, check_pipelinable, plan_layout_records,
                                       plan_pipeline)
from layout_core.tasks import Task
from layout_core.tasks.lm import LMTask
from layout_core.train.config import TrainConfig, batch_axis_for
from layout_core.train.engine import Counters, ModelProgram, SingleProgramEngine, StepEngine
from layout_core.train.loop import Trainer
from layout_core.train.optimizer import OptimizerConfig


def make_engine(*, model, mesh, rules: LayoutRules | None, task: Task,
                optimizer: OptimizerConfig, config: TrainConfig, counters: Counters,
                pipeline: PipelineConfig | None = None,
                pipeline_plan: PipelinePlan | None = None,
                bubble_fill: float | None = None) -> StepEngine:
  """The engine for `model` (a Params tree or `layout_core.model.keras.KerasModel`).

  A pipelined run passes its `pipeline` config and the `pipeline_plan` made
  at config time (`plugins.plan`); a library caller may leave the plan out
  and it is made here. `bubble_fill` (tests: NaN) fills the SPMD engine's idle slots."""
  batch_axis = batch_axis_for(config, mesh_lib.mesh_axes(mesh), warn=True)
  check_segments_supported(model, task, pipelined=pipeline is not None and pipeline.enabled)
  if isinstance(model, Params):
    model = compute_params(model, dtype=config.compute_dtype, remat=config.remat)
  if pipeline is not None and pipeline.enabled:
    if pipeline_plan is None:
      check_pipelinable(model, task)
      pipeline_plan = plan_pipeline(pipeline, params=model, mesh_axes=mesh_lib.mesh_axes(mesh),
                                    batch_size=config.batch_size // config.grad_accum_steps,
                                    seq_len=task.seq_len,
                                    batch_axis=config.batch_axis)
    from layout_core.pipeline import engines  # pylint: disable=g-import-not-at-top
    if pipeline_plan.engine == 'spmd':
      return engines.spmd_engine(
          params=model, plan=pipeline_plan, stage_axis=pipeline.stage_axis, mesh=mesh,
          rules=rules, task=task, optimizer=optimizer, config=config, counters=counters,
          batch_axis=batch_axis, bubble_fill=bubble_fill)
    return engines.GPipeEngine(params=model, plan=pipeline_plan, stage_axis=pipeline.stage_axis,
                               mesh=mesh, rules=rules, task=task, optimizer=optimizer,
                               config=config, counters=counters)
  if isinstance(model, Params):
    built = build_params_model(model, mesh=mesh, rules=rules, seed=config.seed)
  else:
    from layout_core.model import keras  # pylint: disable=g-import-not-at-top
    built = keras.build(model, mesh=mesh, rules=rules, seed=config.seed,
                        input_specs=task.input_specs(config.batch_size),
                        compute_dtype=config.compute_dtype, remat=config.remat)
  return SingleProgramEngine(
      program=ModelProgram(model=built, task=task, mesh=mesh, batch_axis=batch_axis),
      mesh=mesh, optimizer=optimizer, config=config, counters=counters)


def make_trainer(*, model, mesh, rules: LayoutRules | None, task: Task,
                 optimizer: OptimizerConfig, config: TrainConfig,
                 pipeline: PipelineConfig | None = None,
                 pipeline_plan: PipelinePlan | None = None, writer=None,
                 profile_dir: str | None = None, bubble_fill: float | None = None,
                 model_flops_per_step: float | None = None,
                 peak_flops: float | None = None) -> Trainer:
  """Counters, the engine (`make_engine`) and the loop around them (the FLOP
  figures feed train/model_flops_per_sec and train/mfu, see `Trainer`)."""
  counters = Counters(mesh)
  engine = make_engine(model=model, mesh=mesh, rules=rules, task=task, optimizer=optimizer,
                       config=config, counters=counters, pipeline=pipeline,
                       pipeline_plan=pipeline_plan, bubble_fill=bubble_fill)
  return Trainer(engine=engine, counters=counters, task=task, config=config, writer=writer,
                 profile_dir=profile_dir, model_flops_per_step=model_flops_per_step,
                 peak_flops=peak_flops)


def plan_model(model, *, rules: LayoutRules, mesh_axes: Mapping[str, int], task: Task,
               config: TrainConfig, pipeline_plan: PipelinePlan | None = None,
               stage_axis: str = 'stage') -> tuple[list[LayoutRecord], LayerMeta | None]:
  """Config time, nothing allocated: every variable's layout record, and the
  forward cost of one global batch (None for a Keras model: its FLOPs are not
  declared). Checks that a Params LM fits the task's vocabulary and length."""
  check_segments_supported(model, task, pipelined=pipeline_plan is not None)
  if not isinstance(model, Params):
    from layout_core.model import keras  # pylint: disable=g-import-not-at-top
    return keras.plan(model, rules=rules, mesh_axes=mesh_axes,
                      input_specs=task.input_specs(config.batch_size), seed=config.seed), None
  _check_embedding_fits(model, task)
  meta = model.cls.fprop_meta(model, *[shape for shape, _ in task.input_specs(config.batch_size)])
  if pipeline_plan is not None:
    records = plan_layout_records(pipeline_plan, params=model, rules=rules,
                                  mesh_axes=mesh_axes, stage_axis=stage_axis)
  else:
    records = plan_layouts(model.cls.variable_specs(model), rules, mesh_axes)
  return records, meta


def check_segments_supported(model, task: Task, *, pipelined: bool) -> None:
  """Packed rows (several documents each) need attention that stays inside
  a document: the library's layers do it on the one-program engine; a Keras
  model or a pipeline engine would attend across documents, so say so."""
  if not getattr(task, 'needs_segments', False):
    return
  if pipelined or not isinstance(model, Params):
    what = 'a pipeline engine' if pipelined else 'a Keras model'
    raise ConfigError(f'packed documents (lm_corpus.pack = True) need attention that stays '
                      f'within each document, which {what} does not get',
                      where='lm_corpus.pack',
                      fix='set lm_corpus.pack = False (one document per row, padded: '
                          'works with every engine and model), or train a Params model '
                          'without a pipeline')


def _check_embedding_fits(params: Params, task: Task) -> None:
  """The model's vocabulary and longest sequence against an LM task's."""
  embeddings = [p for _, p in leaf_layers(params) if p.cls is Embedding]
  if not embeddings or not isinstance(task, LMTask):
    return
  embedding = embeddings[0]
  if embedding.vocab_size < task.vocab_size:
    raise ConfigError(
        f'model vocabulary {embedding.vocab_size} is smaller than the data '
        f'vocabulary {task.vocab_size}', where='transformer_lm.vocab_size / data.vocab_size',
        fix=f'set transformer_lm.vocab_size = {task.vocab_size}')
  if embedding.max_len and task.seq_len > embedding.max_len:
    raise ConfigError(
        f'data.seq_len={task.seq_len} is longer than the model\'s longest sequence, '
        f'transformer_lm.max_len={embedding.max_len}',
        where='data.seq_len / transformer_lm.max_len',
        fix=f'set transformer_lm.max_len >= {task.seq_len} or data.seq_len <= '
            f'{embedding.max_len}')
