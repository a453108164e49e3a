"""Adam with global-norm clipping and a warmup + decay learning-rate schedule.

Slot variables are created with exactly their parameter's layout (a sharded
weight gets sharded moments), keyed by the parameter's path so checkpoints can
be mapped by name:

    adam = Adam(OptimizerConfig(learning_rate=3e-3), variables=model.trainable_variables,
                total_steps=1000)
    lr, grad_norm = adam.apply(grads, step)   # inside a tf.function

Written here rather than taken from Keras because Keras 3 optimizers do not
build DTensor slot variables. With parameters on several meshes (pipeline
stages), call `update` once per mesh with that mesh's parameters, and the
global gradient norm and step as scalars on that mesh:

    lr = adam.update(stage_paths, stage_grads, step=step_on_mesh, norm=norm_on_mesh)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


from layout_core.lazy import Module, tf, dtensor
from layout_core.errors import ConfigError
from layout_core.fields import at_least, check_types, in_range
from layout_core.layout.variables import quiet_one_shot_traces

DECAYS = ('cosine', 'linear', 'constant')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  learning_rate: float = 3e-3       # peak, reached after warmup
  warmup_steps: int = 50            # linear warmup from 0
  decay: str = 'cosine'             # after warmup: cosine | linear | constant
  final_learning_rate_ratio: float = 0.1  # lr at the last step / peak lr
  beta1: float = 0.9
  beta2: float = 0.99
  epsilon: float = 1e-8
  weight_decay: float = 0.0         # decoupled (AdamW), on every parameter
  clip_norm: float = 1.0            # global-norm clipping; 0 disables

  def __post_init__(self):
    check_types(self, name='optimizer')
    if self.decay not in DECAYS:
      raise ConfigError(f'optimizer.decay is {self.decay!r}', where='optimizer.decay',
                        fix=f"use one of {', '.join(map(repr, DECAYS))}")
    if not self.learning_rate > 0:
      raise ConfigError(f'optimizer.learning_rate is {self.learning_rate}',
                        where='optimizer.learning_rate', fix='use a positive learning rate')
    at_least(self, 'optimizer', warmup_steps=0, weight_decay=0, clip_norm=0)
    in_range(self.final_learning_rate_ratio, parameter='optimizer.final_learning_rate_ratio',
             low=0, high=1)
    for beta in ('beta1', 'beta2'):
      in_range(getattr(self, beta), parameter=f'optimizer.{beta}', low=0, high=1,
               high_open=True)
    in_range(self.epsilon, parameter='optimizer.epsilon', low=0, high=1, low_open=True)


def learning_rate(config: OptimizerConfig, step, total_steps: int) -> tf.Tensor:
  """Schedule value at `step` (0-based); a float32 scalar tensor."""
  step = tf.cast(step, tf.float32)
  warmup = float(max(config.warmup_steps, 0))
  peak = config.learning_rate
  warm = peak * tf.minimum(1.0, (step + 1.0) / max(warmup, 1.0))
  span = max(total_steps - warmup, 1.0)
  progress = tf.clip_by_value((step - warmup) / span, 0.0, 1.0)
  floor = config.final_learning_rate_ratio
  if config.decay == 'cosine':
    factor = floor + (1.0 - floor) * 0.5 * (1.0 + tf.cos(math.pi * progress))
  elif config.decay == 'linear':
    factor = 1.0 - (1.0 - floor) * progress
  else:
    factor = tf.ones_like(progress)
  return tf.where(step < warmup, warm, peak * factor)


def _zeros_like(variable: tf.Variable, name: str) -> tf.Variable:
  layout = getattr(variable, 'layout', None)
  shape, dtype = variable.shape.as_list(), variable.dtype
  if layout is None:
    return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)
  init = tf.function(lambda: tf.zeros(shape, dtype), autograph=False)
  return dtensor.DVariable(dtensor.call_with_layout(init, layout),
                           trainable=False, name=name)


def squared_norm(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """Sum of squares over all grads (all on one mesh)."""
  return tf.add_n([tf.reduce_sum(tf.square(tf.convert_to_tensor(g))) for g in grads])


def global_norm(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  return tf.sqrt(squared_norm(grads))


@dataclasses.dataclass
class _Targets:
  variables: dict  # path -> parameter


class Adam(Module):
  """Adam(W) whose slots mirror each parameter's layout (see module docstring)."""

  def __init__(self, config: OptimizerConfig, *, variables: Sequence[tf.Variable],
               paths: Sequence[str], total_steps: int):
    super().__init__(name='adam')
    if len(paths) != len(variables):
      raise ValueError(f'{len(paths)} paths for {len(variables)} variables')
    self.config = config
    self.total_steps = total_steps
    # A plain holder, so the parameters are not tracked (and checkpointed) twice.
    self._targets = _Targets(dict(zip(paths, variables)))
    with quiet_one_shot_traces():
      self.m = {p: _zeros_like(v, f'{p}/m') for p, v in zip(paths, variables)}
      self.v = {p: _zeros_like(v, f'{p}/v') for p, v in zip(paths, variables)}

  def apply(self, grads: Sequence[tf.Tensor], step: tf.Tensor):
    """One update of every parameter (all on one mesh) at 0-based `step`;
    returns (learning_rate, pre-clip global grad norm)."""
    grads = [tf.convert_to_tensor(g) for g in grads]
    norm = global_norm(grads)
    return self.update(list(self._targets.variables), grads, step=step, norm=norm), norm

  def update(self, paths: Sequence[str], grads: Sequence[tf.Tensor], *, step: tf.Tensor,
             norm: tf.Tensor) -> tf.Tensor:
    """Updates the parameters at `paths`; `norm` is the global (all-parameter)
    gradient norm used for clipping. Returns the learning rate."""
    config = self.config
    lr = learning_rate(config, step, self.total_steps)
    t = tf.cast(step, tf.float32) + 1.0
    correction = tf.sqrt(1.0 - config.beta2 ** t) / (1.0 - config.beta1 ** t)
    scale = tf.minimum(1.0, config.clip_norm / (norm + 1e-12)) if config.clip_norm else None
    for path, grad in zip(paths, grads):
      variable = self._targets.variables[path]
      grad = tf.convert_to_tensor(grad)
      layout = getattr(variable, 'layout', None)
      if layout is not None:
        grad = dtensor.relayout(grad, layout)
      if scale is not None:
        grad = grad * scale
      # Use the new moments as computed, not re-read from the slots: in the
      # training step's DTensor function, re-reading after the assign gave the
      # old values (TF 2.21: the first step moved no parameter; a small
      # stand-alone function did not show it). tests/test_optimizer.py.
      m = config.beta1 * self.m[path] + (1.0 - config.beta1) * grad
      v = config.beta2 * self.v[path] + (1.0 - config.beta2) * tf.square(grad)
      self.m[path].assign(m)
      self.v[path].assign(v)
      update = m / (tf.sqrt(v) + config.epsilon)
      if config.weight_decay:
        update += config.weight_decay * variable
      variable.assign_sub(lr * correction * update)
    return lr
