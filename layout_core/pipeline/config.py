"""What `pipeline.*` in gin sets (TensorFlow-free: checked at config time).

    config = PipelineConfig(num_stages=2, num_micro_batches=8, engine='spmd',
                            circular_repeats=2)
    config.micro_batches(batch_size=32)     # 8; a ConfigError when it does not divide
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from layout_core.errors import ConfigError
from layout_core.fields import check_types

ENGINES = ('submesh', 'spmd')


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """num_stages=1 and one micro-batch: no pipeline."""
  num_stages: int = 1               # S, the size of mesh axis `stage_axis`
  num_micro_batches: int = 0        # M; 0: from micro_batch_size, else 1
  micro_batch_size: int = 0         # alternative to num_micro_batches
  batch_dim: int = 0                # batch dimension of the stage inputs
  partition: str | Sequence[int] = 'balanced'  # 'balanced' | 'lingvo' | layer counts
  stage_axis: str = 'stage'         # mesh axis the stages are laid out along
  # 'submesh': each stage on its own sub-mesh (any layers; stages run one after
  # another on DTensor). 'spmd': the stack's identical cells stacked [stages, ...]
  # on the stage axis of one mesh, every stage computing at once.
  engine: str = 'submesh'
  # R, spmd only: each stage holds R non-adjacent chunks of cells (circular
  # pipeline); the bubble drops to (S-1)/(R*M+S-1). Needs M >= S when R > 1.
  circular_repeats: int = 1

  def clients_problem(self, *, num_clients: int, devices_per_client: int) -> str | None:
    """Why this pipeline cannot run on `num_clients` clients of
    `devices_per_client` devices each (None: it can). The SPMD engine is one
    program on the whole mesh; the sub-mesh engine gives every stage an equal
    share of each client's devices (a stage per client cannot take DTensor's
    cross-mesh copy: bench/limits/cross_client_submesh_limit.py)."""
    if num_clients == 1 or self.engine == 'spmd' or devices_per_client % self.num_stages == 0:
      return None
    return (f'the sub-mesh engine gives each of its {self.num_stages} stages an equal share '
            f"of every client's devices, and a client's {devices_per_client} device(s) do "
            f'not split {self.num_stages} ways')

  def __post_init__(self):
    check_types(self, name='pipeline')
    if self.num_stages < 1:
      raise ConfigError(f'pipeline.num_stages is {self.num_stages}', fix='use at least 1')
    if self.num_micro_batches < 0 or self.micro_batch_size < 0:
      raise ConfigError('pipeline.num_micro_batches and pipeline.micro_batch_size '
                        'must not be negative', fix='use 0 (unset) or a positive count')
    if self.batch_dim < 0:
      raise ConfigError(f'pipeline.batch_dim is {self.batch_dim}', fix='use 0 or 1')
    if self.engine not in ENGINES:
      raise ConfigError(f'pipeline.engine is {self.engine!r}', where='pipeline.engine',
                        fix=f"use one of {', '.join(repr(e) for e in ENGINES)}")
    if self.circular_repeats < 1:
      raise ConfigError(f'pipeline.circular_repeats is {self.circular_repeats}',
                        where='pipeline.circular_repeats', fix='use 1 or more')
    if self.circular_repeats > 1 and self.engine != 'spmd':
      raise ConfigError(
          f'pipeline.circular_repeats={self.circular_repeats} needs the SPMD engine',
          where='pipeline.circular_repeats',
          fix="set pipeline.engine = 'spmd', or pipeline.circular_repeats = 1")
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
    return (self.num_stages > 1 or self.num_micro_batches > 1 or self.micro_batch_size > 0
            or self.engine == 'spmd')
