"""Adafactor (Shazeer & Stern 2018), with T5X's defaults.

    optimizer = make_optimizer(OptimizerConfig(name='adafactor'), variables=..., paths=...,
                               total_steps=1000)          # layout_core.optim
    Adafactor.slot_specs((512, 2048), OptimizerConfig(name='adafactor'))
    # v_row (512,) and v_col (2048,): O(n + m) state for an n x m matrix

For a parameter whose last two dimensions are both at least
`adafactor_min_dim_to_factor` (128), the second moment is factored: a row
statistic `v_row` (shape without the last dim) and a column statistic
`v_col` (shape without the second-to-last dim), O(n + m) memory for an
n x m matrix instead of Adam's 2nm; smaller parameters keep a full `v`. At
step t (1-based), with g the (clipped) gradient:

    beta2_t = 1 - t^-decay_rate                              (decay_rate 0.8)
    v_row   = beta2_t v_row + (1 - beta2_t) mean_cols(g^2 + eps1)
    v_col   = beta2_t v_col + (1 - beta2_t) mean_rows(g^2 + eps1)
    u       = g / sqrt(v_row v_col / mean(v_row))           (unfactored: g / sqrt(v))
    u       = u / max(1, RMS(u) / clipping_threshold)         (update clipping, 1.0)
    m       = beta1 m + (1 - beta1) u; u = m                  (only with beta1 > 0; T5X: off)
    param  -= lr_t max(eps2, RMS(param)) u + lr_t weight_decay param

`lr_t` is the run's schedule (`optimizer.learning_rate`, warmup, decay); with
`multiply_by_parameter_scale` it is relative to each parameter's RMS (the
paper's relative step size, whose min(1e-2, 1/sqrt(t)) part the schedule's
warmup and decay stand in for, as in T5X). Slots take their parameter's
layout (a row statistic its row sharding), plus the state axis when
`shard_state` is on; checkpoint keys are `v_row/<path>`, `v_col/<path>`,
`v/<path>` and `m/<path>`. A stacked parameter (the SPMD engine's cells,
`lead_dims`) takes its RMS per cell, so it updates as the unstacked ones do.
"""

from __future__ import annotations

from typing import Sequence

from layout_core.lazy import tf
from layout_core.optim.base import Optimizer
from layout_core.optim.config import OptimizerConfig, SlotSpec


def factored(shape: Sequence[int], min_dim: int) -> bool:
  """Whether a parameter of `shape` keeps factored second moments."""
  return len(shape) >= 2 and shape[-1] >= min_dim and shape[-2] >= min_dim


def _rms(x, lead: int = 0):
  """Root mean square over all dims but the `lead` stacked ones (kept, as 1s
  elsewhere, so it broadcasts against x)."""
  return tf.sqrt(tf.reduce_mean(tf.square(x), axis=list(range(lead, x.shape.rank)),
                                keepdims=True))


class Adafactor(Optimizer):
  """Adafactor (module docstring)."""

  SLOT_NAMES = ('v_row', 'v_col', 'v', 'm')

  @classmethod
  def slot_specs(cls, shape: Sequence[int], config: OptimizerConfig) -> tuple[SlotSpec, ...]:
    shape = tuple(shape)
    if factored(shape, config.adafactor_min_dim_to_factor):
      slots = (SlotSpec('v_row', shape[:-1], dropped_dim=-1),
               SlotSpec('v_col', shape[:-2] + shape[-1:], dropped_dim=-2))
    else:
      slots = (SlotSpec('v', shape),)
    if config.adafactor_beta1:
      slots += (SlotSpec('m', shape),)
    return slots

  def _shared(self, step, lr):
    t = tf.cast(step, tf.float32) + 1.0
    decay = 1.0 - tf.pow(t, -self.config.adafactor_decay_rate)
    return {'decay': decay, 'one_minus_decay': 1.0 - decay}

  def _delta(self, path, grad, param, *, lr, shared):
    config, lead = self.config, self.lead_dims.get(path, 0)
    decay, one_minus_decay = shared['decay'], shared['one_minus_decay']
    squared = tf.square(grad) + config.adafactor_epsilon1
    assigns = []
    if path in self.v_row:
      v_row = decay * self.v_row[path] + one_minus_decay * tf.reduce_mean(squared, axis=-1)
      v_col = decay * self.v_col[path] + one_minus_decay * tf.reduce_mean(squared, axis=-2)
      assigns += [(self.v_row[path], v_row), (self.v_col[path], v_col)]
      row_factor = tf.math.rsqrt(v_row / tf.reduce_mean(v_row, axis=-1, keepdims=True))
      update = (grad * tf.expand_dims(row_factor, -1)
                * tf.expand_dims(tf.math.rsqrt(v_col), -2))
    else:
      v = decay * self.v[path] + one_minus_decay * squared
      assigns.append((self.v[path], v))
      update = grad * tf.math.rsqrt(v)
    if config.adafactor_clipping_threshold:
      update = update / tf.maximum(1.0, _rms(update, lead) / config.adafactor_clipping_threshold)
    if config.adafactor_beta1:
      m = config.adafactor_beta1 * self.m[path] + (1.0 - config.adafactor_beta1) * update
      assigns.append((self.m[path], m))
      update = m
    step_size = lr
    if config.adafactor_multiply_by_parameter_scale:
      step_size = lr * tf.maximum(config.adafactor_epsilon2, _rms(param, lead))
    delta = step_size * update
    if config.weight_decay:
      delta += lr * config.weight_decay * param
    return delta, assigns
