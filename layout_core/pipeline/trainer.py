"""Pipelined training: the Trainer with its model run by a pipeline engine.

    mesh = build_mesh(MeshSpec(shape={'stage': 2, 'data': 2, 'model': 2}))
    trainer = make_pipeline_trainer(
        pipeline=PipelineConfig(num_stages=2, num_micro_batches=4, engine='spmd'),
        model_params=lm, mesh=mesh, rules=rules, task=task,
        optimizer=OptimizerConfig(), config=TrainConfig())
    trainer.train()

* engine 'submesh' (`PipelineTrainer`): the usual Params tree, each leaf
  layer's variables on the sub-mesh of its stage; the leaves are cut into
  stages by FLOPs (`pipeline.partition`) and a step runs `submesh.GPipe`; the
  optimizer updates each stage on its own mesh with the global gradient norm.
* engine 'spmd' (`SpmdPipelineTrainer`): the layers before the stack of
  identical cells (embedding) and after it (final norm, softmax) run on the
  whole mesh; the cells are stacked on the stage axis (`spmd.StackedCells`)
  and run by `spmd.SpmdPipeline`. One tf.function does forward, backward and
  the optimizer update, like the plain Trainer.

Both keep the plain run's checkpoint keys, so a checkpoint moves between the
engines and unpipelined runs.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from absl import logging

from layout_core.lazy import Module, tf, dtensor
from layout_core.layout import scope as layout_scope_lib
from layout_core.layout import mesh as mesh_lib
from layout_core.model.base import Sequential
from layout_core.model.random import random_context, step_seed
from layout_core.params import Params
from layout_core.pipeline import spmd as spmd_lib
from layout_core.pipeline.config import PipelineConfig
from layout_core.pipeline.plan import PipelinePlan, check_pipelinable, plan_pipeline
from layout_core.pipeline.stages import build_staged_model
from layout_core.pipeline.submesh import GPipe
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.train.loop import Trainer, cross_entropy
from layout_core.layout.variables import to_numpy


class _PipelinedTrainer(Trainer):
  """What both engines' trainers share: the pipeline config, its plan (made
  while the model is built), and its TensorBoard records."""

  def __init__(self, *, pipeline: PipelineConfig, **kwargs):
    self.pipeline_config = pipeline
    super().__init__(**kwargs)

  def _make_plan(self, params: Params) -> PipelinePlan:
    check_pipelinable(params, self.task)
    self.pipeline_plan = plan_pipeline(
        self.pipeline_config, params=params, mesh_axes=mesh_lib.mesh_axes(self.mesh),
        batch_size=self.config.batch_size, seq_len=self.task.seq_len,
        batch_axis=self.config.batch_axis)
    return self.pipeline_plan

  def describe_stages(self) -> str:
    raise NotImplementedError

  def write_layouts(self) -> str:
    table = super().write_layouts()
    plan = self.pipeline_plan
    self.writer.text(step=0, tag='pipeline/stages', markdown=self.describe_stages())
    values = {'pipeline/bubble_fraction': plan.bubble_fraction(),
              'pipeline/num_stages': plan.num_stages,
              'pipeline/num_micro_batches': plan.num_micro_batches,
              'pipeline/partition_balance': plan.partition.balance}
    if plan.engine == 'spmd':
      values['pipeline/circular_repeats'] = plan.circular_repeats
    self.writer.scalars(step=0, values=values)
    return table


class PipelineTrainer(_PipelinedTrainer):
  """A Trainer whose model runs as GPipe stages on sub-meshes (engine 'submesh')."""

  def build_model(self, params: Params, rules: LayoutRules | None):
    config = self.config
    plan = self._make_plan(params)
    staged = build_staged_model(
        params, mesh=self.mesh, rules=rules, num_stages=self.pipeline_config.num_stages,
        input_shapes=[(plan.micro_batch_size, self.task.seq_len)],
        method=self.pipeline_config.partition, stage_axis=self.pipeline_config.stage_axis,
        batch_axis=config.batch_axis, seed=config.seed)
    self.plan, self.placement = staged.plan, staged.placement
    self.gpipe = GPipe(stages=staged.runners, placement=self.placement,
                       loss_fn=cross_entropy, num_micro_batches=plan.num_micro_batches)
    path_of = {id(v): p for p, v in staged.scope.variables.items()}
    self._stage_paths = [[path_of[id(v)] for v in variables]
                         for variables in self.gpipe.variables]
    self._apply = tf.function(self._apply_fn)
    logging.info('Pipeline: %d micro-batches of %d, bubble fraction %.3f\n%s',
                 plan.num_micro_batches, plan.micro_batch_size,
                 self.gpipe.bubble_fraction(), self.describe_stages())
    return staged.model, staged.scope

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



class _SpmdScope:
  """What Trainer expects back from build_model: layout records and path -> variable."""

  def __init__(self):
    self.records: list[layout_scope_lib.LayoutRecord] = []
    self.variables: dict[str, tf.Variable] = {}


class SpmdModel(Module):
  """The model for the SPMD engine: the root's children under their own names
  (so checkpoint keys match the plain model), the stack as `StackedCells`."""

  def __init__(self, name: str, children: Sequence[tuple[str, tf.Module]]):
    super().__init__(name=name)
    self.child_names = tuple(n for n, _ in children)
    for child_name, module in children:
      setattr(self, child_name, module)


class SpmdPipelineTrainer(_PipelinedTrainer):
  """A Trainer whose cell stack runs on the SPMD stage-axis engine (module doc)."""

  def __init__(self, *, pipeline: PipelineConfig, bubble_fill: float | None = None,
               **kwargs):
    self.bubble_fill = bubble_fill  # NaN in tests
    super().__init__(pipeline=pipeline, **kwargs)
    paths = list(self.stack.stacked_variables)
    self.stack.tag_slots({p: (self.optimizer.m[p], self.optimizer.v[p]) for p in paths
                          if p in self.optimizer.m})
    self.micro_layout = dtensor.Layout([UNSHARDED, self.batch_axis, UNSHARDED], self.mesh)

  def build_model(self, params: Params, rules: LayoutRules | None):
    config = self.config
    plan = self._make_plan(params)
    children = list(Sequential.child_params(params).items())
    scope = _SpmdScope()
    built = []
    with layout_scope_lib.LayoutScope(mesh=self.mesh, rules=rules, seed=config.seed) as plain:
      for i, (name, child) in enumerate(children):
        if i == plan.stack_index:
          stack = spmd_lib.StackedCells(
              list(Sequential.child_params(child).values()), parent_path=params.name,
              mesh=self.mesh, rules=rules, num_stages=plan.num_stages,
              repeats=plan.circular_repeats, stage_axis=self.pipeline_config.stage_axis,
              batch_axis=config.batch_axis, seed=config.seed, name=name)
          built.append((name, stack))
          scope.records += stack.records
          scope.variables.update(stack.stacked_variables)
        else:
          module = child.Instantiate(parent_path=params.name)
          built.append((name, module))
          new = [p for p in plain.variables if p not in scope.variables]
          scope.records += [r for r in plain.records if r.path in new]
          scope.variables.update({p: plain.variables[p] for p in new})
    self.stack = stack
    self.before = [m for _, m in built[:plan.stack_index]]
    self.after = [m for _, m in built[plan.stack_index + 1:]]
    self.engine = spmd_lib.SpmdPipeline(stack, num_micro_batches=plan.num_micro_batches,
                                        bubble_fill=self.bubble_fill)
    logging.info('SPMD pipeline: %d stages x %d circular repeat(s), %d micro-batches of '
                 '%d, bubble fraction %.3f', plan.num_stages, plan.circular_repeats,
                 plan.num_micro_batches, plan.micro_batch_size, plan.bubble_fraction())
    return SpmdModel(params.name, built), scope

  # -- steps --------------------------------------------------------------------
  def pack(self, tokens):
    """A host batch [B, T+1] as [M, B/M, T+1], micro-batches split over the batch axis."""
    if isinstance(tokens, dict):  # the LM task's features
      tokens = tokens['tokens']
    num_micro = self.pipeline_plan.num_micro_batches
    micro = tokens.reshape((num_micro, tokens.shape[0] // num_micro) + tokens.shape[1:])
    return mesh_lib.pack_global_array(micro, self.micro_layout)

  def loss_and_metrics(self, tokens, *, training: bool = False):
    """Mean cross entropy over micro-batches (= the batch's, all being equal);
    task metrics are not pipelined yet."""
    plan = self.pipeline_plan
    num_micro = plan.num_micro_batches
    from layout_core.model import layers as layers_lib  # pylint: disable=g-import-not-at-top
    state = getattr(layers_lib._random, 'state', None)  # pylint: disable=protected-access

    def run(modules, x, m):
      if state is None:
        for module in modules:
          x = module(x)
        return x
      with random_context(seed=state[0], batch_offset=state[1] + m * plan.micro_batch_size):
        for module in modules:
          x = module(x)
      return x

    # tf.gather, not tokens[m]: in TF 2.21 DTensor, indexing away dim 0 of a
    # tensor sharded on dim 1 returns wrong values with a shifted layout.
    micro = [tf.gather(tokens, m) for m in range(num_micro)]
    hidden = [run(self.before, micro[m][:, :-1], m) for m in range(num_micro)]
    outputs = self.engine(hidden)
    shares = [cross_entropy(run(self.after, y, m), micro[m][:, 1:]) / num_micro
              for m, y in enumerate(outputs)]
    return tf.add_n(shares), {}

  # -- records -----------------------------------------------------------------------
  def describe_stages(self) -> str:
    plan = self.pipeline_plan
    lines = ['| stage | cells (layer order) |', '|---|---|']
    for k, stage in enumerate(plan.partition.stages):
      lines.append(f'| {k} | {", ".join(stage.names)} |')
    lines.append('')
    lines.append(f'{plan.partition.method}; {plan.num_micro_batches} micro-batches; '
                 f'bubble fraction (S-1)/(R*M+S-1) = {plan.bubble_fraction():.3f}')
    return '\n'.join(lines) + '\n'



def make_pipeline_trainer(*, pipeline: PipelineConfig, **kwargs) -> Trainer:
  """The trainer for `pipeline.engine`."""
  if pipeline.engine == 'spmd':
    return SpmdPipelineTrainer(pipeline=pipeline, **kwargs)
  return PipelineTrainer(pipeline=pipeline, **kwargs)
