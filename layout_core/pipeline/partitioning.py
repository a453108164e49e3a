"""Cutting a sequence of layers into cost-balanced contiguous stages.

    layers = flatten_layers(lm_params)                     # emb, block_000.., softmax
    plan = partition(layers, num_stages=2, input_shapes=[(8, 64)], method='balanced')
    plan.describe()                                        # FLOPs share per stage

'balanced' finds the contiguous split minimising the most expensive stage
(exact, dynamic programming); 'lingvo' reproduces Lingvo's cumulative-histogram
heuristic for comparison; or give explicit layer counts per stage. Costs are
forward FLOPs from each layer's `fprop_meta`, so nothing is built.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from layout_core.errors import ConfigError
from layout_core.params import Params

Shape = tuple[int, ...]


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
  from layout_core.model.base import frozen_meta  # pylint: disable=import-outside-toplevel
  costs, shapes = [], tuple(tuple(s) for s in input_shapes)
  for p in layers:
    meta = frozen_meta(p, shapes)
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
