"""Stages: groups of layers run in order, and the staged-model builder.

    staged = build_staged_model(lm_params, mesh=mesh, rules=rules, num_stages=2,
                                input_shapes=[(4, 16)])
    staged.runners[0](ids)           # stage 0 of the built model, on its sub-mesh

The model is built once, as the usual Params tree (same modules, variable
paths and checkpoint keys as an unpipelined run); each leaf layer's variables
are created on the sub-mesh of the stage that runs it. `StageRunner`s group
the built leaves into the partition's stages.

A `Stage` (Lingvo's FeatureExtractionLayer) may also return the outputs of
named inner layers (`fetch`): those are carried past every later layer and
stage, never fed to them, and come out of the pipeline after its own output.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


from layout_core.lazy import Module, tf
from layout_core.errors import ConfigError
from layout_core.model.base import BaseLayer, Sequential, leaf_layers, leaf_modules
from layout_core.params import Params
from layout_core.pipeline import partitioning as partition_lib
from layout_core.pipeline.placement import StagedLayoutScope, SubMeshPlacement
from layout_core.layout.rules import LayoutRules


def as_tuple(value) -> tuple:
  return value if isinstance(value, tuple) else (value,)


def num_fetched(layer) -> int:
  """How many trailing outputs of `layer` are fetched activations (not data
  for the next layer)."""
  return getattr(layer, 'num_fetched', 0)


def split_fetched(layer, outputs) -> tuple[tuple, tuple]:
  """(outputs for the next layer, fetched activations) of one call of `layer`."""
  outputs = as_tuple(outputs)
  count = num_fetched(layer)
  if count == 0:
    return outputs, ()
  return outputs[:len(outputs) - count], outputs[len(outputs) - count:]


class Stage(Sequential):
  """A stage (Lingvo's FeatureExtractionLayer): runs `sub` in order and also
  returns the outputs of named inner layers (`fetch`) after its own."""

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

  @property
  def num_fetched(self) -> int:
    return len(self.params.fetch) + sum(num_fetched(c) for c in self.children())

  def fprop(self, *inputs):
    unknown = set(self.params.fetch) - set(self.child_names)
    if unknown:
      raise ConfigError(f'{self.path}: fetch names {sorted(unknown)} are not layers '
                        f'of this stage ({list(self.child_names)})',
                        where=f'{self.path}.fetch', fix='name layers of this stage')
    return run_layers(self.children(), inputs, fetch=self.params.fetch)


def run_layers(layers: Sequence[BaseLayer], inputs: Sequence[tf.Tensor],
               fetch: Sequence[str] = ()):
  """Runs `layers` in order; returns the last outputs, then the activations
  fetched on the way (inner stages' fetches and the first output of each layer
  named in `fetch`, in execution order); one tensor when that is all."""
  outputs, fetched = tuple(inputs), []
  for layer in layers:
    outputs, carried = split_fetched(layer, layer(*outputs))
    fetched += carried
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

  @property
  def num_fetched(self) -> int:
    return sum(num_fetched(layer) for layer in self.layers)

  def __call__(self, *inputs):
    return run_layers(self.layers, inputs)


def stage_params(plan: partition_lib.PartitionPlan, *,
                 name_prefix: str = 'stage') -> list[Params]:
  return [Stage.Params().Set(name=f'{name_prefix}_{k}', sub=[p.Copy() for p in s.layers])
          for k, s in enumerate(plan.stages)]


def stage_runners(model: BaseLayer, plan: partition_lib.PartitionPlan) -> list[StageRunner]:
  """The built model's leaf layers grouped into `plan`'s stages."""
  modules, runners, first = leaf_modules(model), [], 0
  for k, stage in enumerate(plan.stages):
    runners.append(StageRunner(modules[first:first + len(stage.layers)], name=f'stage_{k}'))
    first += len(stage.layers)
  return runners


@dataclasses.dataclass
class StagedModel:
  model: BaseLayer                  # the usual tree: usual paths and checkpoint keys
  plan: partition_lib.PartitionPlan
  runners: list[StageRunner]        # stage k = runners[k]
  placement: SubMeshPlacement
  scope: StagedLayoutScope          # layout records and path -> variable
  layer_stages: dict[str, int]      # leaf layer path -> stage


def build_staged_model(params: Params, *, mesh, rules: LayoutRules | None,
                       num_stages: int, input_shapes: Sequence[tuple[int, ...]],
                       method: str | Sequence[int] = 'balanced', stage_axis: str = 'stage',
                       batch_axis: str = 'data', seed: int = 0,
                       partition: partition_lib.PartitionPlan | None = None,
                       fsdp_axis: str | None = None) -> StagedModel:
  """Partitions `params`' leaf layers by FLOPs for `input_shapes` (one
  micro-batch; or takes the `partition` a pipeline plan already made) and
  builds the model with every leaf's variables on its stage's sub-mesh of
  `mesh` (cut along `stage_axis`), stored split over that sub-mesh's
  `fsdp_axis` too if given."""
  leaves = leaf_layers(params)
  plan = partition or partition_lib.partition([p for _, p in leaves], num_stages=num_stages,
                                              input_shapes=input_shapes, method=method)
  placement = SubMeshPlacement(mesh=mesh, stage_axis=stage_axis, rules=rules,
                               batch_axis=batch_axis, seed=seed)
  owners = partition_lib.layer_stages([path for path, _ in leaves], plan)
  scope = StagedLayoutScope(meshes=placement.meshes, layer_stages=owners, rules=rules,
                            seed=seed, fsdp_axis=fsdp_axis)
  with scope:
    model = params.Instantiate()
  return StagedModel(model=model, plan=plan, runners=stage_runners(model, plan),
                     placement=placement, scope=scope, layer_stages=owners)
