"""GPipe pipeline parallelism: cost-balanced stages, micro-batches, sub-meshes.

    layers = flatten_layers(lm_params)                     # emb, block_000.., softmax
    plan = partition(layers, num_stages=2, input_shapes=[(8, 64)], method='balanced')
    pipe = Pipeline(plan, num_micro_batches=4, placement=SubMeshPlacement(...))
    logits = pipe(ids)                                      # same values as running
                                                            # the layers in order

Schedule (GPipe forward; the backward pass is the tape's reverse of it, so
gradients accumulate over micro-batches by construction):

    buffer[k] = <empty> for every stage k             # poisoned with NaN in tests
    for clock t in 0 .. M + K - 2:
      for stage k with micro-batch m = t - k in [0, M):
        x = micro_batch[m] if k == 0 else buffer[k]
        y = stage_k(x)                                # on stage k's devices
        if k == K - 1: output[m] = y
        else:          next_buffer[k + 1] = cross(y, k -> k + 1)
      buffer = next_buffer

Everything is unrolled in one tf.function, so stage k working on micro-batch
m and stage k+1 on m-1 are independent ops the executor runs at the same time
(each stage on its own devices / inter-op thread). Bubble fraction in theory:
(K - 1) / (M + K - 1).

Partitioning (`partition`): 'balanced' finds the contiguous split minimising
the most expensive stage (exact, dynamic programming); 'lingvo' reproduces
Lingvo's cumulative-histogram heuristic for comparison; or give explicit layer
counts per stage.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from layout_core import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.layers import BaseLayer, LayerMeta, Sequential
from layout_core.layout_scope import LayoutScope
from layout_core.params import Params
from layout_core.rules import UNSHARDED, LayoutRules

Shape = tuple[int, ...]


# -- partitioning ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StagePlan:
  layers: tuple[Params, ...]
  cost: int

  @property
  def names(self) -> list[str]:
    return [p.name for p in self.layers]


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
  stages: tuple[StagePlan, ...]
  method: str

  @property
  def total_cost(self) -> int:
    return sum(s.cost for s in self.stages)

  @property
  def balance(self) -> float:
    """max stage cost / (total / K): 1.0 is perfect."""
    return max(s.cost for s in self.stages) * len(self.stages) / max(self.total_cost, 1)

  def shares(self) -> list[float]:
    return [s.cost / max(self.total_cost, 1) for s in self.stages]

  def describe(self) -> str:
    lines = [f'{len(self.stages)} stages ({self.method}, max/mean cost {self.balance:.3f}):']
    for k, (stage, share) in enumerate(zip(self.stages, self.shares())):
      lines.append(f'  stage {k}: {share:6.1%} of FLOPs, {len(stage.layers)} layers '
                   f'[{", ".join(stage.names)}]')
    return '\n'.join(lines)


def layer_costs(layers: Sequence[Params], input_shapes: Sequence[Shape]) -> list[int]:
  """Forward FLOPs of each layer for the real input shapes, threading shapes."""
  costs, shapes = [], tuple(tuple(s) for s in input_shapes)
  for p in layers:
    meta: LayerMeta = p.cls.fprop_meta(p, *shapes)
    costs.append(meta.flops)
    shapes = meta.out_shapes
  return costs


def balanced_counts(costs: Sequence[int], num_stages: int) -> list[int]:
  """Contiguous split into `num_stages` non-empty parts minimising the max part."""
  n = len(costs)
  prefix = [0]
  for c in costs:
    prefix.append(prefix[-1] + c)
  inf = float('inf')
  # best[k][i]: minimal max cost splitting the first i layers into k parts.
  best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
  cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
  best[0][0] = 0
  for k in range(1, num_stages + 1):
    for i in range(k, n - (num_stages - k) + 1):
      for j in range(k - 1, i):
        value = max(best[k - 1][j], prefix[i] - prefix[j])
        if value < best[k][i]:
          best[k][i], cut[k][i] = value, j
  counts, i = [], n
  for k in range(num_stages, 0, -1):
    j = cut[k][i]
    counts.append(i - j)
    i = j
  return counts[::-1]


def lingvo_counts(costs: Sequence[int], num_stages: int) -> list[int]:
  """Lingvo's PartitionSequentialLayers rule: layer i goes to stage
  min(int(cumulative_share_i * K), K - 1); stages may come out empty."""
  total = sum(costs) or 1
  counts, running = [0] * num_stages, 0
  for c in costs:
    running += c
    counts[min(int(running / total * num_stages), num_stages - 1)] += 1
  return counts


def partition(layers: Sequence[Params], *, num_stages: int,
              input_shapes: Sequence[Shape],
              method: str | Sequence[int] = 'balanced') -> PartitionPlan:
  if num_stages < 1:
    raise ConfigError(f'pipeline.num_stages is {num_stages}', fix='use at least 1')
  if num_stages > len(layers):
    raise ConfigError(
        f'pipeline.num_stages={num_stages} is more than the {len(layers)} layers '
        f'to split ({", ".join(p.name for p in layers)})',
        where='pipeline.num_stages', fix=f'use at most {len(layers)} stages')
  costs = layer_costs(layers, input_shapes)
  if isinstance(method, str):
    if method == 'balanced':
      counts = balanced_counts(costs, num_stages)
    elif method == 'lingvo':
      counts = lingvo_counts(costs, num_stages)
    else:
      raise ConfigError(f'pipeline.partition is {method!r}',
                        fix="use 'balanced', 'lingvo' or a list of layer counts per stage")
    name = method
  else:
    counts, name = list(method), f'explicit {list(method)}'
    if len(counts) != num_stages or sum(counts) != len(layers) or min(counts) < 1:
      raise ConfigError(
          f'pipeline.partition {counts} must give {num_stages} positive layer counts '
          f'summing to {len(layers)}', where='pipeline.partition')
  stages, start = [], 0
  for count in counts:
    stages.append(StagePlan(layers=tuple(layers[start:start + count]),
                            cost=sum(costs[start:start + count])))
    start += count
  return PartitionPlan(stages=tuple(stages), method=name)


# -- stages --------------------------------------------------------------------------
class Stage(Sequential):
  """A stage (Lingvo's FeatureExtractionLayer): runs `sub` in order and can
  also return the outputs of named inner layers (`fetch`) after its own."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'stage'
    p.Define('fetch', [], 'Names of inner layers whose outputs are appended to the '
                          "stage's outputs.")
    return p

  @classmethod
  def fprop_meta(cls, p, *shapes):
    meta = super().fprop_meta(p, *shapes)
    fetched, current = [], shapes
    for child in cls.child_params(p).values():
      current = child.cls.fprop_meta(child, *current).out_shapes
      if child.name in p.fetch:
        fetched.append(current[0])
    return dataclasses.replace(meta, out_shapes=tuple(meta.out_shapes) + tuple(fetched))

  def fprop(self, *inputs):
    unknown = set(self.params.fetch) - set(self.child_names)
    if unknown:
      raise ConfigError(f'{self.path}: fetch names {sorted(unknown)} are not layers '
                        f'of this stage ({list(self.child_names)})')
    outputs, fetched = inputs, []
    for child in self.children():
      outputs = child(*outputs)
      if not isinstance(outputs, tuple):
        outputs = (outputs,)
      if child.params.name in self.params.fetch:
        fetched.append(outputs[0])
    outputs = tuple(outputs) + tuple(fetched)
    return outputs[0] if len(outputs) == 1 else outputs


def stage_params(plan: PartitionPlan, *, name_prefix: str = 'stage') -> list[Params]:
  return [Stage.Params().Set(name=f'{name_prefix}_{k}', sub=[p.Copy() for p in s.layers])
          for k, s in enumerate(plan.stages)]


# -- placement: where each stage lives and how activations move --------------------
class DevicePlacement:
  """Stage k on plain TF device `devices[k]` (no DTensor)."""

  def __init__(self, devices: Sequence[str]):
    self.devices = list(devices)

  def build(self, k: int, params: Params, parent_path: str) -> BaseLayer:
    with tf.device(self.devices[k]):
      return params.Instantiate(parent_path=parent_path)

  def run(self, k: int, fn: Callable, *args):
    with tf.device(self.devices[k]):
      return fn(*args)

  def cross(self, value: tf.Tensor, source: int, target: int) -> tf.Tensor:
    with tf.device(self.devices[target]):
      return tf.identity(value)


class SubMeshPlacement:
  """Stage k on sub-mesh k of a mesh cut along `stage_axis`; inside a stage the
  layout rules apply on that sub-mesh.

  Activations cross between stages replicated: relayout to replicated on the
  source mesh, copy to the target mesh, then shard the batch dim over
  `batch_axis` there. (Copying a *sharded* DTensor across meshes silently
  gives wrong values in TF 2.21; see shared/DTENSOR_NOTES.md.)
  """

  def __init__(self, *, mesh: dtensor.Mesh, stage_axis: str = 'stage',
               rules: LayoutRules | None = None, batch_axis: str = 'data',
               seed: int = 0):
    self.meshes = mesh_lib.sub_meshes(mesh, stage_axis)
    self.rules = rules or LayoutRules()
    self.batch_axis = batch_axis
    self.seed = seed
    self.scopes: list[LayoutScope] = []
    self.batch_dim = 0  # set by Pipeline

  def build(self, k: int, params: Params, parent_path: str) -> BaseLayer:
    with LayoutScope(mesh=self.meshes[k], rules=self.rules, seed=self.seed) as scope:
      layer = params.Instantiate(parent_path=parent_path)
    self.scopes.append(scope)
    return layer

  def run(self, k: int, fn: Callable, *args):
    return fn(*args)

  def batch_layout(self, k: int, rank: int, batch_dim: int = 0) -> dtensor.Layout:
    axes = mesh_lib.mesh_axes(self.meshes[k])
    spec = [UNSHARDED] * rank
    if self.batch_axis in axes:
      spec[batch_dim] = self.batch_axis
    return dtensor.Layout(spec, self.meshes[k])

  def cross(self, value: tf.Tensor, source: int, target: int) -> tf.Tensor:
    rank = value.shape.rank
    replicated = dtensor.relayout(value, dtensor.Layout.replicated(self.meshes[source], rank))
    moved = dtensor.copy_to_mesh(replicated,
                                 dtensor.Layout.replicated(self.meshes[target], rank))
    return dtensor.relayout(moved, self.batch_layout(target, rank, self.batch_dim))


# -- the pipeline ---------------------------------------------------------------------
class Pipeline(tf.Module):
  """Runs partitioned stages over micro-batches on the GPipe schedule."""

  def __init__(self, plan: PartitionPlan, *, placement, num_micro_batches: int = 1,
               batch_dim: int = 0, name: str = 'lm', bubble_fill: float | None = None):
    super().__init__(name=name)
    if num_micro_batches < 1:
      raise ConfigError(f'pipeline.num_micro_batches is {num_micro_batches}',
                        fix='use at least 1')
    self.plan = plan
    self.placement = placement
    self.num_micro_batches = num_micro_batches
    self.batch_dim = batch_dim
    self.bubble_fill = bubble_fill  # NaN in tests: a schedule bug then shows
    if hasattr(placement, 'batch_dim'):
      placement.batch_dim = batch_dim
    self.stages = [placement.build(k, p, parent_path=name)
                   for k, p in enumerate(stage_params(plan))]
    logging.info('Pipeline: %s', plan.describe())

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def bubble_fraction(self) -> float:
    k, m = self.num_stages, self.num_micro_batches
    return (k - 1) / (m + k - 1)

  def split(self, x: tf.Tensor) -> list[tf.Tensor]:
    size = x.shape[self.batch_dim]
    if size % self.num_micro_batches:
      raise ConfigError(
          f'pipeline.num_micro_batches={self.num_micro_batches} does not divide the '
          f'batch of {size} (dim {self.batch_dim} of shape {x.shape.as_list()})',
          where='pipeline.num_micro_batches',
          fix=f'use a divisor of {size}, or change train.batch_size')
    if self.num_micro_batches == 1:
      return [x]
    if isinstance(self.placement, SubMeshPlacement):
      # DTensor cannot tf.split a sharded dim (nor give Split outputs a sharded
      # layout); a gather of each micro-batch's indices works, for any batch_dim.
      step = size // self.num_micro_batches
      layout = self.placement.batch_layout(0, x.shape.rank, self.batch_dim)
      return [dtensor.relayout(tf.gather(x, tf.range(m * step, (m + 1) * step),
                                         axis=self.batch_dim), layout)
              for m in range(self.num_micro_batches)]
    return tf.split(x, self.num_micro_batches, axis=self.batch_dim)

  def __call__(self, x: tf.Tensor) -> tf.Tensor:
    micro = self.split(x)
    num_stages, placement = self.num_stages, self.placement
    buffers: list = [None] * num_stages
    outputs: list = [None] * self.num_micro_batches
    for clock in range(self.num_micro_batches + num_stages - 1):
      if self.bubble_fill is not None and clock == 0:
        buffers = [None] + [self._fill(k, micro[0].shape.as_list())
                            for k in range(1, num_stages)]
      next_buffers = list(buffers)
      for k in range(num_stages):
        m = clock - k
        if not 0 <= m < self.num_micro_batches:
          continue
        inputs = micro[m] if k == 0 else buffers[k]
        y = placement.run(k, self.stages[k], inputs)
        if k == num_stages - 1:
          outputs[m] = y
        else:
          next_buffers[k + 1] = placement.cross(y, k, k + 1)
      buffers = next_buffers
    if len(outputs) == 1:
      return outputs[0]
    return tf.concat(outputs, axis=self.batch_dim)

  def _fill(self, k: int, micro_shape: list[int]) -> tf.Tensor:
    """`bubble_fill` shaped like stage k's input: what an idle slot would hold."""
    shapes = (tuple(micro_shape),)
    for stage in self.plan.stages[:k]:
      for p in stage.layers:
        shapes = p.cls.fprop_meta(p, *shapes).out_shapes
    value = tf.fill(shapes[0], tf.constant(self.bubble_fill, tf.float32))
    if isinstance(self.placement, SubMeshPlacement):
      mesh = self.placement.meshes[k]
      value = dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, len(shapes[0])))
      return dtensor.relayout(value, self.placement.batch_layout(k, len(shapes[0]),
                                                                 self.batch_dim))
    return self.placement.run(k, tf.identity, value)
