"""Adam(W): two slots, `m` and `v`, shaped like their parameter.

    optimizer = make_optimizer(OptimizerConfig(name='adam'), variables=..., paths=...,
                               total_steps=1000)          # layout_core.optim
    Adam.slot_specs((512, 2048), OptimizerConfig())       # m and v, each (512, 2048)

At step t (1-based), with g the (clipped) gradient:

    m      = beta1 m + (1 - beta1) g
    v      = beta2 v + (1 - beta2) g^2
    param -= lr_t sqrt(1 - beta2^t) / (1 - beta1^t) (m / (sqrt(v) + eps) + weight_decay param)

Checkpoint keys are `m/<path>` and `v/<path>`.
"""

from __future__ import annotations

from typing import Sequence

from layout_core.lazy import tf
from layout_core.optim.base import Optimizer
from layout_core.optim.config import OptimizerConfig, SlotSpec


class Adam(Optimizer):
  """Adam(W) (module docstring)."""

  SLOT_NAMES = ('m', 'v')

  @classmethod
  def slot_specs(cls, shape: Sequence[int], config: OptimizerConfig) -> tuple[SlotSpec, ...]:
    return tuple(SlotSpec(name, tuple(shape)) for name in cls.SLOT_NAMES)

  def _shared(self, step, lr):
    config = self.config
    t = tf.cast(step, tf.float32) + 1.0
    correction = tf.sqrt(1.0 - config.beta2 ** t) / (1.0 - config.beta1 ** t)
    return {'step_size': lr * correction}

  def _delta(self, path, grad, param, *, lr, shared):
    config = self.config
    # Use the new moments as computed, not re-read from the slots: in the
    # training step's DTensor function, re-reading after the assign gave the
    # old values (TF 2.21: the first step moved no parameter; a small
    # stand-alone function did not show it). tests/test_optimizer.py.
    m = config.beta1 * self.m[path] + (1.0 - config.beta1) * grad
    v = config.beta2 * self.v[path] + (1.0 - config.beta2) * tf.square(grad)
    update = m / (tf.sqrt(v) + config.epsilon)
    if config.weight_decay:
      update += config.weight_decay * param
    return shared['step_size'] * update, [(self.m[path], m), (self.v[path], v)]
