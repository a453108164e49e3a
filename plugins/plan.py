"""The typed plan: the gin config resolved once, validated, without TensorFlow.

    sources = parse_gin(files=[...], bindings=[...])
    plan = make_plan()                      # every configurable called exactly once
    plan.train.num_steps, plan.mesh_spec.describe(), plan.records[0].spec

`launch.train` and `launch.inspect` share this plan, so they accept and
reject exactly the same configs. Everything here is plain Python (TensorFlow
is not imported), so a typo, a wrong type or range, a rule that does not fit
a variable, or a batch that does not split over the mesh is reported in well
under a second. What needs the machine (devices, an existing checkpoint, a
layout DTensor cannot run) is checked next, by `plugins.training`, still
before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import os

import gin

from layout_core.model import keras as keras_models
from layout_core.layout import scope as layout_scope
from layout_core import pipeline as pipeline_lib
from layout_core.checkpoint.manager import CheckpointConfig
from layout_core.tasks.lm import LMTask
from layout_core.errors import ConfigError
from layout_core.model.base import LayerMeta, leaf_layers
from layout_core.model.layers import Embedding
from layout_core.layout.mesh import MeshSpec
from layout_core.train.optimizer import OptimizerConfig
from layout_core.params import Params
from layout_core.pipeline.plan import (PipelinePlan, check_pipelinable, plan_layout_records,
                                       plan_pipeline)
from layout_core.layout.rules import LayoutRules
from layout_core.tasks import Task
from layout_core.train.config import TrainConfig, batch_axis_for
from plugins import configurables


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """Everything the config decides, checked, before a device is touched."""
  mesh_spec: MeshSpec
  params: Params | keras_models.KerasModel  # a Params tree (frozen) or a Keras model
  rules: LayoutRules
  task: Task
  optimizer: OptimizerConfig
  train: TrainConfig
  checkpoint: CheckpointConfig
  pipeline_config: pipeline_lib.PipelineConfig
  records: list[layout_scope.LayoutRecord]  # every variable's layout
  meta: LayerMeta | None          # forward cost of one global batch (None: Keras)
  pipeline: PipelinePlan | None   # set when pipelining is on
  operative_config: str           # gin's operative config (what config.gin records)

  @property
  def num_parameters(self) -> int:
    return sum(math.prod(r.shape) for r in self.records)


def check_model_fits_data(params, task: Task, batch_size: int) -> LayerMeta | None:
  """Vocabulary and sequence-length agreement, plus the model's cost report
  (None for a Keras model: its FLOPs are not declared)."""
  if isinstance(params, keras_models.KerasModel):
    return None
  embeddings = [p for _, p in leaf_layers(params) if p.cls is Embedding]
  if embeddings and isinstance(task, LMTask):
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
  return params.cls.fprop_meta(params, *[shape for shape, _ in task.input_specs(batch_size)])


def make_plan() -> RunPlan:
  """Calls every configurable once and validates the result (see module doc)."""
  mesh_spec = configurables.mesh()
  params = configurables.model()
  if isinstance(params, Params):
    params = params.Freeze()
  rules = configurables.layout_rules()
  task = configurables.data()
  optimizer = configurables.optimizer()
  train = configurables.train()
  checkpoint = configurables.checkpoint()
  pipeline_config = configurables.pipeline()
  meta = check_model_fits_data(params, task, train.batch_size)
  batch_axis_for(train, mesh_spec.shape)  # the batch splits over its axis
  pipeline = None
  mesh_axes = dict(mesh_spec.shape)
  if pipeline_config.enabled:
    check_pipelinable(params, task)
    pipeline = plan_pipeline(pipeline_config, params=params, mesh_axes=mesh_spec.shape,
                             batch_size=train.batch_size, seq_len=task.seq_len,
                             batch_axis=train.batch_axis)
    mesh_axes.pop(pipeline_config.stage_axis, None)  # rules apply inside a stage
  if isinstance(params, keras_models.KerasModel):
    records = keras_models.plan(params, rules=rules, mesh_axes=mesh_axes,
                                input_specs=task.input_specs(train.batch_size),
                                seed=train.seed)
  elif pipeline is not None:
    records = plan_layout_records(pipeline, params=params, rules=rules,
                                  mesh_axes=mesh_spec.shape,
                                  stage_axis=pipeline_config.stage_axis)
  else:
    records = layout_scope.plan_layouts(params.cls.variable_specs(params), rules, mesh_axes)
  layout_scope.report_unused_rules(rules, records)
  return RunPlan(mesh_spec=mesh_spec, params=params, rules=rules, task=task,
                 optimizer=optimizer, train=train, checkpoint=checkpoint,
                 pipeline_config=pipeline_config, records=records, meta=meta,
                 pipeline=pipeline, operative_config=gin.operative_config_str())


def check_model_dir(path: str) -> None:
  """ConfigError unless `path` is (or can become) a writable directory.

  Checked for real, by creating and removing a probe file, in `path` or in
  its nearest existing parent; nothing else is created."""
  where = f'--model_dir={path}'
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'--model_dir {path!r} is a file, not a directory', where=where,
                      fix='give a directory path (a new one is created)')
  existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(f'--model_dir {path!r} cannot be created: {existing!r} is a file',
                      where=where, fix='give a path whose parents are directories')
  probe = os.path.join(existing, f'.meshgin-probe-{os.getpid()}')
  try:
    with open(probe, 'w'):
      pass
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f'--model_dir {path!r} is not writable ({e.strerror} in '
                      f'{existing!r})', where=where,
                      fix='choose a directory you can write to') from None
