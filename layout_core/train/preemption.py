"""Turning SIGTERM / SIGINT / SIGUSR1 into a clean stop at any moment of a run.

During start-up (parsing, importing TensorFlow, building, restoring) nothing
has been written yet, so a signal stops the process at once: the handler
raises `Interrupted`, which the launcher turns into a message and exit 0.
Once the run starts writing, `defer()` switches to "finish the current step,
save, exit cleanly":

    with PreemptionWatcher(immediate=True) as watcher:   # signals raise Interrupted
      plan, trainer = ...
      watcher.defer()                                    # from here: a flag
      for step in ...:
        train_step()
        if watcher.requested:
          save(); break

The previous handlers are restored on exit (also on error). A second signal
while a save is under way is remembered, not fatal: the save finishes.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from absl import logging


class Interrupted(BaseException):
  """A stop signal during start-up (a BaseException, so `except Exception`
  in library code does not swallow it)."""

  def __init__(self, signal_name: str):
    super().__init__(signal_name)
    self.signal_name = signal_name


class PreemptionWatcher:

  # SIGUSR1: the signal Slurm users often ask for before the time limit
  # (`sbatch --signal=USR1@120`); its default action would kill the run unsaved.
  SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

  def __init__(self, *, immediate: bool = False):
    self.requested = False
    self.signal_name: str | None = None
    self._immediate = immediate
    self._holding = False
    self._previous = {}

  def _handle(self, signum, frame) -> None:
    del frame
    self.signal_name = signal.Signals(signum).name
    if self._immediate:
      if self._holding:
        return  # `uninterrupted`: raised when its block ends
      raise Interrupted(self.signal_name)
    first = not self.requested
    self.requested = True  # before any I/O: the stop stands whatever the note does
    if first:
      logging.warning('%s received: finishing the current step, then saving and '
                      'exiting', self.signal_name)

  def reinstall(self) -> None:
    """Takes the signals back: TensorFlow installs its own SIGTERM handler when
    it initialises its devices (and drops the SIGINT one), which would end the
    process with status 143 and no message."""
    if self._previous:
      for signum in self.SIGNALS:
        signal.signal(signum, self._handle)

  @property
  def stopped_during_start_up(self) -> bool:
    """A signal arrived while signals still stopped the run at once. The
    `Interrupted` it raised may have been turned into another error (or
    swallowed) by code it crossed, e.g. a C extension's import."""
    return self.signal_name is not None and self._immediate

  @contextlib.contextmanager
  def uninterrupted(self):
    """A start-up step that must happen whole (taking the model_dir's lock
    and registering its release): a start-up signal inside it raises
    `Interrupted` when the block ends, not in the middle."""
    self._holding = True
    try:
      yield
    finally:
      self._holding = False
    if self.stopped_during_start_up:
      raise Interrupted(self.signal_name)

  def defer(self) -> None:
    """From now on a signal only sets `requested` (see module docstring).
    Raises `Interrupted` if a start-up signal's exception got lost on its way."""
    if self.stopped_during_start_up:
      raise Interrupted(self.signal_name)
    self._immediate = False

  def __enter__(self) -> 'PreemptionWatcher':
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()
