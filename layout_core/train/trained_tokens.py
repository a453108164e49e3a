"""Nothing trained is an error, not a number: batches whose loss mask is all off.

    check_first_batches(task, batch_size=8)   # before training: a ConfigError
    watch = UntrainedBatches(task)            # in the loop, on every host batch:
    watch.see(step=12, batch=batch, reader=reader)   # logs a warning at once

A task that masks its loss (`Task.trained_targets`, e.g. the instruct task,
whose answers a short `seq_len` can cut away) can give a batch with no
trained target: its loss and gradient are 0, and an eval split of such
batches reports a loss of 0. The first train batch and the first eval batch
are read on the host before anything is written (numpy, no TensorFlow step),
and one without a trained target stops the run with the task's reason
(`Task.untrained_reason`: the setting to change and the value that trains);
a later train batch without one is counted and warned about in the loop's
log when it is read. A task whose `trained_targets` is None is not checked.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.tasks import Task
from layout_core.tasks.base import SPLITS


def check_first_batches(task: Task, *, batch_size: int) -> None:
  """ConfigError when the first global batch of the train or the eval split
  holds no trained target. Each split's batch is read from a fresh reader
  over all rows (every client of a run reads the same, so all stop alike).
  A task that keeps `Task.trained_targets` (counts nothing) is not read."""
  if type(task).trained_targets is Task.trained_targets:
    return  # every batch trains: no file is opened for nothing
  for split in SPLITS:
    reader = task.reader(split=split, batch_size=batch_size)
    batch = next(reader)
    if task.trained_targets(batch) == 0:
      why, where, fix = task.untrained_reason(reader)
      consequence = ('training would learn nothing (every step\'s gradient is 0)'
                     if split == 'train' else 'its eval loss would be 0, meaning nothing')
      raise ConfigError(f'the first {split} batch ({_rows(batch)} rows) holds no trained '
                        f'token (no target where the loss mask is on): {why}; {consequence}',
                        where=where, fix=fix)


class UntrainedBatches:
  """Counts the train batches with no trained target and warns at each."""

  def __init__(self, task: Task):
    self.task = task
    self.count = 0

  def see(self, *, step: int, batch: Mapping[str, np.ndarray], reader) -> None:
    """Checks the host batch of `step` (the step it trains, from 0): a
    warning, with the task's reason and fix, when it trains nothing."""
    if self.task.trained_targets(batch) != 0:
      return
    self.count += 1
    why, _, fix = self.task.untrained_reason(reader)
    # A client reads only its own rows of the global batch: it speaks for those.
    logging.warning('the rows of the train batch of step %d this process read hold no '
                    'trained token, so they teach that step nothing (%d such batch(es) in '
                    'this run so far): %s. To train on every batch: %s', step + 1,
                    self.count, why, fix)


def _rows(batch: Mapping[str, np.ndarray]) -> int:
  return len(next(iter(batch.values())))
