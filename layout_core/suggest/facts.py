"""What the cost model reads from a plan's layout records, worked out once per plan.

    facts = PlanFacts.of(plan.records, profile=profile, mesh_axes={'data': 2, 'model': 4},
                         batch_axis='data', stage_axis='stage')
    facts.splits['lm/stack/block_#']      # ways a leaf's math is split by its weights

`layout_core.suggest.cost.predict_step` prices a step from these and the
model's `ModelProfile`: how many ways each leaf layer's math is split (its
experts apart), the parameter bytes per device and which of them FSDP
splits or the batch axis holds whole, the axes whose collectives cross
hosts. Leaf paths are generalised (`block_#`): the SPMD engine stores a
stack's cells as the first cells' stacked variables. Plain Python.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Mapping, Sequence

from layout_core.layout.rules import UNSHARDED
from layout_core.layout.scope import bytes_at_use
from layout_core.model import moe


def _owner_splits(records, leaves, mesh_axes, skip) -> dict[str, int]:
  """Leaf path -> how many ways its math is split by its weights' layouts
  (the largest split of any of its weights, over axes other than `skip`).
  Keyed with layer indices generalised (`block_#`): the SPMD engine stores a
  stack's cells as the first cells' stacked variables. `records`: the
  weights to count (a routed layer's experts apart: `moe.is_expert_weight`)."""
  paths = _leaf_paths(leaves)
  split: dict[str, int] = {}
  for r in records:
    ways = math.prod(mesh_axes.get(a, 1) for a in r.compute_spec
                     if a != UNSHARDED and a not in skip)
    leaf = _leaf_of(r.path, paths)
    if leaf is not None:
      split[leaf] = max(split.get(leaf, 1), ways)
  return split


def _expert_axes(records, leaves) -> dict[str, str]:
  """Leaf path (generalised) -> the mesh axis its experts are split over."""
  paths = _leaf_paths(leaves)
  found = {}
  for r in records:
    leaf = _leaf_of(r.path, paths) if moe.is_expert_weight(r.path) else None
    if leaf is not None and r.compute_spec and r.compute_spec[0] != UNSHARDED:
      found[leaf] = r.compute_spec[0]
  return found


def _leaf_paths(leaves) -> list[str]:
  """The leaves' generalised paths, longest first (for `_leaf_of`)."""
  return sorted({general(l.path) for l in leaves}, key=len, reverse=True)


def _leaf_of(variable_path: str, leaf_paths: Sequence[str]) -> str | None:
  """The generalised path of the leaf layer a variable belongs to (None: none)."""
  key = general(variable_path)
  return next((leaf for leaf in leaf_paths if key.startswith(leaf + '/')), None)


def general(path: str) -> str:
  return re.sub(r'_\d+(?=/|$)', '_#', path)


@dataclasses.dataclass(frozen=True)
class PlanFacts:
  """What the cost model reads from a plan's layout records, worked out once
  per plan (the settings that do not change the plan vary around it)."""
  splits: dict          # generalised leaf path -> ways its math is split
  variables: int        # on the fullest stage
  param_bytes: int      # per device, the fullest stage
  split_bytes: int      # their stored bytes per device
  at_use_bytes: int     # their gathered bytes per device (float32)
  spans: frozenset      # mesh axes across hosts
  block_bytes: int = 0      # the first Transformer block's parameters per device
  block_variables: int = 0  # and how many variables it has
  # each FSDP-split variable's (generalised leaf path or None, gathered bytes
  # per device): how often it is gathered depends on its leaf (recomputed? in
  # a pipeline?), which the settings decide
  split_leaves: tuple = ()
  # a routed leaf's (generalised path) experts: the ways their math is split
  # (the batch's and stage axes aside), and the mesh axis that splits them
  expert_splits: dict = dataclasses.field(default_factory=dict)
  expert_axes: dict = dataclasses.field(default_factory=dict)
  # of param_bytes, the weights a rule splits over the batch axis itself (a
  # routed layer's experts, GShard): each device's gradient is its own, no sum
  batch_split_bytes: int = 0

  @classmethod
  def of(cls, records, *, profile, mesh_axes: Mapping[str, int],
         batch_axis: str, stage_axis: str, hosts: int = 1) -> 'PlanFacts':
    fullest = _fullest_stage_records(records)
    split = [r for r in fullest if r.use_spec is not None]
    block = next((l.path + '/' for l in profile.leaves if l.block), None)
    in_block = [r for r in records if block and r.path.startswith(block)]
    leaf_paths = _leaf_paths(profile.leaves)
    skip = {batch_axis, stage_axis}
    experts = [r for r in records if moe.is_expert_weight(r.path)]
    return cls(splits=_owner_splits([r for r in records if not moe.is_expert_weight(r.path)],
                                    profile.leaves, mesh_axes, skip),
               expert_splits=_owner_splits(experts, profile.leaves, mesh_axes, skip),
               expert_axes=_expert_axes(experts, profile.leaves),
               variables=len(fullest), param_bytes=sum(r.bytes_per_device for r in fullest),
               split_bytes=sum(r.bytes_per_device for r in split),
               at_use_bytes=sum(bytes_at_use(r, mesh_axes) for r in split),
               split_leaves=tuple((_leaf_of(r.path, leaf_paths), bytes_at_use(r, mesh_axes))
                                  for r in split),
               spans=frozenset(_spanning_axes(mesh_axes, hosts)),
               block_bytes=sum(r.bytes_per_device for r in in_block),
               block_variables=len(in_block),
               batch_split_bytes=sum(r.bytes_per_device for r in fullest
                                     if r.use_spec is None and batch_axis in r.spec))


def _fullest_stage_records(records):
  """The records of the stage mesh that holds the most parameter bytes."""
  by_mesh: dict[str, list] = {}
  for r in records:
    by_mesh.setdefault(r.mesh, []).append(r)
  if len(by_mesh) <= 1:
    return list(records)
  return max(by_mesh.values(), key=lambda rs: sum(r.bytes_per_device for r in rs))


def _spanning_axes(mesh_axes: Mapping[str, int], hosts: int) -> set[str]:
  """Mesh axes whose collectives cross hosts (devices numbered in mesh order,
  each host holding a contiguous block): an axis's groups are blocks of
  (its size x the sizes inside it) devices, which stay within hosts only
  where such blocks tile a host (12 devices on 2 hosts: model=4 groups
  devices 4-7 across hosts 0 and 1)."""
  if hosts <= 1:
    return set()
  per_host = math.prod(mesh_axes.values()) // hosts
  spans, inner = set(), 1
  for axis, size in reversed(list(mesh_axes.items())):
    if size > 1 and per_host % (inner * size):
      spans.add(axis)
    inner *= size
  return spans
