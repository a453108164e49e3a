"""Turning SIGTERM / SIGINT into "finish this step, save, exit cleanly".

    with PreemptionWatcher() as watcher:
      for step in ...:
        train_step()
        if watcher.requested:
          save(); break

The previous handlers are restored on exit (also on error). A second signal
while a save is under way is remembered, not fatal: the save finishes.
"""

from __future__ import annotations

import signal
import threading

from absl import logging


class PreemptionWatcher:

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.requested = False
    self.signal_name: str | None = None
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    if not self.requested:
      logging.warning('%s received: finishing the current step, then saving and '
                      'exiting', self.signal_name)
    self.requested = True

  def __enter__(self) -> 'PreemptionWatcher':
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()
