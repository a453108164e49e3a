"""Pipelined training: the Trainer with its model cut into GPipe stages.

    mesh = build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))
    trainer = PipelineTrainer(pipeline=PipelineConfig(num_stages=2, num_micro_batches=4),
                              model_params=lm, mesh=mesh, rules=rules, task=task,
                              optimizer=OptimizerConfig(), config=TrainConfig())
    trainer.train()

The model is the usual Params tree, built as usual (same modules, variable
paths and checkpoint keys, so a checkpoint moves between pipelined and plain
runs), except that each leaf layer's variables are created on the sub-mesh of
the stage that runs it and laid out there by the rules. The stack is cut into
`num_stages` stages by FLOPs for one micro-batch (`pipeline.partition`), and a
step runs the GPipe schedule (`layout_core.pipeline.GPipe`). The optimizer
updates each stage on its own mesh with the global gradient norm.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np
from absl import logging

from layout_core.lazy import tf
from layout_core import mesh as mesh_lib
from layout_core import pipeline as pipeline_lib
from layout_core.data import LMTask
from layout_core.errors import ConfigError
from layout_core.layers import leaf_layers, step_seed
from layout_core.params import Params
from layout_core.rules import LayoutRules
from layout_core.trainer import Trainer, cross_entropy
from layout_core.variables import to_numpy


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  partition: pipeline_lib.PartitionPlan
  layer_stages: dict[str, int]   # leaf layer path -> stage
  num_micro_batches: int
  micro_batch_size: int


def plan_pipeline(config: pipeline_lib.PipelineConfig, *, params: Params,
                  mesh_axes: Mapping[str, int], batch_size: int, seq_len: int,
                  batch_axis: str) -> PipelinePlan:
  """Validates the pipeline config against model, mesh and batch, and cuts the
  stack into stages; nothing is allocated (launch.inspect uses it too)."""
  if config.batch_dim != 0:
    raise ConfigError(f'pipeline.batch_dim is {config.batch_dim}, but the language '
                      "model's inputs are [batch, time]", where='pipeline.batch_dim',
                      fix='use pipeline.batch_dim = 0')
  num_micro = config.micro_batches(batch_size)
  stages_in_mesh = mesh_axes.get(config.stage_axis, 1)
  if stages_in_mesh != config.num_stages:
    raise ConfigError(
        f'pipeline.num_stages={config.num_stages} but mesh axis '
        f"'{config.stage_axis}' has size {stages_in_mesh} (mesh {dict(mesh_axes)})",
        where='mesh.shape / pipeline.num_stages',
        fix=f"give the mesh a '{config.stage_axis}': {config.num_stages} axis, or set "
            f'pipeline.num_stages = {stages_in_mesh}')
  micro_size = batch_size // num_micro
  data_size = mesh_axes.get(batch_axis, 1)
  if micro_size % data_size:
    raise ConfigError(
        f'a micro-batch of {micro_size} (train.batch_size={batch_size} / {num_micro} '
        f"micro-batches) does not split over mesh axis '{batch_axis}' of size {data_size}",
        where='pipeline.num_micro_batches',
        fix=f'use fewer micro-batches, or a batch that is a multiple of '
            f'{num_micro * data_size}')
  leaves = leaf_layers(params)
  partition = pipeline_lib.partition(
      [p for _, p in leaves], num_stages=config.num_stages,
      input_shapes=[(micro_size, seq_len)], method=config.partition)
  return PipelinePlan(partition=partition,
                      layer_stages=pipeline_lib.layer_stages([p for p, _ in leaves], partition),
                      num_micro_batches=num_micro, micro_batch_size=micro_size)


def check_pipelinable(params, task) -> None:
  """Pipelining is wired for Params models on language-model tasks only."""
  if not isinstance(params, Params):
    raise ConfigError('pipelining a Keras model is not supported',
                      where='pipeline.enabled / model.params',
                      fix='turn pipelining off, or use a Params model')
  if not isinstance(task, LMTask):
    raise ConfigError(f'pipelining is wired for language-model tasks only, not '
                      f'{type(task).__name__}', where='pipeline.enabled / data.task',
                      fix='turn pipelining off for this task')


class PipelineTrainer(Trainer):
  """A Trainer whose model runs as GPipe stages on sub-meshes (see module doc)."""

  def __init__(self, *, pipeline: pipeline_lib.PipelineConfig, **kwargs):
    self.pipeline_config = pipeline
    super().__init__(**kwargs)

  def build_model(self, params: Params, rules: LayoutRules | None):
    check_pipelinable(params, self.task)
    config = self.config
    plan = plan_pipeline(self.pipeline_config, params=params,
                         mesh_axes=mesh_lib.mesh_axes(self.mesh),
                         batch_size=config.batch_size, seq_len=self.task.seq_len,
                         batch_axis=config.batch_axis)
    self.plan = plan.partition
    self.placement = pipeline_lib.SubMeshPlacement(
        mesh=self.mesh, stage_axis=self.pipeline_config.stage_axis, rules=rules,
        batch_axis=config.batch_axis, seed=config.seed)
    scope = pipeline_lib.StagedLayoutScope(meshes=self.placement.meshes,
                                           layer_stages=plan.layer_stages, rules=rules,
                                           seed=config.seed)
    with scope:
      model = params.Instantiate()

    self.gpipe = pipeline_lib.GPipe(stages=pipeline_lib.stage_runners(model, self.plan),
                                    placement=self.placement,
                                    loss_fn=cross_entropy,
                                    num_micro_batches=plan.num_micro_batches)
    path_of = {id(v): p for p, v in scope.variables.items()}
    self._stage_paths = [[path_of[id(v)] for v in variables]
                         for variables in self.gpipe.variables]
    self._apply = tf.function(self._apply_fn)
    logging.info('Pipeline: %d micro-batches of %d, bubble fraction %.3f\n%s',
                 plan.num_micro_batches, plan.micro_batch_size,
                 self.gpipe.bubble_fraction(), self.describe_stages())
    return model, scope

  # -- steps --------------------------------------------------------------------
  def pack(self, tokens):
    """Micro-batches of inputs on stage 0's mesh and of labels on the last's."""
    if isinstance(tokens, dict):  # the LM task's features
      tokens = tokens['tokens']
    num_micro, last = self.gpipe.num_micro_batches, self.gpipe.num_stages - 1
    inputs = np.split(tokens[:, :-1], num_micro)
    labels = np.split(tokens[:, 1:], num_micro)
    return ([self.placement.put(0, x, batch_dim=0) for x in inputs],
            [self.placement.put(last, y, batch_dim=0) for y in labels])

  def _apply_fn(self, grads, steps, norms):
    """Every stage's update, each on its own mesh (no crossing), then the counters."""
    rates = [self.optimizer.update(paths, stage_grads, step=step, norm=norm)
             for paths, stage_grads, step, norm in zip(self._stage_paths, grads, steps, norms)
             if paths]
    self.step.assign_add(1)
    self.data_position.assign_add(1)
    return rates[0]

  def loss_and_gradients(self, packed):
    """The GPipe forward and backward on one packed batch (no update); the
    same compiled functions the training steps use."""
    seed = np.int64(step_seed(self.config.seed, self.current_step))
    seeds = [self.placement.put(k, seed) for k in range(self.gpipe.num_stages)]
    return self.gpipe.loss_and_gradients(*packed, seeds=seeds)

  def train_step(self, tokens: np.ndarray):
    step = self.current_step
    seed = np.int64(step_seed(self.config.seed, step))
    seeds = [self.placement.put(k, seed) for k in range(self.gpipe.num_stages)]
    loss, grads, squared_norms = self.gpipe.loss_and_gradients(*self.pack(tokens), seeds=seeds)
    # The clipping norm spans all stages: summed on the host, then given to
    # each stage's mesh (a single function doing this would cross meshes both ways).
    norm = math.sqrt(sum(float(to_numpy(s)) for s in squared_norms if s is not None))
    put = self.placement.put
    rate = self._apply(grads, [put(k, np.int64(step)) for k in range(len(grads))],
                       [put(k, np.float32(norm)) for k in range(len(grads))])
    return loss, rate, tf.constant(norm)

  def train_step_with_metrics(self, batch):
    return (*self.train_step(batch), {})  # task metrics are not pipelined yet

  def eval_loss(self, packed) -> tf.Tensor:
    return self.gpipe.loss(*packed)

  def eval_loss_and_metrics(self, packed):
    return self.eval_loss(packed), {}

  # -- records -----------------------------------------------------------------------
  def describe_stages(self) -> str:
    """Markdown table: per stage its sub-mesh, FLOPs share and layers."""
    lines = ['| stage | sub-mesh | devices | FLOPs share | layers |', '|---|---|---|---|---|']
    for k, (stage, share) in enumerate(zip(self.plan.stages, self.plan.shares())):
      mesh = self.placement.meshes[k]
      shape = ' x '.join(f'{a}={n}' for a, n in mesh_lib.mesh_axes(mesh).items())
      devices = ', '.join(d.rsplit('/', 1)[-1] for d in mesh.local_devices())
      lines.append(f'| {k} | {shape} | {devices} | {share:.1%} | '
                   f'{", ".join(stage.names)} |')
    lines.append('')
    lines.append(f'{self.plan.method} partition, max/mean stage cost '
                 f'{self.plan.balance:.3f}; {self.gpipe.num_micro_batches} micro-batches; '
                 f'bubble fraction (K-1)/(M+K-1) = {self.gpipe.bubble_fraction():.3f}')
    return '\n'.join(lines) + '\n'

  def write_layouts(self) -> str:
    table = super().write_layouts()
    self.writer.text(step=0, tag='pipeline/stages', markdown=self.describe_stages())
    self.writer.scalars(step=0, values={
        'pipeline/bubble_fraction': self.gpipe.bubble_fraction(),
        'pipeline/num_stages': self.gpipe.num_stages,
        'pipeline/num_micro_batches': self.gpipe.num_micro_batches,
        'pipeline/partition_balance': self.plan.balance})
    return table
