"""The `checkpoint` state file of a checkpoint directory, derived from what is on disk.

    state_file = StateFile(directory='/run/checkpoints')
    state_file.repair()             # at start: a damaged one moved aside, written anew
    state_file.forget('ckpt-100')   # this process pruned or moved it: no warning
    state_file.update()             # after every commit, prune or move aside

`tf.train.latest_checkpoint` reads this file. It is never edited, only
written anew (atomically) from the valid checkpoints in the directory, so it
never names a partial or damaged checkpoint; a checkpoint it named that
something else removed is reported once and dropped.
"""

from __future__ import annotations

import os
import re

from absl import logging

from layout_core.durable import write_atomically
from layout_core.checkpoint.damage import aside_path
from layout_core.checkpoint.files import checkpoint_dirs, validate

STATE_FILE_NAME = 'checkpoint'
_WELL_FORMED = re.compile(rb'model_checkpoint_path: "ckpt-\d+/ckpt"\n'
                          rb'(all_model_checkpoint_paths: "ckpt-\d+/ckpt"\n)+')


class StateFile:
  """The state file of `directory` (see the module doc)."""

  def __init__(self, *, directory: str):
    self.directory = directory
    self.path = os.path.join(directory, STATE_FILE_NAME)
    self._forgotten: set[str] = set()  # ckpt-N names this process moved or pruned

  def forget(self, name: str) -> None:
    """`name` (ckpt-N) was removed by this process: its absence is no news."""
    self._forgotten.add(name)

  def text(self) -> str:
    """The text format tf.train.latest_checkpoint reads, for the valid checkpoints."""
    valid = [os.path.join(os.path.basename(p), 'ckpt')
             for _, p in reversed(checkpoint_dirs(self.directory)) if validate(p) is None]
    if not valid:
      return ''
    return f'model_checkpoint_path: "{valid[-1]}"\n' + ''.join(
        f'all_model_checkpoint_paths: "{path}"\n' for path in valid)

  def repair(self) -> None:
    """A state file that does not match the valid checkpoints is written
    anew; a malformed one is reported and moved aside first."""
    if not os.path.exists(self.path):
      return
    with open(self.path, 'rb') as f:
      content = f.read()
    if content == self.text().encode():
      return
    if not _WELL_FORMED.fullmatch(content):
      aside = aside_path(self.path)
      logging.error('Checkpoint state file %s is damaged; moved it to %s and wrote it '
                    'anew from the valid checkpoints.', self.path, aside)
      os.rename(self.path, aside)
    self.update()

  def update(self) -> None:
    """Writes the state file anew from the checkpoints on disk; one it listed
    that is gone (removed by something else) is dropped, with a warning."""
    try:
      with open(self.path) as f:
        listed = re.findall(r'all_model_checkpoint_paths: "(ckpt-\d+)/ckpt"', f.read())
    except OSError:
      listed = []
    for name in listed:
      if name not in self._forgotten and not os.path.isdir(os.path.join(self.directory, name)):
        logging.warning('Checkpoint %s, listed in %s, was removed by something else; '
                        'dropped it from the list', os.path.join(self.directory, name),
                        self.path)
    text = self.text()
    if text:
      write_atomically(self.path, text.encode())
    elif listed:  # every checkpoint it named is gone
      os.remove(self.path)
