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

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from layout_core import layout_scope as layout_scope_lib
from layout_core import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.layers import Sequential, leaf_layers, random_context, step_seed
from layout_core.params import Params
from layout_core.pipeline import partitioning as partition_lib
from layout_core.pipeline import schedule as schedule_lib
from layout_core.pipeline import spmd as spmd_lib
from layout_core.pipeline.config import PipelineConfig
from layout_core.pipeline.stages import build_staged_model
from layout_core.pipeline.submesh import GPipe
from layout_core.rules import UNSHARDED, LayoutRules
from layout_core.trainer import Trainer, cross_entropy
from layout_core.variables import to_numpy


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  engine: str                            # 'submesh' | 'spmd'
  partition: partition_lib.PartitionPlan  # stages and their layers (spmd: the cells)
  layer_stages: dict[str, int]           # leaf layer path -> stage (spmd: cells only)
  num_micro_batches: int
  micro_batch_size: int
  circular_repeats: int = 1
  stack_index: int | None = None         # spmd: index of the stack among the root's children

  @property
  def num_stages(self) -> int:
    return len(self.partition.stages)

  def bubble_fraction(self) -> float:
    return schedule_lib.bubble_fraction(self.num_stages, self.num_micro_batches,
                                        self.circular_repeats)


def find_cell_stack(params: Params) -> int:
  """Index among the root Sequential's children of the stack of cells the SPMD
  engine pipelines: the child Sequential with the most children (the LM's
  `stack`); a ConfigError when there is none."""
  if params.cls is not Sequential:
    raise ConfigError(f"pipeline.engine='spmd' needs a Sequential model, got "
                      f'{params.cls.__name__}', where='model.params',
                      fix="use transformer_lm, or pipeline.engine = 'submesh'")
  children = list(Sequential.child_params(params).values())
  stacks = [(len(Sequential.child_params(c)), i) for i, c in enumerate(children)
            if c.cls is Sequential]
  if not stacks:
    raise ConfigError(f"pipeline.engine='spmd' pipelines a stack of identical cells "
                      f'(a Sequential inside {params.name}); {params.name} has none',
                      where='model.params', fix="use pipeline.engine = 'submesh'")
  return max(stacks)[1]


def plan_pipeline(config: PipelineConfig, *, params: Params, mesh_axes: Mapping[str, int],
                  batch_size: int, seq_len: int, batch_axis: str) -> PipelinePlan:
  """Validates the pipeline config against model, mesh and batch, and places
  layers on stages; nothing is allocated (launch.inspect uses it too)."""
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
  if config.engine == 'spmd':
    return _plan_spmd(config, params=params, num_micro=num_micro, micro_size=micro_size,
                      seq_len=seq_len)
  leaves = leaf_layers(params)
  partition = partition_lib.partition(
      [p for _, p in leaves], num_stages=config.num_stages,
      input_shapes=[(micro_size, seq_len)], method=config.partition)
  return PipelinePlan(engine='submesh', partition=partition,
                      layer_stages=partition_lib.layer_stages([p for p, _ in leaves],
                                                              partition),
                      num_micro_batches=num_micro, micro_batch_size=micro_size)


