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
import inspect
import os
import pprint
import re
from typing import Sequence

import gin

from layout_core.model import keras as keras_models
from layout_core.model import frozen, tuning
from layout_core.layout import scope as layout_scope
from layout_core import pipeline as pipeline_lib
from layout_core.checkpoint.manager import CheckpointConfig
from layout_core.errors import ConfigError
from layout_core.infer.text_samples import check_text_samples
from layout_core.model.base import LayerMeta
from layout_core.layout.mesh import MeshSpec
from layout_core.optim import OptimizerConfig, check_shard_state, count_parameters, state_axis
from layout_core.params import Params
from layout_core.pipeline.plan import PipelinePlan
from layout_core.layout.rules import LayoutRules
from layout_core.tasks import Task
from layout_core.tasks import base as tasks_base
from layout_core.train.config import TrainConfig, batch_axis_for
from layout_core.run.planning import plan_model, plan_pipeline_run
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
    return count_parameters(r.shape for r in self.records if not frozen.is_scale(r.path))

  def unsplit_axis_warnings(self) -> list[str]:
    """One line for each mesh axis of size > 1 that splits nothing: no
    variable's layout names it, and it is not the batch axis, the pipeline's
    stage axis (when pipelined) or the axis optimizer state is split over
    (`layout_scope.unsplit_axes`). `launch.train` logs them as warnings;
    `launch.inspect` prints them in its report."""
    axes = self.mesh_spec.shape
    batch_axis = batch_axis_for(self.train, axes)
    used = [batch_axis, self.pipeline_config.stage_axis if self.pipeline else None,
            state_axis(self.optimizer, batch_axis=batch_axis, mesh_axes=axes,
                       parameter_shapes=[r.shape for r in self.records])]
    return [layout_scope.unsplit_axis_warning(axis, axes[axis]) for axis in
            layout_scope.unsplit_axes(axes, specs=[r.spec for r in self.records], used=used)]

  def clients_problem(self, num_clients: int) -> str | None:
    """Why this run cannot be `num_clients` clients sharing the mesh evenly
    (None: it can): only a pipeline can object (`PipelineConfig.clients_problem`)."""
    if self.pipeline is None:
      return None
    return self.pipeline_config.clients_problem(
        num_clients=num_clients, devices_per_client=self.mesh_spec.num_devices // num_clients)


def make_plan(*, data_splits: Sequence[str] = tasks_base.SPLITS) -> RunPlan:
  """Calls every configurable once and validates the result (see module doc).

  `data_splits`: the splits whose data files the program reads, checked here
  (`Task.check_data`): training both, `launch.eval` ('eval',), decode, export
  and lm-eval none (), so they neither read nor need the training data."""
  train = configurables.train()
  params = tuning.tune(configurables.model(), lora=configurables.lora(),
                       trainable=train.trainable, frozen_dtype=train.frozen_dtype)
  parts = dict(mesh_spec=configurables.mesh(), params=params,
               rules=configurables.layout_rules(), task=configurables.data(),
               optimizer=configurables.optimizer(), train=train,
               checkpoint=configurables.checkpoint(), pipeline_config=configurables.pipeline())
  parts['task'].check_data(data_splits)
  return build_plan(**parts, operative_config=operative_config())


def build_plan(*, mesh_spec: MeshSpec, params, rules: LayoutRules, task: Task,
               optimizer: OptimizerConfig, train: TrainConfig, checkpoint: CheckpointConfig,
               pipeline_config: pipeline_lib.PipelineConfig, operative_config: str = '',
               quiet: bool = False, layouts_of: RunPlan | None = None) -> RunPlan:
  """The plan of these parts, checked as `launch.train` checks it (a
  ConfigError when it cannot run). The layout suggester (`plugins.suggest`)
  plans each candidate through here with its parts replaced; `quiet` skips
  the warning about rules that matched nothing (the strict check stays);
  `layouts_of`: a plan of the same model, mesh, rules, FSDP switch and
  pipeline stages and repeats (only accumulation or micro-batches differ),
  whose layout records are reused instead of planned again."""
  batch_axis = batch_axis_for(train, mesh_spec.shape)  # the batch splits over its axis
  check_shard_state(optimizer, batch_axis=batch_axis, mesh_axes=mesh_spec.shape)
  pipeline = plan_pipeline_run(pipeline_config, model=params, task=task, config=train,
                               mesh_axes=mesh_spec.shape, batch_axis=batch_axis)
  check_text_samples(config=train, params=params, task=task, pipelined=pipeline is not None)
  if layouts_of is not None:
    records, meta = layouts_of.records, layouts_of.meta
  else:
    records, meta = plan_model(params, rules=rules, mesh_axes=mesh_spec.shape, task=task,
                               config=train, pipeline_plan=pipeline,
                               stage_axis=pipeline_config.stage_axis)
  if not quiet or rules.strict:
    layout_scope.report_unused_rules(rules, records)
  return RunPlan(mesh_spec=mesh_spec, params=params, rules=rules, task=task,
                 optimizer=optimizer, train=train, checkpoint=checkpoint,
                 pipeline_config=pipeline_config, records=records, meta=meta,
                 pipeline=pipeline, operative_config=operative_config)


def operative_config() -> str:
  """gin's operative config, dicts in their written order, less the built-in
  LM task's knobs (`data.vocab_size`, ...) when `data.task` names the task:
  that run never used them."""
  text = dicts_in_written_order(gin.operative_config_str())
  try:
    task = gin.query_parameter(f'{configurables.MODULE}.data.task')
  except ValueError:  # not bound
    task = None
  if task is None:
    return text
  knobs = [f'data.{name}' for name in inspect.signature(lm_tasks.make_task).parameters
           if name != 'task']
  return without_settings(text, knobs)


def dicts_in_written_order(text: str) -> str:
  """`text` (a gin config string) with every bound dict's keys in the order
  they were written. gin formats values with `pprint.pformat`, which sorts
  dict keys: `mesh.shape = {'stage': 2, 'data': 4}` would come back from
  config.gin as another axis order (another mesh). Each binding is written
  again from its bound value (`gin.query_parameter`, a macro's too) unsorted,
  where gin's sorted rendering of that value is exactly the binding's text;
  gin's own formatting is left alone (nothing in gin is patched)."""
  lines, out, statement = text.split('\n'), [], []

  def flush():
    if statement:
      out.append(_unsorted_binding('\n'.join(statement)))
      statement.clear()

  for line in lines:
    if _BINDING_START.match(line):
      flush()
      statement.append(line)
    elif statement and line.startswith(' ' * _CONTINUATION_INDENT):
      statement.append(line)
    else:
      flush()
      out.append(line)
  flush()
  return '\n'.join(out)


_BINDING_START = re.compile(r'^([A-Za-z_][\w./]*) = ')
_MAX_LINE_LENGTH, _CONTINUATION_INDENT = 80, 4  # gin.operative_config_str's defaults


def _unsorted_binding(statement: str) -> str:
  """One `key = value` statement of gin's, its dicts unsorted (see above)."""
  key = _BINDING_START.match(statement).group(1)
  # A macro (`SHAPE = {...}`) is bound as `SHAPE/gin.macro.value`.
  query = key if '.' in key.rsplit('/', 1)[-1] else f'{key}/gin.macro.value'
  try:
    value = gin.query_parameter(query)
  except ValueError:  # a default gin printed from the signature: nothing was written
    return statement
  if _format_binding(key, value, sort_dicts=True) != statement:
    return statement  # not the value gin printed here: keep gin's text
  return _format_binding(key, value, sort_dicts=False)


def _format_binding(key: str, value, *, sort_dicts: bool) -> str:
  """A binding as gin's `operative_config_str` formats it (its layout rules),
  with or without sorting dicts."""
  formatted = pprint.pformat(value, width=_MAX_LINE_LENGTH - _CONTINUATION_INDENT,
                             sort_dicts=sort_dicts)
  value_lines = formatted.split('\n')
  if len(value_lines) == 1 and len(key + formatted) <= _MAX_LINE_LENGTH:
    return f'{key} = {formatted}'
  indented = '\n'.join(' ' * _CONTINUATION_INDENT + line for line in value_lines)
  return f'{key} = \\\n{indented}'


def check_data_tokenizer(run_plan: RunPlan, *, model_dir: str) -> None:
  """ConfigError when the run's data was tokenized with another tokenizer
  than the model's own: the run's (an imported run fine-tuned in place) or
  that of the run `checkpoint.init_from` names
  (`layout_core.tasks.corpus_tokenizer.check_run_tokenizer`)."""
  from layout_core.tasks import corpus_tokenizer  # pylint: disable=g-import-not-at-top
  from plugins.origin import base_run  # pylint: disable=g-import-not-at-top  # imports this
  base = base_run(run_plan.checkpoint.init_from)
  run_dirs = [model_dir] + ([base] if base else [])
  corpus_tokenizer.check_run_tokenizer(run_plan.task, run_dirs=run_dirs)


def _probe_writable(directory: str) -> None:
  """OSError unless a file can be created in `directory`: a file without a
  name (O_TMPFILE), gone when closed, so a stop signal during start-up (which
  ends the process at once) cannot leave it behind; where the filesystem has
  no unnamed files (or it refuses one), a named probe created and removed."""
  try:
    os.close(os.open(directory, getattr(os, 'O_TMPFILE', 0) | os.O_WRONLY, 0o600))
    return
  except OSError:
    pass  # the named probe below says why, in the words a user knows
  probe = os.path.join(directory, f'.meshgin-probe-{os.getpid()}')
  with open(probe, 'w'):
    pass
  os.remove(probe)


def check_model_dir(path: str) -> None:
  """ConfigError unless `path` is (or can become) a writable directory.

  Checked for real, by creating a file in `path` or in its nearest existing
  parent (`_probe_writable`); nothing is left there."""
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
  try:
    _probe_writable(existing)
  except OSError as e:
    raise ConfigError(f'--model_dir {path!r} is not writable ({e.strerror} in '
                      f'{existing!r})', where=where,
                      fix='choose a directory you can write to') from None
