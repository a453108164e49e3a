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

import contextlib
import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np
from absl import logging

from layout_core.lazy import Module, tf, dtensor
from layout_core import mesh as mesh_lib
from layout_core.errors import ConfigError
from layout_core.fields import check_types
from layout_core.layers import BaseLayer, LayerMeta, Sequential, leaf_modules, random_context
from layout_core.layout_scope import LayoutRecord, LayoutScope
from layout_core.optimizer import squared_norm
from layout_core.params import Params
from layout_core.rules import UNSHARDED, LayoutRules
from layout_core.variables import VariableSpec, variable_creator

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
    return run_layers(self.children(), inputs, fetch=self.params.fetch)


def run_layers(layers: Sequence[BaseLayer], inputs: Sequence[tf.Tensor],
               fetch: Sequence[str] = ()):
  """Runs `layers` in order; returns the last outputs, then the first output of
  each layer named in `fetch` (a single tensor when that is all there is)."""
  outputs, fetched = tuple(inputs), []
  for layer in layers:
    outputs = layer(*outputs)
    if not isinstance(outputs, tuple):
      outputs = (outputs,)
    if layer.params.name in fetch:
      fetched.append(outputs[0])
  outputs = tuple(outputs) + tuple(fetched)
  return outputs[0] if len(outputs) == 1 else outputs


class StageRunner(Module):
  """A stage over layers that already exist (leaves of a built model), so the
  model keeps its own variable paths and checkpoint keys whatever the staging."""

  def __init__(self, layers: Sequence[BaseLayer], *, name: str):
    super().__init__(name=name)
    self.layers = list(layers)

  def __call__(self, *inputs):
    return run_layers(self.layers, inputs)


def stage_params(plan: PartitionPlan, *, name_prefix: str = 'stage') -> list[Params]:
  return [Stage.Params().Set(name=f'{name_prefix}_{k}', sub=[p.Copy() for p in s.layers])
          for k, s in enumerate(plan.stages)]


def bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
  """Idle share of the GPipe schedule in theory: (K - 1) / (M + K - 1)."""
  return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def layer_stages(leaf_paths: Sequence[str], plan: PartitionPlan) -> dict[str, int]:
  """Leaf layer path -> the stage `plan` gives it (leaves in execution order)."""
  owners = [k for k, stage in enumerate(plan.stages) for _ in stage.layers]
  return dict(zip(leaf_paths, owners))


def stage_of(stages_by_layer: Mapping[str, int], variable_path: str) -> int:
  """The stage of the layer that owns `variable_path`."""
  for layer_path, k in stages_by_layer.items():
    if variable_path.startswith(layer_path + '/'):
      return k
  raise ConfigError(f"variable '{variable_path}' belongs to no pipeline stage's layer",
                    fix='create variables only inside the layers of the stack')


def stage_runners(model: BaseLayer, plan: PartitionPlan) -> list['StageRunner']:
  """The built model's leaf layers grouped into `plan`'s stages."""
  modules, runners, first = leaf_modules(model), [], 0
  for k, stage in enumerate(plan.stages):
    runners.append(StageRunner(modules[first:first + len(stage.layers)], name=f'stage_{k}'))
    first += len(stage.layers)
  return runners


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

  def put(self, k: int, value, batch_dim: int | None = None) -> tf.Tensor:
    """A host value (array or scalar) on stage k's device."""
    del batch_dim
    with tf.device(self.devices[k]):
      return tf.identity(tf.convert_to_tensor(value))


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
    # Without a stage axis there is one stage (micro-batching only).
    self.meshes = (mesh_lib.sub_meshes(mesh, stage_axis)
                   if stage_axis in mesh_lib.mesh_axes(mesh) else [mesh])
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

  def put(self, k: int, value, batch_dim: int | None = None) -> tf.Tensor:
    """A host value on sub-mesh k: split over `batch_axis` along `batch_dim`,
    or replicated when batch_dim is None (scalars). Each device gets its slice."""
    value = np.asarray(value)
    layout = (dtensor.Layout.replicated(self.meshes[k], value.ndim) if batch_dim is None
              else self.batch_layout(k, value.ndim, batch_dim))
    return mesh_lib.pack_global_array(value, layout)

  def cross(self, value: tf.Tensor, source: int, target: int) -> tf.Tensor:
    rank = value.shape.rank
    replicated = dtensor.relayout(value, dtensor.Layout.replicated(self.meshes[source], rank))
    moved = dtensor.copy_to_mesh(replicated,
                                 dtensor.Layout.replicated(self.meshes[target], rank))
    return dtensor.relayout(moved, self.batch_layout(target, rank, self.batch_dim))


