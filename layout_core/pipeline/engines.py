"""The pipeline step engines: GPipe on sub-meshes, and the SPMD stage axis.

    plan = plan_pipeline(PipelineConfig(num_stages=2, num_micro_batches=4), params=lm,
                         mesh_axes={'stage': 2, 'data': 2, 'model': 2}, batch_size=32,
                         seq_len=64, batch_axis='data')
    engine = GPipeEngine(params=lm, plan=plan, stage_axis='stage', mesh=mesh, rules=rules,
                         task=task, optimizer=OptimizerConfig(), config=config,
                         counters=Counters(mesh), batch_axis='data')

Both are `layout_core.train.engine.StepEngine`s, driven by the one training
loop, and take the plan made at config time (nothing is planned twice):

* `GPipeEngine` (engine 'submesh'): the usual Params tree, each leaf layer's
  variables on the sub-mesh of its stage (the plan's partition); a step runs
  `submesh.GPipe`, and the optimizer updates each stage on its own mesh with
  the global gradient norm (summed on the host: one function doing it would
  cross meshes both ways).
* `spmd_engine` (engine 'spmd'): a `SingleProgramEngine` running `SpmdProgram`:
  the layers before the stack of identical cells (embedding) and after it
  (final norm, softmax) run on the whole mesh; the cells are stacked on the
  stage axis (`spmd.StackedCells`) and run by `spmd.SpmdPipeline`; forward
  and backward are one compiled function over the whole mesh, the update
  another, as for any `SingleProgramEngine`.

Both add their micro-batches' loss and metric sums (the trained tokens'
losses and their count: `layout_core.tasks.objective`) and divide once, so
the batch's loss is the unpipelined run's however many micro-batches hold
how many trained tokens; they accumulate gradients with
`micro_steps.MicroSteps` like every engine, and keep the plain
run's checkpoint keys, so a checkpoint moves between the engines and
unpipelined runs. `batch_axis` is the resolved batch axis
(`layout_core.train.config.batch_axis_for`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from absl import logging

from layout_core.lazy import Module, dtensor, tf
from layout_core.layout import mesh as mesh_lib
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.layout.scope import LayoutRecord, LayoutScope
from layout_core.layout.variables import to_numpy
from layout_core.model import moe
from layout_core.model.base import BaseLayer, Sequential, as_float32
from layout_core.model.built import BuiltModel, StepFunction
from layout_core.model.random import current_random, random_context, step_seed
from layout_core.step_context import current, entered
from layout_core.params import Params
from layout_core.pipeline import spmd as spmd_lib
from layout_core.pipeline.plan import PipelinePlan
from layout_core.pipeline.stages import build_staged_model
from layout_core.pipeline.submesh import GPipe
from layout_core.tasks import Task
from layout_core.train.config import TrainConfig
from layout_core.train.engine import Counters, SingleProgramEngine, join_rows
from layout_core.tasks.objective import add_parts
from layout_core.train.micro_steps import MicroSteps, client_rows, split_rows
from layout_core.optim import OptimizerConfig, make_optimizer, squared_norm


def plan_summaries(plan: PipelinePlan, stages_markdown: str):
  """The `pipeline/*` TensorBoard records both engines write."""
  values = {'pipeline/bubble_fraction': plan.bubble_fraction(),
            'pipeline/num_stages': plan.num_stages,
            'pipeline/num_micro_batches': plan.num_micro_batches,
            'pipeline/partition_balance': plan.partition.balance}
  if plan.engine == 'spmd':
    values['pipeline/circular_repeats'] = plan.circular_repeats
  return {'pipeline/stages': stages_markdown}, values


class GPipeEngine:
  """GPipe over stages on sub-meshes (module doc)."""

  def __init__(self, *, params: Params, plan: PipelinePlan, stage_axis: str, mesh,
               rules: LayoutRules | None, task: Task, optimizer: OptimizerConfig,
               config: TrainConfig, counters: Counters, batch_axis: str,
               fsdp_axis: str | None = None):
    self.plan, self.mesh, self.task, self.config = plan, mesh, task, config
    self.counters = counters
    self.micro_steps = MicroSteps(count=config.grad_accum_steps, batch_size=config.batch_size)
    params = params.Copy().Freeze()
    staged = build_staged_model(
        params, mesh=mesh, rules=rules, num_stages=plan.num_stages,
        input_shapes=[(plan.micro_batch_size, task.seq_len)], stage_axis=stage_axis,
        batch_axis=batch_axis, seed=config.seed, partition=plan.partition, fsdp_axis=fsdp_axis)
    self.placement = staged.placement
    self.gpipe = GPipe(stages=staged.runners, placement=self.placement,
                       loss_fn=lambda outputs, batch: task.loss_and_metrics(as_float32(outputs),
                                                                            batch),
                       num_micro_batches=plan.num_micro_batches,
                       reference_fn=lambda outputs, batch: task.reference_features(
                           as_float32(outputs), batch),
                       reference_in_step=task.needs_reference,
                       routed_layers=len(moe.routed_layers(params)))
    self.variables, self.layout_records = staged.scope.variables, staged.scope.records
    moe.check_submesh_layouts(self.layout_records, batch_axis=batch_axis)
    self.model_state, self.description = staged.model, params.ToText()
    trainable = {p: v for p, v in self.variables.items() if v.trainable}
    self.optimizer = make_optimizer(optimizer, variables=list(trainable.values()),
                                    paths=list(trainable), total_steps=config.num_steps,
                                    mesh_axes=mesh_lib.mesh_axes(mesh),
                                    batch_axis=batch_axis, fsdp_axis=fsdp_axis)
    path_of = {id(v): p for p, v in self.variables.items()}
    self._stage_paths = [[path_of[id(v)] for v in variables]
                         for variables in self.gpipe.variables]
    self._apply = StepFunction(self._apply_fn)
    self._packed_rows: dict[int, list] = {}  # `_first_rows`
    logging.info('Pipeline: %d micro-batches of %d, bubble fraction %.3f\n%s',
                 plan.num_micro_batches, plan.micro_batch_size,
                 self.gpipe.bubble_fraction(), self.describe_stages())

  def pack(self, batch):
    """Micro-batches of the model's inputs on stage 0's mesh, and of the whole
    batch (what the task's loss reads) on the last stage's; with
    `grad_accum_steps` k, a list of k such packs of batch_size / k rows."""
    return self.micro_steps.pack(batch, self._pack)

  def client_rows(self, batch_size: int) -> np.ndarray | None:
    """The rows this client's devices hold on the first stage (model inputs)
    or the last (what the loss reads); None: every row (one client)."""
    parts = self.micro_steps.count * self.plan.num_micro_batches
    held = [client_rows(self.placement.meshes[k], batch_axis=self.placement.batch_axis,
                        batch_size=batch_size, parts=parts)
            for k in {0, self.plan.num_stages - 1}]
    if any(rows is None for rows in held):
      return None
    return np.unique(np.concatenate(held))

  def _pack(self, batch):
    last = self.plan.num_stages - 1
    inputs, features = [], []
    for micro in split_rows(batch, self.plan.num_micro_batches):
      model_inputs = tuple(self.placement.put(0, x, batch_dim=0)
                           for x in self.task.model_inputs(micro))
      inputs.append(model_inputs[0] if len(model_inputs) == 1 else model_inputs)
      features.append({name: self.placement.put(last, value, batch_dim=0)
                       for name, value in micro.items()})
    return inputs, features

  def _first_rows(self, first_row: int) -> list:
    """A micro-step's first row on each stage's mesh, packed once per run: as
    a Python int, each micro-step would trace and compile both step
    functions again."""
    if first_row not in self._packed_rows:
      self._packed_rows[first_row] = [self.placement.put_changing(k, np.int64(first_row))
                                      for k in range(self.plan.num_stages)]
    return self._packed_rows[first_row]

  def _step_seeds(self):
    seed = np.int64(step_seed(self.config.seed, self.counters.current_step))
    return [self.placement.put_changing(k, seed) for k in range(self.plan.num_stages)]

  def loss_and_gradients(self, packed):
    """(loss, metrics, (per-stage gradients, per-stage squared norms)). Each
    micro-step is a whole pipelined pass; with several, their per-stage
    gradients of the loss's totals are summed on each stage's mesh and
    divided once by the batch's count."""
    seeds = self._step_seeds()
    squared_norms = []  # each pass's own, computed inside its backward function
    divide = self.micro_steps.count == 1  # one pass divides by its own count

    def micro_step(part, first_row):
      sums, grads, norms = self.gpipe.loss_metrics_and_gradients(
          *part, seeds=seeds, first_row=self._first_rows(first_row), divide=divide)
      squared_norms.append(norms)
      return sums, grads
    loss, metrics, grads = self.micro_steps.gradients(
        packed, micro_step, divide=self.gpipe.divide)
    if len(squared_norms) > 1:  # accumulated: the norms of the summed gradients
      squared_norms = [[squared_norm(stage) if stage else None for stage in grads]]
    return loss, metrics, (grads, squared_norms[0])

  def _apply_fn(self, grads, steps, norms):
    """Every stage's update, each on its own mesh (no crossing), then the
    counters. `steps`, `norms`: per stage, `put_changing` vectors."""
    rates = [self.optimizer.update(paths, stage_grads, step=step[0], norm=norm[0])
             for paths, stage_grads, step, norm in zip(self._stage_paths, grads, steps, norms)
             if paths]
    self.counters.advance()
    return rates[0]

  def apply_gradients(self, gradients):
    grads, squared_norms = gradients
    step = self.counters.current_step
    # The clipping norm spans all stages: summed on the host, then given to each stage's mesh.
    norm = math.sqrt(sum(float(to_numpy(s)) for s in squared_norms if s is not None))
    put = self.placement.put_changing
    rate = self._apply(grads, [put(k, np.int64(step)) for k in range(len(grads))],
                       [put(k, np.float32(norm)) for k in range(len(grads))])
    return rate, tf.constant(norm)

  def evaluate(self, packed):
    return self.micro_steps.evaluate(packed, lambda part: self.gpipe.loss_and_metrics(*part))

  def reference_features(self, batch):
    """As `SingleProgramEngine.reference_features`: the micro-batches' on the
    last stage's mesh, joined on the host."""
    inputs, features = self._pack(batch)
    return join_rows(self.gpipe.reference(inputs, features, adapters=True))

  def describe_stages(self) -> str:
    """Markdown table: per stage its sub-mesh, FLOPs share and layers."""
    partition = self.plan.partition
    lines = ['| stage | sub-mesh | devices | FLOPs share | layers |', '|---|---|---|---|---|']
    for k, (stage, share) in enumerate(zip(partition.stages, partition.shares())):
      mesh = self.placement.meshes[k]
      shape = ' x '.join(f'{a}={n}' for a, n in mesh_lib.mesh_axes(mesh).items())
      devices = mesh_lib.describe_devices(mesh)
      lines.append(f'| {k} | {shape} | {devices} | {share:.1%} | '
                   f'{", ".join(stage.names)} |')
    lines.append('')
    lines.append(f'{partition.method} partition, max/mean stage cost '
                 f'{partition.balance:.3f}; {self.gpipe.num_micro_batches} micro-batches; '
                 f'bubble fraction (K-1)/(M+K-1) = {self.gpipe.bubble_fraction():.3f}')
    return '\n'.join(lines) + '\n'

  def summaries(self):
    return plan_summaries(self.plan, self.describe_stages())


class SpmdModel(Module):
  """The model for the SPMD engine: the root's children under their own names
  (so checkpoint keys match the plain model), the stack as `StackedCells`."""

  def __init__(self, name: str, children: Sequence[tuple[str, tf.Module]]):
    super().__init__(name=name)
    self.child_names = tuple(n for n, _ in children)
    for child_name, module in children:
      setattr(self, child_name, module)


def build_spmd_model(params: Params, *, plan: PipelinePlan, stage_axis: str, mesh,
                     rules: LayoutRules | None, config: TrainConfig, batch_axis: str,
                     fsdp_axis: str | None = None):
  """The root's children built on the whole mesh, except the cell stack, built
  as `StackedCells` (all stored split over `fsdp_axis` too, if given);
  returns (BuiltModel, stack, layers before, layers after)."""
  children = list(Sequential.child_params(params).items())
  records: list[LayoutRecord] = []
  variables: dict[str, tf.Variable] = {}
  built = []
  with LayoutScope(mesh=mesh, rules=rules, seed=config.seed, fsdp_axis=fsdp_axis) as plain:
    for i, (name, child) in enumerate(children):
      if i == plan.stack_index:
        stack = spmd_lib.StackedCells(
            list(Sequential.child_params(child).values()), parent_path=params.name,
            mesh=mesh, rules=rules, num_stages=plan.num_stages,
            repeats=plan.circular_repeats, stage_axis=stage_axis,
            batch_axis=batch_axis, seed=config.seed, name=name, fsdp_axis=fsdp_axis)
        built.append((name, stack))
        records += stack.records
        variables.update(stack.stacked_variables)
      else:
        built.append((name, child.Instantiate(parent_path=params.name)))
        new = [p for p in plain.variables if p not in variables]
        records += [r for r in plain.records if r.path in new]
        variables.update({p: plain.variables[p] for p in new})
  model = SpmdModel(params.name, built)
  for _, layer in built:
    if isinstance(layer, BaseLayer):  # the stack is not: no cell reads a sibling
      layer.link_siblings(model)
  before = [m for _, m in built[:plan.stack_index]]
  after = [m for _, m in built[plan.stack_index + 1:]]
  return (BuiltModel(module=model, call=None, variables=variables, records=records,
                     checkpoint_root=model, description=params.ToText(),
                     lead_dims={path: 2 for path in stack.stacked_variables},
                     fsdp_axis=fsdp_axis),
          stack, before, after)


class SpmdProgram:
  """The program the SPMD engine runs (module doc): the layers before the cell
  stack, the stack pipelined on the stage axis, the layers after it, and the
  task's loss and metrics per micro-batch. `bubble_fill` (NaN in tests) is
  what idle pipeline slots hold."""

  def __init__(self, *, params: Params, plan: PipelinePlan, stage_axis: str, mesh,
               rules: LayoutRules | None, task: Task, config: TrainConfig, batch_axis: str,
               bubble_fill: float | None = None, fsdp_axis: str | None = None):
    self.plan, self.task, self.mesh = plan, task, mesh
    self.model, self.stack, self.before, self.after = build_spmd_model(
        params.Copy().Freeze(), plan=plan, stage_axis=stage_axis, mesh=mesh, rules=rules,
        config=config, batch_axis=batch_axis, fsdp_axis=fsdp_axis)
    self.pipeline = spmd_lib.SpmdPipeline(self.stack, num_micro_batches=plan.num_micro_batches,
                                          bubble_fill=bubble_fill)
    self.batch_axis = batch_axis
    self.rows_parts = plan.num_micro_batches  # pack cuts the batch into micro-batches
    logging.info('SPMD pipeline: %d stages x %d circular repeat(s), %d micro-batches of '
                 '%d, bubble fraction %.3f', plan.num_stages, plan.circular_repeats,
                 plan.num_micro_batches, plan.micro_batch_size, plan.bubble_fraction())

  def pack(self, batch):
    """Each feature [B, ...] as [M, B/M, ...], micro-batches split over the batch axis."""
    num_micro = self.plan.num_micro_batches
    packed = {}
    for name, value in batch.items():
      micro = value.reshape((num_micro, value.shape[0] // num_micro) + value.shape[1:])
      layout = dtensor.Layout([UNSHARDED, self.batch_axis] + [UNSHARDED] * (value.ndim - 1),
                              self.mesh)
      packed[name] = mesh_lib.pack_global_array(micro, layout)
    return packed

  def context(self, packed):
    """The context in force as it is: no packed documents (refused for
    pipelines), no residual pin or batch split outside the stack, which pins
    its own (`spmd.SpmdPipeline`)."""
    del packed
    return current()

  def loss_and_metrics(self, batch, training: bool = False):
    """The task's loss and metrics as the sums of all micro-batches."""
    del training  # dropout is on inside a random_context, as for every engine
    micro = self._micro_batches(batch)
    if self.task.needs_reference:  # first, so its activations are freed before the policy's
      micro = [{**features, **reference} for features, reference in
               zip(micro, self._reference(micro))]
    return add_parts([self.task.loss_and_metrics(y, features) for features, y in
                      zip(micro, self._outputs(micro, random=current_random()))])

  def reference_features(self, batch, adapters: bool = True) -> list[dict]:
    """The task's `reference_features` of each micro-batch, in row order."""
    return self._reference(self._micro_batches(batch), adapters=adapters)

  def _micro_batches(self, batch) -> list[dict]:
    # tf.gather, not x[m]: in TF 2.21 DTensor, indexing away dim 0 of a
    # tensor sharded on dim 1 returns wrong values with a shifted layout.
    return [{name: tf.gather(value, m) for name, value in batch.items()}
            for m in range(self.plan.num_micro_batches)]

  def _reference(self, micro, adapters: bool = False) -> list[dict]:
    """The reference model (adapters off, or on: `adapters`; no dropout, no
    gradient) on each micro-batch, as the task's `reference_features`."""
    with entered(current().replace(adapters=adapters, random=None)):
      outputs = self._outputs(micro, random=None)
    return [self.task.reference_features(tf.stop_gradient(y), features)
            for features, y in zip(micro, outputs)]

  def _outputs(self, micro, *, random) -> list:
    """The model's float32 outputs on each micro-batch, the stack pipelined;
    `random`: the step's dropout state (None: none)."""
    def run(modules, x, m):
      if random is None:
        for module in modules:
          x = module(x)
        return x
      with random_context(seed=random.seed,
                          batch_offset=random.batch_offset + m * self.plan.micro_batch_size):
        for module in modules:
          x = module(x)
      return x

    hidden = []
    for m, features in enumerate(micro):
      [inputs] = self.task.model_inputs(features)
      hidden.append(run(self.before, inputs, m))
    return [as_float32(run(self.after, y, m)) for m, y in enumerate(self.pipeline(hidden))]

  def describe_stages(self) -> str:
    plan = self.plan
    lines = ['| stage | cells (layer order) |', '|---|---|']
    for k, stage in enumerate(plan.partition.stages):
      lines.append(f'| {k} | {", ".join(stage.names)} |')
    lines.append('')
    lines.append(f'{plan.partition.method}; {plan.num_micro_batches} micro-batches; '
                 f'bubble fraction (S-1)/(R*M+S-1) = {plan.bubble_fraction():.3f}')
    return '\n'.join(lines) + '\n'

  def summaries(self):
    return plan_summaries(self.plan, self.describe_stages())


def spmd_engine(*, optimizer: OptimizerConfig, config: TrainConfig, counters: Counters,
                **program_kwargs) -> SingleProgramEngine:
  """The SPMD engine: `SpmdProgram` run by a `SingleProgramEngine` on the whole mesh, its
  stacked variables' optimizer slots checkpointed under per-cell keys too."""
  program = SpmdProgram(config=config, **program_kwargs)
  engine = SingleProgramEngine(program=program, mesh=program.mesh, optimizer=optimizer,
                               config=config, counters=counters)
  trained = set(engine.optimizer.paths)
  program.stack.tag_slots({p: engine.optimizer.slots_for(p)
                           for p in program.stack.stacked_variables if p in trained})
  return engine