def _plan_spmd(config: PipelineConfig, *, params: Params, num_micro: int, micro_size: int,
               seq_len: int) -> PipelinePlan:
  index = find_cell_stack(params)
  children = list(Sequential.child_params(params).values())
  stack = children[index]
  cells = list(Sequential.child_params(stack).values())
  where = f'{params.name}/{stack.name}'
  spmd_lib.check_identical_cells(cells, where=where)
  spmd_lib.check_stackable(cells[0])
  num_stages, repeats = config.num_stages, config.circular_repeats
  per_chunk = spmd_lib.check_cell_count(len(cells), num_stages, repeats)
  schedule_lib.clock_order(num_stages, num_micro, repeats=repeats)  # M >= S with R > 1
  shapes = [(micro_size, seq_len)]
  for child in children[:index]:
    shapes = child.cls.fprop_meta(child, *shapes).out_shapes
  cost = cells[0].cls.fprop_meta(cells[0], *shapes).flops
  slots = [spmd_lib.cell_slot(l, num_stages=num_stages, cells_per_chunk=per_chunk)
           for l in range(len(cells))]
  stages = tuple(
      partition_lib.StagePlan(layers=tuple(c for c, slot in zip(cells, slots)
                                           if slot.stage == s),
                              cost=cost * len(cells) // num_stages)
      for s in range(num_stages))
  partition = partition_lib.PartitionPlan(
      stages=stages, method=f'spmd: identical cells, {repeats} circular repeat(s) of '
                            f'{per_chunk} cell(s) per stage')
  base = f'{params.name}/{stack.name}'
  return PipelinePlan(engine='spmd', partition=partition,
                      layer_stages={f'{base}/{c.name}': slot.stage
                                    for c, slot in zip(cells, slots)},
                      num_micro_batches=num_micro, micro_batch_size=micro_size,
                      circular_repeats=repeats, stack_index=index)


def plan_layout_records(plan: PipelinePlan, *, params: Params, rules: LayoutRules,
                        mesh_axes: Mapping[str, int],
                        stage_axis: str) -> list[layout_scope_lib.LayoutRecord]:
  """The inspect report's layout records of a pipelined run (nothing allocated):
  sub-mesh engine: every variable on its stage's sub-mesh; SPMD engine: the
  cells' variables per cell with the stage axis added, the rest on the whole mesh."""
  specs = params.cls.variable_specs(params)
  if plan.engine == 'submesh':
    axes = {a: n for a, n in mesh_axes.items() if a != stage_axis}
    records = layout_scope_lib.plan_layouts(specs, rules, axes)
    return [dataclasses.replace(
        r, mesh=f'{stage_axis}{partition_lib.stage_of(plan.layer_stages, r.path)}')
        for r in records]
  axes = {a: n for a, n in mesh_axes.items() if a != stage_axis}
  records = layout_scope_lib.plan_layouts(specs, rules, axes)
  out = []
  for r in records:
    if any(r.path.startswith(cell + '/') for cell in plan.layer_stages):
      # Stacked: each device holds 1/S of the cells (per cell, on average).
      out.append(dataclasses.replace(
          r, spec=(stage_axis,) + r.spec, source=f'{r.source} (+ stacked on {stage_axis})',
          bytes_per_device=r.bytes_per_device // plan.num_stages))
    else:
      out.append(r)
  return out


class PipelineTrainer(Trainer):
  """A Trainer whose model runs as GPipe stages on sub-meshes (engine 'submesh')."""

  def __init__(self, *, pipeline: PipelineConfig, **kwargs):
    self.pipeline_config = pipeline
    super().__init__(**kwargs)

  def build_model(self, params: Params, rules: LayoutRules | None):
    config = self.config
    plan = plan_pipeline(self.pipeline_config, params=params,
                         mesh_axes=mesh_lib.mesh_axes(self.mesh),
                         batch_size=config.batch_size, seq_len=self.task.seq_len,
                         batch_axis=config.batch_axis)
    self.pipeline_plan = plan
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
  def pack(self, tokens: np.ndarray):
    """Micro-batches of inputs on stage 0's mesh and of labels on the last's."""
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

  def eval_loss(self, packed) -> tf.Tensor:
    return self.gpipe.loss(*packed)

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


class _SpmdScope:
  """What Trainer expects back from build_model: layout records and path -> variable."""

  def __init__(self):
    self.records: list[layout_scope_lib.LayoutRecord] = []
    self.variables: dict[str, tf.Variable] = {}


class SpmdModel(tf.Module):
  """The model for the SPMD engine: the root's children under their own names
  (so checkpoint keys match the plain model), the stack as `StackedCells`."""

  def __init__(self, name: str, children: Sequence[tuple[str, tf.Module]]):
    super().__init__(name=name)
    self.child_names = tuple(n for n, _ in children)
    for child_name, module in children:
      setattr(self, child_name, module)


class SpmdPipelineTrainer(Trainer):
  """A Trainer whose cell stack runs on the SPMD stage-axis engine (module doc)."""

  def __init__(self, *, pipeline: PipelineConfig, bubble_fill: float | None = None,
               **kwargs):
    self.pipeline_config = pipeline
    self.bubble_fill = bubble_fill  # NaN in tests
    super().__init__(**kwargs)
    paths = list(self.stack.stacked_variables)
    self.stack.tag_slots({p: (self.optimizer.m[p], self.optimizer.v[p]) for p in paths
                          if p in self.optimizer.m})
    axes = mesh_lib.mesh_axes(self.mesh)
    batch_axis = self.config.batch_axis if self.config.batch_axis in axes else UNSHARDED
    self.micro_layout = dtensor.Layout([UNSHARDED, batch_axis, UNSHARDED], self.mesh)

  def build_model(self, params: Params, rules: LayoutRules | None):
    config = self.config
    plan = plan_pipeline(self.pipeline_config, params=params,
                         mesh_axes=mesh_lib.mesh_axes(self.mesh),
                         batch_size=config.batch_size, seq_len=self.task.seq_len,
                         batch_axis=config.batch_axis)
    self.pipeline_plan = plan
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
  def pack(self, tokens: np.ndarray):
    """A host batch [B, T+1] as [M, B/M, T+1], micro-batches split over the batch axis."""
    num_micro = self.pipeline_plan.num_micro_batches
    micro = tokens.reshape((num_micro, tokens.shape[0] // num_micro) + tokens.shape[1:])
    return mesh_lib.pack_global_array(micro, self.micro_layout)

  def loss(self, tokens: tf.Tensor) -> tf.Tensor:
    """Mean cross entropy over micro-batches (= the batch's, all being equal)."""
    plan = self.pipeline_plan
    num_micro = plan.num_micro_batches
    from layout_core import layers as layers_lib  # pylint: disable=g-import-not-at-top
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
    return tf.add_n(shares)

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

  def write_layouts(self) -> str:
    table = super().write_layouts()
    plan = self.pipeline_plan
    self.writer.text(step=0, tag='pipeline/stages', markdown=self.describe_stages())
    self.writer.scalars(step=0, values={
        'pipeline/bubble_fraction': plan.bubble_fraction(),
        'pipeline/num_stages': plan.num_stages,
        'pipeline/num_micro_batches': plan.num_micro_batches,
        'pipeline/circular_repeats': plan.circular_repeats,
        'pipeline/partition_balance': 1.0})
    return table


def make_pipeline_trainer(*, pipeline: PipelineConfig, **kwargs) -> Trainer:
  """The trainer for `pipeline.engine`."""
  if pipeline.engine == 'spmd':
    return SpmdPipelineTrainer(pipeline=pipeline, **kwargs)
  return PipelineTrainer(pipeline=pipeline, **kwargs)