# -- the pipeline ---------------------------------------------------------------------
class Pipeline(Module):
  """Runs partitioned stages over micro-batches on the GPipe schedule."""

  def __init__(self, plan: PartitionPlan, *, placement, num_micro_batches: int = 1,
               batch_dim: int = 0, name: str = 'lm', bubble_fill: float | None = None,
               stages: Sequence[Callable] | None = None):
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
    if stages is None:
      stages = [placement.build(k, p, parent_path=name)
                for k, p in enumerate(stage_params(plan))]
    self.stages = list(stages)
    logging.info('Pipeline: %s', plan.describe())

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def bubble_fraction(self) -> float:
    return bubble_fraction(self.num_stages, self.num_micro_batches)

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


# -- training: configuration, staged variables, the GPipe gradient engine ----------
@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """What `pipeline.*` in gin sets. num_stages=1 and one micro-batch: no pipeline."""
  num_stages: int = 1               # K, the size of mesh axis `stage_axis`
  num_micro_batches: int = 0        # M; 0: from micro_batch_size, else 1
  micro_batch_size: int = 0         # alternative to num_micro_batches
  batch_dim: int = 0                # batch dimension of the stage inputs
  partition: str | Sequence[int] = 'balanced'  # 'balanced' | 'lingvo' | layer counts
  stage_axis: str = 'stage'

  def __post_init__(self):
    check_types(self, name='pipeline')
    if self.num_stages < 1:
      raise ConfigError(f'pipeline.num_stages is {self.num_stages}', fix='use at least 1')
    if self.num_micro_batches < 0 or self.micro_batch_size < 0:
      raise ConfigError('pipeline.num_micro_batches and pipeline.micro_batch_size '
                        'must not be negative', fix='use 0 (unset) or a positive count')
    if self.batch_dim < 0:
      raise ConfigError(f'pipeline.batch_dim is {self.batch_dim}', fix='use 0 or 1')
    if not isinstance(self.partition, str):
      object.__setattr__(self, 'partition', tuple(self.partition))

  def micro_batches(self, batch_size: int) -> int:
    """M for a global batch of `batch_size`; a ConfigError when it does not divide."""
    if self.micro_batch_size:
      if batch_size % self.micro_batch_size:
        raise ConfigError(
            f'pipeline.micro_batch_size={self.micro_batch_size} does not divide the '
            f'batch of {batch_size}', where='pipeline.micro_batch_size',
            fix='use a divisor of train.batch_size')
      m = batch_size // self.micro_batch_size
      if self.num_micro_batches and self.num_micro_batches != m:
        raise ConfigError(
            f'pipeline.num_micro_batches={self.num_micro_batches} and '
            f'pipeline.micro_batch_size={self.micro_batch_size} disagree for a batch '
            f'of {batch_size}', fix='set only one of them')
      return m
    m = self.num_micro_batches or 1
    if batch_size % m:
      raise ConfigError(
          f'pipeline.num_micro_batches={m} does not divide the batch of {batch_size}',
          where='pipeline.num_micro_batches',
          fix='use a divisor of train.batch_size, or change train.batch_size')
    return m

  @property
  def enabled(self) -> bool:
    return self.num_stages > 1 or self.num_micro_batches > 1 or self.micro_batch_size > 0


class StagedLayoutScope:
  """Creates each variable on the sub-mesh of the stage that runs its layer,
  laid out there by the rules, so the model keeps its usual tree, variable
  paths and checkpoint keys however it is staged."""

  def __init__(self, *, meshes: Sequence[dtensor.Mesh], layer_stages: Mapping[str, int],
               rules: LayoutRules | None = None, seed: int = 0):
    self.scopes = [LayoutScope(mesh=m, rules=rules, seed=seed) for m in meshes]
    self.layer_stages = dict(layer_stages)  # leaf layer path -> stage index
    self.records: list[LayoutRecord] = []
    self.variables: dict[str, tf.Variable] = {}
    self.variable_stages: dict[str, int] = {}
    self._context = None

  def create(self, spec: VariableSpec) -> tf.Variable:
    k = stage_of(self.layer_stages, spec.path)
    scope = self.scopes[k]
    variable = scope.create(spec)
    self.records.append(dataclasses.replace(scope.records[-1], mesh=scope.mesh.name))
    self.variables[spec.path] = variable
    self.variable_stages[spec.path] = k
    return variable

  def __enter__(self) -> 'StagedLayoutScope':
    self._context = contextlib.ExitStack()
    self._context.enter_context(variable_creator(self.create))
    self._context.enter_context(
        tf.variable_creator_scope(self.scopes[0].replicate_plain_variable))
    return self

  def __exit__(self, *exc) -> None:
    self._context.close()
    self._context = None


