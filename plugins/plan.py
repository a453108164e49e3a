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

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import pprint
import types

import gin

from layout_core.model import keras as keras_models
from layout_core.layout import scope as layout_scope
from layout_core import pipeline as pipeline_lib
from layout_core.checkpoint.manager import CheckpointConfig
from layout_core.errors import ConfigError
from layout_core.model.base import LayerMeta
from layout_core.layout.mesh import MeshSpec
from layout_core.train.optimizer import OptimizerConfig, state_axis
from layout_core.params import Params
from layout_core.pipeline.plan import PipelinePlan, check_pipelinable, plan_pipeline
from layout_core.layout.rules import LayoutRules
from layout_core.tasks import Task
from layout_core.train.config import TrainConfig, batch_axis_for
from layout_core.train.factory import plan_model
from layout_core.tasks import lm as lm_tasks
from plugins import configurables
from plugins.gin_setup import without_settings


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


def make_plan() -> RunPlan:
  """Calls every configurable once and validates the result (see module doc)."""
  mesh_spec = configurables.mesh()
  params = configurables.model()
  rules = configurables.layout_rules()
  task = configurables.data()
  optimizer = configurables.optimizer()
  train = configurables.train()
  checkpoint = configurables.checkpoint()
  pipeline_config = configurables.pipeline()
  batch_axis_for(train, mesh_spec.shape)  # the batch splits over its axis
  state_axis(optimizer, batch_axis=train.batch_axis, mesh_axes=mesh_spec.shape)
  pipeline = None
  if pipeline_config.enabled:
    check_pipelinable(params, task)
    pipeline = plan_pipeline(pipeline_config, params=params, mesh_axes=mesh_spec.shape,
                             batch_size=train.batch_size // train.grad_accum_steps,
                             seq_len=task.seq_len,
                             batch_axis=train.batch_axis)
  records, meta = plan_model(params, rules=rules, mesh_axes=mesh_spec.shape, task=task,
                             config=train, pipeline_plan=pipeline,
                             stage_axis=pipeline_config.stage_axis)
  layout_scope.report_unused_rules(rules, records)
  return RunPlan(mesh_spec=mesh_spec, params=params, rules=rules, task=task,
                 optimizer=optimizer, train=train, checkpoint=checkpoint,
                 pipeline_config=pipeline_config, records=records, meta=meta,
                 pipeline=pipeline, operative_config=operative_config())


def operative_config() -> str:
  """gin's operative config, dicts in their written order, less the built-in
  LM task's knobs (`data.vocab_size`, ...) when `data.task` names the task:
  that run never used them."""
  with dicts_in_written_order():
    text = gin.operative_config_str()
  try:
    task = gin.query_parameter(f'{configurables.MODULE}.data.task')
  except ValueError:  # not bound
    task = None
  if task is None:
    return text
  knobs = [f'data.{name}' for name in inspect.signature(lm_tasks.make_task).parameters
           if name != 'task']
  return without_settings(text, knobs)


@contextlib.contextmanager
def dicts_in_written_order():
  """gin formats values with `pprint.pformat`, which sorts dict keys: a
  `mesh.shape = {'stage': 2, 'data': 4}` would come back from config.gin as
  another axis order (another mesh). This keeps the order as written."""
  formatting = gin.config.pprint
  gin.config.pprint = types.SimpleNamespace(
      pformat=functools.partial(pprint.pformat, sort_dicts=False))
  try:
    yield
  finally:
    gin.config.pprint = formatting


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
    if os.path.islink(existing):  # a dangling link: its target may be an unmounted disk
      raise ConfigError(
          f'--model_dir {path!r} goes through the symbolic link {existing!r}, whose target '
          f'{os.readlink(existing)!r} does not exist', where=where,
          fix='create the target (mkdir -p it, or mount its filesystem), or give a path '
              'without the broken link; meshgin does not create a missing link target, '
              'since it is often a filesystem that is not mounted')
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
