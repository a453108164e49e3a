"""What a training run is asked to do, and what it reports (TensorFlow-free).

    config = TrainConfig(num_steps=300, batch_size=32)
    axis = batch_axis_for(config, mesh_axes={'data': 2, 'model': 4})   # 'data'

The plan (`plugins.plan`) checks these at config time; the engines use the
same function to find the batch axis, so the rule is written once.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from absl import logging

from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_types
from layout_core.layout.rules import UNSHARDED
from layout_core.model.frozen import check_frozen_dtype

COMPUTE_DTYPES = ('float32', 'bfloat16')
# What the backward pass recomputes instead of keeping (docs/memory-precision.md):
#   'none':  nothing; every activation is kept for the whole step;
#   'block': each repeated block (a cell of a repeated Sequential, of the SPMD
#            stack, of a GPipe stage; every Keras layer) keeps only its input;
#   'full':  'block', and every other layer too (embedding, norms, softmax).
REMAT_POLICIES = ('none', 'block', 'full')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  num_steps: int = 300       # total optimizer steps (a resumed run stops here too)
  batch_size: int = 32       # global batch, split over `batch_axis`
  eval_every: int = 100      # steps between evaluations; 0: only at start and end
  eval_batches: int = 4      # held-out batches per evaluation
  log_every: int = 25        # steps between progress lines / train scalars
  seed: int = 0              # initial weights (data has its own seed)
  batch_axis: str = 'data'   # mesh axis the batch is split over ('' for none)
  # (start, stop): a TensorFlow profiler trace of steps start..stop-1 (0-based)
  # into model_dir/plugins/profile, for TensorBoard's Profile tab; None: off.
  profile_steps: tuple[int, int] | None = None
  # Memory and precision (defaults: today's float32, keep-everything step).
  compute_dtype: str = 'float32'  # forward/backward math: 'float32' | 'bfloat16'
  remat: str = 'none'        # recompute activations in the backward pass: REMAT_POLICIES
  grad_accum_steps: int = 1  # micro-steps of batch_size / k summed into one update
  # Fully sharded parameters (FSDP / ZeRO-3): False; True (split over the
  # batch axis); or a mesh axis name. Parameters, gradients and optimizer
  # state are stored split; each layer gathers its weights when it runs
  # (layout_core.layout.fsdp, docs/memory-precision.md).
  fsdp: bool | str = False
  # Text samples (layout_core.infer.text_samples): every sample_every steps,
  # greedy continuations of sample_prompts held-out prompts (the first half
  # of eval rows), sample_tokens new tokens each, to TensorBoard's
  # samples/text. A Transformer LM on the plain engine only; 0: off.
  sample_every: int = 0
  sample_prompts: int = 4    # held-out prompts per sample
  sample_tokens: int = 32    # new tokens per prompt
  # Fine-tuning: regexes on variable paths; only the variables they
  # fullmatch train (gradients, optimizer state). None: every variable, or
  # with LoRA (`lora.rank`) the adapters only (layout_core.model.lora).
  trainable: tuple[str, ...] | None = None
  # The dtype the frozen weights (a LoRA base, what `trainable` leaves out)
  # are stored, checkpointed and gathered in: 'float32', 'bfloat16' or
  # 'int8' (a float32 scale per output channel; layout_core.model.frozen).
  frozen_dtype: str = 'float32'

  def __post_init__(self):
    check_types(self, name='train')
    at_least(self, 'train', num_steps=1, batch_size=1, log_every=1, eval_batches=1,
             eval_every=0, seed=0, grad_accum_steps=1, sample_every=0, sample_prompts=1,
             sample_tokens=1)
    for field, allowed in (('compute_dtype', COMPUTE_DTYPES), ('remat', REMAT_POLICIES)):
      if getattr(self, field) not in allowed:
        raise ConfigError(f'train.{field} is {getattr(self, field)!r}', where=f'train.{field}',
                          fix=f"use one of {', '.join(map(repr, allowed))}")
    check_frozen_dtype(self.frozen_dtype)
    if self.fsdp == '':
      raise ConfigError("train.fsdp is ''", where='train.fsdp',
                        fix='use False, True (the batch axis) or a mesh axis name')
    if self.batch_size % self.grad_accum_steps:
      raise ConfigError(
          f'train.grad_accum_steps={self.grad_accum_steps} does not divide '
          f'train.batch_size={self.batch_size}', where='train.grad_accum_steps',
          fix='use a divisor of the batch size (each micro-step takes batch_size / k)')
    if self.profile_steps is not None:
      steps = tuple(self.profile_steps)
      if not 0 <= steps[0] < steps[1]:
        raise ConfigError(f'train.profile_steps is {self.profile_steps!r}',
                          where='train.profile_steps',
                          fix='give (start, stop) steps with 0 <= start < stop, e.g. (5, 8)')
      object.__setattr__(self, 'profile_steps', steps)
    if self.trainable is not None:
      object.__setattr__(self, 'trainable', tuple(self.trainable))


@dataclasses.dataclass
class TrainResult:
  final_step: int
  train_loss: float | None
  eval_losses: list[tuple[int, float]]  # (step, loss) per evaluation
  steps_per_sec: float
  eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last eval's
  stopped_early: bool = False           # `after_step` asked to stop (preemption)
  start_step: int = 0                   # where this run started (a resume: the checkpoint's)


def batch_axis_for(config: TrainConfig, mesh_axes: Mapping[str, int], *,
                   warn: bool = False) -> str:
  """The mesh axis the global batch is split over: `config.batch_axis`, or
  UNSHARDED (replicated) when the mesh lacks it. A ConfigError when the batch
  does not split evenly."""
  axis = config.batch_axis
  if axis not in mesh_axes:
    if axis and warn:
      logging.warning("train.batch_axis '%s' is not a mesh axis (%s): the batch is "
                      'replicated', axis, list(mesh_axes))
    return UNSHARDED
  size = mesh_axes[axis]
  micro = config.batch_size // config.grad_accum_steps
  if config.grad_accum_steps > 1 and micro % size:
    raise ConfigError(
        f'train.batch_size={config.batch_size} / grad_accum_steps={config.grad_accum_steps}'
        f' = {micro} examples per micro-step do not split over mesh axis '
        f"'{axis}' of size {size}", where='train.batch_size / train.grad_accum_steps',
        fix=f'make batch_size a multiple of grad_accum_steps x {size} '
            f'(e.g. {config.grad_accum_steps * size * max(1, micro // size)})')
  if config.batch_size % size:
    raise ConfigError(
        f'train.batch_size={config.batch_size} does not split over mesh axis '
        f"'{axis}' of size {size}", where='train.batch_size / mesh.shape',
        fix=f'use a multiple of {size} (e.g. {config.batch_size // size * size or size})')
  return axis