def _as_tuple(value) -> tuple:
  return value if isinstance(value, tuple) else (value,)


class GPipe:
  """Loss and gradients of a staged model over micro-batches (GPipe).

      gpipe = GPipe(stages=runners, placement=placement, loss_fn=cross_entropy,
                    num_micro_batches=4)
      loss, grads, squared_norms = gpipe.loss_and_gradients(micro_inputs, micro_labels)
      # grads[k][i] belongs to gpipe.variables[k][i]

  Two tf.functions per step, each crossing meshes in one direction only:

  * forward: micro-batches flow through stages 0..K-2 in clock order (stage k
    on micro-batch m while stage k+1 is on m-1); every stage input is kept.
  * backward, the clock order reversed: the last stage runs forward + loss +
    backward per micro-batch; every other stage re-computes its forward from
    its kept input and back-propagates the gradient that crossed back from
    the next stage (GPipe's re-materialisation: only stage inputs are held,
    never inner activations). Gradients accumulate over micro-batches (one
    AddN per variable); the loss is the mean over micro-batches, so with
    equal micro-batches it is the full-batch loss.

  `schedule='serial'` chains every unit of work on the previous one with
  control dependencies: the same numbers without any overlap (a benchmark
  reference).

  Why not one function with one tape: in TF 2.21 a tf.function whose backward
  crosses back to a DTensor mesh hangs whenever that gradient depends on
  activations that came from the same mesh (measured: any non-linear layer).
  """

  def __init__(self, *, stages: Sequence[Callable], placement,
               loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
               num_micro_batches: int, schedule: str = 'gpipe'):
    if schedule not in ('gpipe', 'serial'):
      raise ConfigError(f'pipeline schedule {schedule!r}', fix="use 'gpipe' or 'serial'")
    self.schedule = schedule
    self._previous = None  # last unit's outputs while tracing ('serial')
    self._seeds = None     # per-stage step seeds while tracing
    self.stages = list(stages)
    self.placement = placement
    self.loss_fn = loss_fn
    self.num_micro_batches = num_micro_batches
    self.variables = [list(stage.trainable_variables) for stage in self.stages]
    self._forward = tf.function(self._forward_fn)
    self._backward = tf.function(self._backward_fn)
    self._eval = tf.function(self._eval_fn)

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def bubble_fraction(self) -> float:
    return bubble_fraction(self.num_stages, self.num_micro_batches)

  # -- one stage, one micro-batch (traced inside the step functions) -------------
  def _random(self, k: int, m: int, inputs) -> tuple | None:
    """(seed, first global row) for stage k on micro-batch m, or None (no dropout)."""
    if self._seeds is None:
      return None
    return self._seeds[k], m * int(inputs[0].shape[0])

  def _run(self, k: int, inputs, random: tuple | None = None) -> tuple:
    """Stage k on one micro-batch. With `random` = (step seed, first row), random
    layers (dropout) draw that micro-batch's masks, in the forward and in its
    re-computation alike."""
    if random is not None:
      with random_context(seed=random[0], batch_offset=random[1]):
        outputs = _as_tuple(self.placement.run(k, self.stages[k], *inputs))
    else:
      outputs = _as_tuple(self.placement.run(k, self.stages[k], *inputs))
    if k < self.num_stages - 1:
      for y in outputs:
        if not y.dtype.is_floating:
          raise ConfigError(f'pipeline stage {k} outputs a {y.dtype.name} tensor; '
                            'activations between stages must be floating point',
                            fix='move the cut (pipeline.partition) past that layer')
    return outputs

  def _cross(self, values, source: int, target: int) -> tuple:
    return tuple(self.placement.cross(v, source, target) for v in values)

  def _loss_share(self, outputs: tuple, labels) -> tf.Tensor:
    """One micro-batch's loss / M: the shares sum to the mean loss."""
    return self.loss_fn(outputs[0] if len(outputs) == 1 else outputs,
                        labels) / self.num_micro_batches

  def _chain(self, inputs) -> tuple:
    """In the 'serial' schedule, makes this unit of work wait for the previous
    one (a reference for benchmarks: same work, no overlap)."""
    if self.schedule != 'serial' or self._previous is None:
      return tuple(inputs)
    with tf.control_dependencies(self._previous):
      return tuple(tf.identity(x) for x in inputs)

  def _unit_gradients(self, k: int, inputs, labels=None, output_grads=None, random=None):
    """Re-runs stage k on one micro-batch's kept input under a tape; returns
    (loss share or None, gradients of the floating inputs, of the variables)."""
    inputs = self._chain(inputs)
    floats = [x for x in inputs if x.dtype.is_floating]
    with tf.GradientTape() as tape:
      tape.watch(floats)
      outputs = self._run(k, inputs, random)
      share = self._loss_share(outputs, labels) if labels is not None else None
    grads = tape.gradient(share if labels is not None else list(outputs),
                          floats + self.variables[k],
                          output_gradients=None if labels is not None else list(output_grads),
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    self._previous = [g for g in grads if g is not None]
    return share, tuple(grads[:len(floats)]), grads[len(floats):]

  # -- step functions --------------------------------------------------------------
  def _forward_fn(self, micro_inputs, seeds=None):
    """Stage inputs [k][m] for stages 1..K-1, in clock order."""
    self._seeds = seeds
    num_stages, num_micro = self.num_stages, self.num_micro_batches
    kept = [[None] * num_micro for _ in range(num_stages)]
    kept[0] = [_as_tuple(x) for x in micro_inputs]
    self._previous = None
    for clock in range(num_micro + num_stages - 2):
      for k in range(num_stages - 1):
        m = clock - k
        if 0 <= m < num_micro:
          outputs = self._run(k, self._chain(kept[k][m]), self._random(k, m, kept[k][m]))
          self._previous = list(outputs)
          kept[k + 1][m] = self._cross(outputs, k, k + 1)
    return kept[1:]

  def _backward_fn(self, micro_inputs, kept, micro_labels, seeds=None):
    """The forward's clock order reversed: stage k back-propagates micro-batch
    m while stage k-1 works on m-1, each re-computing its forward first."""
    self._seeds = seeds
    num_stages, num_micro, last = self.num_stages, self.num_micro_batches, self.num_stages - 1
    inputs = [[_as_tuple(x) for x in micro_inputs]] + [list(row) for row in kept]
    output_grads = [[None] * num_micro for _ in range(num_stages)]
    per_micro: list[list] = [[] for _ in range(num_stages)]
    shares = []
    self._previous = None
    for clock in range(num_micro + num_stages - 1):
      for k in range(last, -1, -1):
        m = clock - (last - k)
        if not 0 <= m < num_micro:
          continue
        share, input_grads, grads = self._unit_gradients(
            k, inputs[k][m], labels=micro_labels[m] if k == last else None,
            output_grads=output_grads[k][m], random=self._random(k, m, inputs[k][m]))
        if share is not None:
          shares.append(share)
        per_micro[k].append(grads)
        if k > 0:
          output_grads[k - 1][m] = self._cross(input_grads, k, k - 1)
    # Accumulate over micro-batches: one AddN per variable.
    grads = [[tf.add_n([tf.convert_to_tensor(g) for g in column]) for column in zip(*rows)]
             for rows in per_micro]
    squared_norms = [squared_norm(stage) if stage else None for stage in grads]
    return tf.add_n(shares), grads, squared_norms

  def _eval_fn(self, micro_inputs, micro_labels):
    kept = self._forward_fn(micro_inputs) if self.num_stages > 1 else [micro_inputs]
    self._seeds = None
    last = [_as_tuple(x) for x in kept[-1]]
    shares = []
    for m in range(self.num_micro_batches):
      outputs = self._run(self.num_stages - 1, last[m])
      shares.append(self._loss_share(outputs, micro_labels[m]))
    return tf.add_n(shares)

  # -- public --------------------------------------------------------------------------
  def loss(self, micro_inputs, micro_labels) -> tf.Tensor:
    """Forward only (evaluation): the mean loss over micro-batches."""
    self._check(micro_inputs)
    return self._eval(list(micro_inputs), list(micro_labels))

  def loss_and_gradients(self, micro_inputs, micro_labels, seeds=None):
    """(mean loss, [per-stage gradient lists], [per-stage squared gradient norm]),
    each on its stage's mesh (the loss on the last stage's). `seeds`: this
    step's random seed as a scalar on each stage's mesh, for dropout."""
    self._check(micro_inputs)
    seeds = list(seeds) if seeds is not None else None
    kept = self._forward(list(micro_inputs), seeds) if self.num_stages > 1 else []
    return self._backward(list(micro_inputs), kept, list(micro_labels), seeds)

  def _check(self, micro_inputs) -> None:
    if len(micro_inputs) != self.num_micro_batches:
      raise ValueError(f'{len(micro_inputs)} micro-batches given, '
                       f'{self.num_micro_batches} expected')

