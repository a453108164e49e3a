"""Planning a pipelined run: engine, stages, micro-batches (TensorFlow-free).

    plan = plan_pipeline(config, params=lm, mesh_axes={'stage': 2, 'data': 4},
                         batch_size=32, seq_len=64, batch_axis='data')
    plan.partition.describe()        # which layers on which stage
    plan_layout_records(plan, ...)   # the inspect report's layout table

Everything here runs at config time (`launch.inspect`, the typed run plan)
and allocates nothing; the engines (`submesh`, `spmd`) and trainers build on it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from layout_core.layout import scope as layout_scope_lib
from layout_core.tasks.lm import LMTask
from layout_core.errors import ConfigError
from layout_core.model.base import Sequential, leaf_layers
from layout_core.model.layers import Softmax
from layout_core.params import Params, once_per_frozen
from layout_core.pipeline import partitioning as partition_lib
from layout_core.pipeline import schedule as schedule_lib
from layout_core.pipeline.config import PipelineConfig
from layout_core.layout.rules import LayoutRules


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


# -- which cells, where ---------------------------------------------------------
def check_identical_cells(cells: Sequence[Params], *, where: str) -> None:
  """A ConfigError unless every cell has the same params apart from its name."""
  def text(p: Params) -> str:  # a plan's cells: compared once
    return once_per_frozen(_CELL_TEXTS, p, id(p),
                           lambda: p.Copy().Set(name='cell').ToText())
  first = text(cells[0])
  for cell in cells[1:]:
    if text(cell) != first:
      raise ConfigError(
          f"pipeline.engine='spmd' stacks identical cells, but {cell.name} differs from "
          f'{cells[0].name} ({cell.cls.__name__} params other than the name)',
          where=where,
          fix="use identical cells (transformer_lm without `cells`), or "
              "pipeline.engine = 'submesh' for heterogeneous stages")


_CELL_TEXTS: dict = {}  # once_per_frozen: a cell's text without its name


def check_cell_count(num_cells: int, num_stages: int, repeats: int) -> int:
  """Cells per chunk c = L / (S * R); a ConfigError when it does not divide."""
  if num_cells % (num_stages * repeats):
    raise ConfigError(
        f'{num_cells} cells do not split into {num_stages} stages x {repeats} circular '
        f'repeat(s) (needs a multiple of {num_stages * repeats})',
        where='pipeline.num_stages / pipeline.circular_repeats / transformer_lm.num_layers',
        fix=f'use a number of layers that is a multiple of {num_stages * repeats}, or '
            'change the stage axis or circular_repeats')
  return num_cells // (num_stages * repeats)


@dataclasses.dataclass(frozen=True)
class CellSlot:
  stage: int  # s: which stage holds the cell
  row: int    # q: its row in the stage's [Q] cells (repeat * c + position in chunk)


def cell_slot(layer: int, *, num_stages: int, cells_per_chunk: int) -> CellSlot:
  chunk, position = divmod(layer, cells_per_chunk)
  repeat, stage = divmod(chunk, num_stages)
  return CellSlot(stage=stage, row=repeat * cells_per_chunk + position)


def check_stackable(cell: Params) -> None:
  """The SPMD engine runs a cell through its layers' `apply` (one body of math
  for a layer and for stacked cells); a ConfigError if some layer has none."""
  if not cell.cls.stackable(cell):
    raise ConfigError(
        f"pipeline.engine='spmd' cannot stack {cell.cls.__name__} ({cell.name}): it or "
        'one of its sub-layers has no `apply` (the math written once for plain and '
        'stacked runs)', where='pipeline.engine',
        fix='give the layer an `apply` classmethod (see layout_core.model.base), stack '
            "library cells (TransformerBlock, FeedForward, LayerNorm, MultiHeadAttention, "
            "Dropout), or use pipeline.engine = 'submesh'")


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
  stages = partition_lib.layer_stages([p for p, _ in leaves], partition)
  _check_ties_in_one_stage(leaves, stages)
  return PipelinePlan(engine='submesh', partition=partition, layer_stages=stages,
                      num_micro_batches=num_micro, micro_batch_size=micro_size)


def _check_ties_in_one_stage(leaves, stages: Mapping[str, int]) -> None:
  """ConfigError for a layer reading a variable of a layer on another stage
  (a tied softmax): the sub-mesh engine gives each stage its own devices."""
  for path, p in leaves:
    table = p.cls.tied_path(p, path) if p.cls is Softmax else None
    owner = table.rsplit('/', 1)[0] if table else None
    if owner in stages and stages[owner] != stages[path]:
      raise ConfigError(
          f'{path} reads {p.tied_to} (tied embeddings), which the sub-mesh engine places on '
          f'stage {stages[owner]} of its devices, and {path} on stage {stages[path]}',
          where='transformer_lm.tie_embeddings / pipeline.engine',
          fix="use pipeline.engine = 'spmd' (one mesh for every stage), or untie "
              '(transformer_lm.tie_embeddings = False)')


def _plan_spmd(config: PipelineConfig, *, params: Params, num_micro: int, micro_size: int,
               seq_len: int) -> PipelinePlan:
  index = find_cell_stack(params)
  children = list(Sequential.child_params(params).values())
  stack = children[index]
  cells = list(Sequential.child_params(stack).values())
  where = f'{params.name}/{stack.name}'
  check_identical_cells(cells, where=where)
  check_stackable(cells[0])
  num_stages, repeats = config.num_stages, config.circular_repeats
  per_chunk = check_cell_count(len(cells), num_stages, repeats)
  schedule_lib.clock_order(num_stages, num_micro, repeats=repeats)  # M >= S with R > 1
  shapes = [(micro_size, seq_len)]
  for child in children[:index]:
    shapes = child.cls.fprop_meta(child, *shapes).out_shapes
  cost = cells[0].cls.fprop_meta(cells[0], *shapes).flops
  slots = [cell_slot(l, num_stages=num_stages, cells_per_chunk=per_chunk)
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
                        mesh_axes: Mapping[str, int], stage_axis: str,
                        fsdp_axis: str | None = None) -> list[layout_scope_lib.LayoutRecord]:
  """The inspect report's layout records of a pipelined run (nothing allocated):
  sub-mesh engine: every variable on its stage's sub-mesh; SPMD engine: the
  cells' variables per cell with the stage axis added, the rest on the whole
  mesh; all stored split over `fsdp_axis` too, if given."""
  specs = params.cls.variable_specs(params)
  if plan.engine == 'submesh':
    axes = {a: n for a, n in mesh_axes.items() if a != stage_axis}
    records = layout_scope_lib.plan_layouts(specs, rules, axes, fsdp_axis=fsdp_axis)
    return [dataclasses.replace(
        r, mesh=f'{stage_axis}{partition_lib.stage_of(plan.layer_stages, r.path)}')
        for r in records]
  axes = {a: n for a, n in mesh_axes.items() if a != stage_axis}
  records = layout_scope_lib.plan_layouts(specs, rules, axes, fsdp_axis=fsdp_axis)
  out = []
  for r in records:
    if any(r.path.startswith(cell + '/') for cell in plan.layer_stages):
      # Stacked: each device holds 1/S of the cells (per cell, on average).
      out.append(dataclasses.replace(
          r, spec=(stage_axis,) + r.spec, source=f'{r.source} (+ stacked on {stage_axis})',
          bytes_per_device=r.bytes_per_device // plan.num_stages,
          use_spec=None if r.use_spec is None else (stage_axis,) + r.use_spec))
    else:
      out.append(r)
  return out
