"""The one place that picks a step engine, from the model and the pipeline plan.

    trainer = make_trainer(model=lm_params, mesh=mesh, rules=rules, task=task,
                           optimizer=OptimizerConfig(), config=TrainConfig(),
                           pipeline=PipelineConfig(num_stages=2, num_micro_batches=4))
    trainer.train()

Which engine runs a step depends only on what the plan says: a pipeline plan
picks its engine (`'submesh'`: GPipe, `'spmd'`: the stage axis); otherwise a
Params tree or a Keras 3 model runs on the whole mesh (`SingleProgramEngine`
with a `ModelProgram`). With `layout_core.run.planning` (config time) this is
the one module that asks what kind of model it has. It sits above both
`layout_core.train` and `layout_core.pipeline`, so the pipeline engines can
build on the training loop's pieces without the loop knowing about them.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from layout_core.layout import fsdp
from layout_core.layout import mesh as mesh_lib
from layout_core.layout.rules import LayoutRules
from layout_core.model.base import compute_params
from layout_core.model.built import build_params_model
from layout_core.optim import OptimizerConfig
from layout_core.params import Params
from layout_core.pipeline.config import PipelineConfig
from layout_core.pipeline.engines import GPipeEngine, spmd_engine
from layout_core.pipeline.plan import PipelinePlan
from layout_core.run.planning import (check_reference_supported, check_segments_supported,
                                      fsdp_axis_of, plan_pipeline_run)
from layout_core.tasks import Task
from layout_core.train.config import TrainConfig, batch_axis_for
from layout_core.train.engine import Counters, ModelProgram, SingleProgramEngine, StepEngine
from layout_core.train.loop import Trainer


def make_engine(*, model, mesh, rules: LayoutRules | None, task: Task,
                optimizer: OptimizerConfig, config: TrainConfig, counters: Counters,
                pipeline: PipelineConfig | None = None,
                pipeline_plan: PipelinePlan | None = None,
                bubble_fill: float | None = None, weights_only: bool = False) -> StepEngine:
  """The engine for `model` (a Params tree or `layout_core.model.keras.KerasModel`).

  A pipelined run passes its `pipeline` config and the `pipeline_plan` made
  at config time (`plugins.plan`); a library caller may leave the plan out
  and it is made here. `bubble_fill` (tests: NaN) fills the SPMD engine's idle slots.
  `weights_only`: a Params model's variables alone, started as zeros for a
  caller that assigns every one (an import), with no optimizer (one-program
  engine only; `LayoutScope.zero_init`)."""
  mesh_axes = mesh_lib.mesh_axes(mesh)
  # Resolved once (UNSHARDED when the mesh lacks the axis); every engine gets these.
  batch_axis = batch_axis_for(config, mesh_axes, warn=True)
  pipelined = pipeline is not None and pipeline.enabled
  split_axis = fsdp_axis_of(model, config=config, mesh_axes=mesh_axes,
                            stage_axis=pipeline.stage_axis if pipelined else None)
  engine = _engine(model, mesh=mesh, rules=rules, task=task, optimizer=optimizer,
                   config=config, counters=counters, pipeline=pipeline,
                   pipeline_plan=pipeline_plan, bubble_fill=bubble_fill,
                   batch_axis=batch_axis, fsdp_axis=split_axis, weights_only=weights_only)
  if split_axis is not None:
    fsdp.log_split(engine.layout_records, split_axis)
  return engine


def _engine(model, *, mesh, rules, task, optimizer, config, counters, pipeline, pipeline_plan,
            bubble_fill, batch_axis, fsdp_axis, weights_only=False) -> StepEngine:
  """`make_engine` with the batch and FSDP axes resolved."""
  mesh_axes = mesh_lib.mesh_axes(mesh)
  pipelined = pipeline is not None and pipeline.enabled
  check_segments_supported(model, task, pipelined=pipelined)
  if weights_only and (pipelined or not isinstance(model, Params)):
    raise ValueError('weights_only builds a Params model on the one-program engine only')
  if isinstance(model, Params):
    model = compute_params(model, dtype=config.compute_dtype, remat=config.remat)
  plan = None
  if pipelined:
    plan = pipeline_plan or plan_pipeline_run(pipeline, model=model, task=task, config=config,
                                              mesh_axes=mesh_axes, batch_axis=batch_axis)
  check_reference_supported(model, task, config=config, pipeline_plan=plan)
  if plan is not None:
    if plan.engine == 'spmd':
      return spmd_engine(
          params=model, plan=plan, stage_axis=pipeline.stage_axis, mesh=mesh,
          rules=rules, task=task, optimizer=optimizer, config=config, counters=counters,
          batch_axis=batch_axis, bubble_fill=bubble_fill, fsdp_axis=fsdp_axis)
    return GPipeEngine(params=model, plan=plan, stage_axis=pipeline.stage_axis,
                       mesh=mesh, rules=rules, task=task, optimizer=optimizer,
                       config=config, counters=counters, batch_axis=batch_axis,
                       fsdp_axis=fsdp_axis)
  if isinstance(model, Params):
    built = build_params_model(model, mesh=mesh, rules=rules, seed=config.seed,
                               fsdp_axis=fsdp_axis, zero_init=weights_only)
  else:
    from layout_core.model import keras  # pylint: disable=g-import-not-at-top
    built = keras.build(model, mesh=mesh, rules=rules, seed=config.seed,
                        input_specs=task.input_specs(config.batch_size),
                        compute_dtype=config.compute_dtype, remat=config.remat)
  return SingleProgramEngine(
      program=ModelProgram(model=built, task=task, mesh=mesh, batch_axis=batch_axis),
      mesh=mesh, optimizer=None if weights_only else optimizer, config=config,
      counters=counters)


def make_trainer(*, model, mesh, rules: LayoutRules | None, task: Task,
                 optimizer: OptimizerConfig, config: TrainConfig,
                 pipeline: PipelineConfig | None = None,
                 pipeline_plan: PipelinePlan | None = None, writer=None,
                 profile_dir: str | None = None, bubble_fill: float | None = None,
                 model_flops_per_step: float | None = None,
                 peak_flops: float | None = None,
                 text_samples: Callable[[Mapping[str, Any]], str] | None = None,
                 weights_only: bool = False) -> Trainer:
  """Counters, the engine (`make_engine`) and the loop around them (the FLOP
  figures feed train/model_flops_per_sec and train/mfu, and `text_samples`
  samples/text, see `Trainer`)."""
  counters = Counters(mesh)
  engine = make_engine(model=model, mesh=mesh, rules=rules, task=task, optimizer=optimizer,
                       config=config, counters=counters, pipeline=pipeline,
                       pipeline_plan=pipeline_plan, bubble_fill=bubble_fill,
                       weights_only=weights_only)
  return Trainer(engine=engine, counters=counters, task=task, config=config, writer=writer,
                 profile_dir=profile_dir, model_flops_per_step=model_flops_per_step,
                 peak_flops=peak_flops, text_samples=text_samples)
