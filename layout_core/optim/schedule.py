"""The learning-rate schedule: linear warmup, then cosine, linear or constant decay.

    lr = learning_rate(OptimizerConfig(learning_rate=3e-3, warmup_steps=50), step=10,
                       total_steps=1000)   # a float32 scalar tensor: 3e-3 * 11 / 50

Plain function of the step, so a resumed run continues the curve exactly.
"""

from __future__ import annotations

import math

from layout_core.lazy import tf
from layout_core.optim.config import OptimizerConfig


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
