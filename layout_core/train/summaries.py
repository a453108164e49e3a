"""TensorBoard output: scalars and markdown text, written from the host.

Values are plain Python numbers fetched after a step, so summary writing never
touches the mesh. In a multi-client run only client 0 gets a real writer; the
others get a `NullWriter` with the same methods.

    writer = SummaryWriter('/tmp/run')
    writer.scalars(step=10, values={'train/loss': 2.3})
    writer.text(step=0, tag='config/gin', markdown=operative_config)

Tags written by meshgin are listed in docs/tensorboard.md ("Tags").
"""

from __future__ import annotations

import os
from typing import Mapping

from layout_core.lazy import tf


class SummaryWriter:
  """Event files in `logdir`, created at the first write: a run can be given
  its writer before it has been validated, and nothing is written until then."""

  def __init__(self, logdir: str):
    self.logdir = logdir
    self._writer = None

  def _file_writer(self):
    if self._writer is None:
      os.makedirs(self.logdir, exist_ok=True)
      with tf.device('/CPU:0'):
        self._writer = tf.summary.create_file_writer(self.logdir)
    return self._writer

  def scalars(self, *, step: int, values: Mapping[str, float]) -> None:
    with tf.device('/CPU:0'), self._file_writer().as_default(step=step):
      for tag, value in values.items():
        tf.summary.scalar(tag, float(value))

  def text(self, *, step: int, tag: str, markdown: str) -> None:
    with tf.device('/CPU:0'), self._file_writer().as_default(step=step):
      tf.summary.text(tag, markdown)

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()


class NullWriter:
  """Same interface, writes nothing (non-zero clients, dry runs)."""

  def scalars(self, *, step: int, values: Mapping[str, float]) -> None:
    del step, values

  def text(self, *, step: int, tag: str, markdown: str) -> None:
    del step, tag, markdown

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


def code_block(text: str) -> str:
  """Markdown that TensorBoard shows verbatim (indented code block)."""
  return '\n'.join('    ' + line for line in text.splitlines()) + '\n'
