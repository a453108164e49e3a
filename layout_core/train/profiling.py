"""A TensorFlow profiler trace of a few training steps, for TensorBoard's Profile tab.

    profiler = StepProfiler(logdir=model_dir, steps=(5, 8))   # trace steps 5, 6, 7
    for step in range(num_steps):
      profiler.before_step(step)
      loss = train_step(...)
      profiler.after_step(step, loss)     # waits for the step, then stops at 7

The trace goes to `<logdir>/plugins/profile/<timestamp>/` (`*.xplane.pb`), where
TensorBoard's profile plugin (`pip install tensorboard-plugin-profile`, not
needed to write the trace) shows every op of the traced steps per device and
thread: how the pipeline stages really overlap, measured in this run.
"""

from __future__ import annotations

from typing import Sequence

from absl import logging

from layout_core.lazy import tf


class StepProfiler:
  """Starts the profiler before step `steps[0]` and stops it after step
  `steps[1] - 1` (0-based steps, as the training loop counts them)."""

  def __init__(self, *, logdir: str | None, steps: Sequence[int] | None):
    self.logdir = logdir
    self.start, self.stop = (tuple(steps) if steps else (0, 0))
    self.active = False
    if steps and not logdir:
      logging.warning('train.profile_steps is set but the run has no model_dir: no trace')
      self.start = self.stop = 0

  def before_step(self, step: int) -> None:
    if self.stop > self.start and step == self.start and not self.active:
      tf.profiler.experimental.start(self.logdir)
      self.active = True
      logging.info('Profiling steps %d..%d into %s/plugins/profile', self.start,
                   self.stop - 1, self.logdir)

  def after_step(self, step: int, result=None) -> None:
    """`result`: a tensor of the step, read so the trace holds the step's whole work."""
    if self.active and step + 1 >= self.stop:
      if result is not None:
        from layout_core.layout.variables import to_numpy  # pylint: disable=g-import-not-at-top
        to_numpy(result)
      self.close()

  def close(self) -> None:
    if self.active:
      tf.profiler.experimental.stop()
      self.active = False
      logging.info('Profile written to %s/plugins/profile', self.logdir)
