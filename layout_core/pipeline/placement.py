"""Placement: where each stage lives and how activations move between stages.

    placement = SubMeshPlacement(mesh=mesh, stage_axis='stage', rules=rules)
    placement.meshes          # one sub-mesh per stage
    x1 = placement.cross(y0, 0, 1)

`DevicePlacement` puts stage k on a plain TF device (no DTensor);
`SubMeshPlacement` on sub-mesh k of a mesh cut along the stage axis, where the
layout rules apply. `StagedLayoutScope` creates each variable on the sub-mesh
of the stage whose layer owns it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from layout_core.lazy import tf, dtensor
from layout_core.layout import mesh as mesh_lib
from layout_core.model.base import BaseLayer
from layout_core.layout.scope import LayoutRecord, LayoutScope
from layout_core.params import Params
from layout_core.pipeline.partitioning import stage_of
from layout_core.layout.rules import UNSHARDED, LayoutRules
from layout_core.layout.variables import VariableSpec, variable_creator


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

  def put_changing(self, k: int, value) -> tf.Tensor:
    """A NumPy scalar that changes every step, for a step function, on
    sub-mesh k (`mesh_lib.pack_changing_scalar`: the function reads [0])."""
    return mesh_lib.pack_changing_scalar(value, self.meshes[k])

  def cross(self, value: tf.Tensor, source: int, target: int) -> tf.Tensor:
    rank = value.shape.rank
    replicated = dtensor.relayout(value, dtensor.Layout.replicated(self.meshes[source], rank))
    moved = dtensor.copy_to_mesh(replicated,
                                 dtensor.Layout.replicated(self.meshes[target], rank))
    if rank == 0:  # a scalar (a loss's count) has no batch dim to split
      return moved
    return dtensor.relayout(moved, self.batch_layout(target, rank, self.batch_dim))


class StagedLayoutScope:
  """Creates each variable on the sub-mesh of the stage that runs its layer,
  laid out there by the rules, so the model keeps its usual tree, variable
  paths and checkpoint keys however it is staged."""

  def __init__(self, *, meshes: Sequence[dtensor.Mesh], layer_stages: Mapping[str, int],
               rules: LayoutRules | None = None, seed: int = 0, fsdp_axis: str | None = None):
    self.scopes = [LayoutScope(mesh=m, rules=rules, seed=seed, fsdp_axis=fsdp_axis)
                   for m in meshes]
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


