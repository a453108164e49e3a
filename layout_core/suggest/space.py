"""The candidate space of the layout suggester: layouts and their settings.

    layouts = enumerate_layouts(num_devices=8, tensor_parallel=True, pipelines=True)
    layouts[0].describe()              # 'data=8'
    Candidate(layouts[0], Settings()).bindings(rules=['layout_rules.rules = [...]'])

A `Layout` is how the devices are used: the mesh factorized over stage x
expert x data x model (in that order, so the model axis is innermost and
stays on a host), what the data axis also splits (the optimizer state,
ZeRO-1, or the parameters themselves, FSDP), where a routed model's experts
live (replicated, split over the batch's own axis, or over an `expert` axis
of their own) and the pipeline engine. `Settings` are the knobs
that trade speed for memory within a layout: compute dtype, rematerialisation,
gradient accumulation, and a pipeline's micro-batches and circular repeats.
The suggester gives each layout the settings its cost model predicts fastest
among those that fit (`layout_core.suggest.search`). Plain Python.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

STATES = ('replicated', 'zero1', 'fsdp')
REMATS = ('none', 'block', 'full')
DTYPES = ('float32', 'bfloat16')
ENGINES = ('submesh', 'spmd')
# Where a routed (MoE) model's experts live: on every device, split over the
# batch's own axis 'data' (GShard: the tokens go to their experts by
# all-to-all), or over an 'expert' axis of their own beside it (the batch
# split over 'data' only: the dispatch a local slice, the combine an
# all-reduce). docs/moe.md.
EXPERT_SPLITS = ('replicated', 'data', 'expert')


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
  """A mesh factorization and what each axis splits."""
  stage: int = 1
  data: int = 1
  model: int = 1
  state: str = 'replicated'  # the data axis also splits: STATES
  engine: str = ''           # '' without a pipeline; else one of ENGINES
  experts: str = 'replicated'  # a routed model's experts: EXPERT_SPLITS
  expert: int = 1            # the 'expert' axis's size (experts == 'expert')

  @property
  def mesh_shape(self) -> dict[str, int]:
    """Ordered {axis: size}: stage outermost, model innermost; 'data' always
    (the batch axis), the others when larger than 1."""
    shape = {'stage': self.stage} if self.stage > 1 else {}
    if self.expert > 1:
      shape['expert'] = self.expert
    shape['data'] = self.data
    if self.model > 1:
      shape['model'] = self.model
    return shape

  @property
  def num_devices(self) -> int:
    return self.stage * self.expert * self.data * self.model

  @property
  def expert_axis(self) -> str | None:
    """The mesh axis that splits the experts (None: replicated)."""
    return None if self.experts == 'replicated' else self.experts

  @property
  def family(self) -> str:
    """What the memory estimate's measured error is kept per: the pipeline
    engine and the state split ('plain/replicated', 'spmd/fsdp', ...)."""
    return f'{self.engine or "plain"}/{self.state}'

  def describe(self) -> str:
    axes = ' x '.join(f'{axis}={size}' for axis, size in self.mesh_shape.items())
    extra = [] if self.state == 'replicated' else [self.state.replace('zero1', 'ZeRO-1')
                                                  .replace('fsdp', 'FSDP')]
    if self.experts == 'data':
      extra.append('experts over data')
    if self.engine:
      extra.append(f'{self.engine} pipeline')
    return axes + (f' ({", ".join(extra)})' if extra else '')


@dataclasses.dataclass(frozen=True, order=True)
class Settings:
  """The speed-for-memory knobs within one layout."""
  compute_dtype: str = 'float32'
  remat: str = 'none'
  grad_accum: int = 1
  micro_batches: int = 0      # pipelines: per accumulation micro-step
  circular_repeats: int = 1   # the SPMD engine's

  def describe(self) -> str:
    parts = [self.compute_dtype if self.compute_dtype != 'float32' else '',
             f'remat {self.remat}' if self.remat != 'none' else '',
             f'accumulate {self.grad_accum}' if self.grad_accum > 1 else '',
             f'{self.micro_batches} micro-batches' if self.micro_batches else '',
             f'{self.circular_repeats} repeats' if self.circular_repeats > 1 else '']
    return ', '.join(p for p in parts if p) or 'float32'


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
  layout: Layout
  settings: Settings

  def describe(self) -> str:
    return f'{self.layout.describe()}; {self.settings.describe()}'

  def bindings(self, *, rules: Sequence[str] | None = None, reset_pipeline: bool = False
               ) -> list[str]:
    """gin bindings that make a config run this candidate. `rules`: the
    lines that bind this layout's rules (empty: the rules are emptied, every
    variable replicated or split by FSDP alone; None: the config's own);
    `reset_pipeline`: also turn off a pipeline the config sets up, for a
    layout without one."""
    layout, settings = self.layout, self.settings
    shape = ', '.join(f"'{axis}': {size}" for axis, size in layout.mesh_shape.items())
    lines = [f'mesh.shape = {{{shape}}}']
    if rules is not None:
      lines += list(rules) or ['layout_rules.rules = []']
    lines += ["train.batch_axis = 'data'",
              f'train.fsdp = {layout.state == "fsdp"}',
              f'optimizer.shard_state = {layout.state == "zero1"}',
              f"train.compute_dtype = '{settings.compute_dtype}'",
              f"train.remat = '{settings.remat}'",
              f'train.grad_accum_steps = {settings.grad_accum}',
              f'pipeline.num_stages = {layout.stage}']
    if layout.engine or reset_pipeline:
      lines += [f"pipeline.engine = '{layout.engine or 'submesh'}'",
                f'pipeline.num_micro_batches = {settings.micro_batches}',
                'pipeline.micro_batch_size = 0',
                f'pipeline.circular_repeats = {settings.circular_repeats}']
    return lines


def divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(*, num_devices: int, tensor_parallel: bool, pipelines: bool,
                      max_stages: int = 0, model_sizes: Sequence[int] = (),
                      num_experts: int = 0) -> list[Layout]:
  """Every layout of `num_devices`: stage x expert x data x model
  factorizations (a model axis only with tensor rules, `model_sizes` when
  given; stages only when the model pipelines, at most `max_stages`), each
  with every state split the data axis allows and every pipeline engine. A
  routed model (`num_experts` > 0) also splits its experts where an axis's
  size divides their number: over the data axis, or over an expert axis of
  their own (not inside a pipeline's stages, which split experts over their
  batch axis only)."""
  found = []
  for stage in divisors(num_devices) if pipelines else [1]:
    if stage > 1 and max_stages and stage > max_stages:
      continue
    rest = num_devices // stage
    for model in divisors(rest) if tensor_parallel else [1]:
      if model > 1 and model_sizes and model not in model_sizes:
        continue
      for expert, experts in _expert_splits(rest // model, num_experts, pipeline=stage > 1):
        data = rest // model // expert
        for state in STATES if data > 1 else STATES[:1]:
          for engine in ENGINES if stage > 1 else ('',):
            found.append(Layout(stage=stage, data=data, model=model, state=state,
                                engine=engine, experts=experts, expert=expert))
  return found


def _expert_splits(devices: int, num_experts: int, *, pipeline: bool
                   ) -> list[tuple[int, str]]:
  """(expert axis size, EXPERT_SPLITS entry) for `devices` left to the
  expert and data axes: replicated; over data where the data axis's size
  divides the experts; over an expert axis of each size > 1 that does,
  the rest (at least 2) on data. (An expert axis of every device would
  leave the batch whole: each device would repeat every other layer's work,
  which the experts over data do not.)"""
  splits = [(1, 'replicated')]
  if num_experts and devices > 1 and num_experts % devices == 0:
    splits.append((1, 'data'))
  if num_experts and not pipeline:
    splits += [(e, 'expert') for e in divisors(devices)
               if 1 < e < devices and num_experts % e == 0]
  return splits


def powers_of_two_dividing(n: int, *, limit: int) -> list[int]:
  """1, 2, 4, ... up to `limit`, each dividing `n`."""
  found, k = [], 1
  while k <= limit and n % k == 0:
    found.append(k)
    k *= 2
  return found


def no_settings_reason(layout: Layout, *, batch_size: int) -> str:
  """Why `settings_for` has nothing to try in `layout`: the batch does not
  split over its data axis, or not into a pipeline's micro-batches."""
  if batch_size % layout.data:
    return (f'the batch of {batch_size} rows does not split {layout.data} ways '
            f'(data={layout.data}; data must divide train.batch_size)')
  return (f'the batch of {batch_size} rows does not split into {layout.stage} '
          f'micro-batches of whole rows per data shard ({layout.describe()})')


def settings_for(layout: Layout, *, batch_size: int, num_layers: int, dtypes=DTYPES,
                 remats=REMATS, max_accum: int = 64) -> Iterator[tuple[Settings, ...]]:
  """The settings to try within `layout`, as ladders: each tuple holds the
  same settings at growing gradient accumulation (less memory, more time), so
  a search can stop at the first that fits. Accumulation keeps at least one
  row per data shard; a pipeline's micro-batches are S, 2S and 4S (each at
  least a row per data shard); the SPMD engine's circular repeats are 1 and
  as many as the layers allow (layers = stages x repeats x cells)."""
  accums = [k for k in powers_of_two_dividing(batch_size, limit=max_accum)
            if batch_size // k % layout.data == 0]
  micro = [0]
  repeats = [1]
  if layout.engine:
    micro = [m * layout.stage for m in (1, 2, 4)]
    if layout.engine == 'spmd' and num_layers % layout.stage == 0:
      most = num_layers // layout.stage
      repeats = sorted({1, most})
  for dtype in dtypes:
    for remat in remats:
      for repeat in repeats:
        for m in micro:
          ladder = tuple(Settings(compute_dtype=dtype, remat=remat, grad_accum=k,
                                  micro_batches=m, circular_repeats=repeat)
                         for k in accums
                         if not m or (batch_size // k) % (m * layout.data) == 0)
          if ladder:
            yield ladder
