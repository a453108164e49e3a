"""Flags shared by the launchers, and how a run ends on bad config or a signal.

Flags are defined here and in the launchers' own modules only; library code
receives plain values. `run_guarded` gives every launcher the same endings:
exit 2 with one paragraph for a configuration error, exit 0 with a message
for a stop signal during start-up, and a quiet console (TensorFlow's info
lines filtered out unless --verbose; see `quiet_tensorflow`).
"""

from __future__ import annotations

import atexit
import logging as python_logging
import os
import subprocess
import sys
import traceback
from typing import Callable

from absl import flags
from absl import logging

import launch
from launch import stderr_filter

from layout_core.errors import ConfigError
from plugins import run_status
from layout_core.train.preemption import Interrupted, PreemptionWatcher

GIN_FILES = flags.DEFINE_multi_string(
    'gin_file', [], 'A .gin config file; repeat to combine several (later files '
    'override earlier ones). Looked up in the current directory, then in the configs '
    'that ship with meshgin (configs/...), then in --gin_search_paths.')
GIN_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], "One gin binding, e.g. 'train.num_steps = 100'; repeat "
    'for more. Applied after all --gin_file files.')
GIN_SEARCH_PATHS = flags.DEFINE_list(
    'gin_search_paths', [], 'Comma-separated directories to search for '
    '--gin_file and include statements.')
VERBOSE = flags.DEFINE_bool(
    'verbose', False, 'On a configuration error, also print the Python traceback; '
    'show TensorFlow\'s and DTensor\'s own log lines (hidden by default).')

def parsed_config():
  """The flags' gin config, parsed (see plugins.gin_setup.parsed_config)."""
  from plugins import gin_setup  # pylint: disable=g-import-not-at-top
  return gin_setup.parsed_config(files=GIN_FILES.value, bindings=GIN_BINDINGS.value,
                                 search_paths=GIN_SEARCH_PATHS.value)


def quiet_tensorflow(*, verbose: bool) -> subprocess.Popen | None:
  """Keeps TensorFlow's and DTensor's own log lines (C++ start-up notes,
  compile-cache misses, mesh listings) off the console unless --verbose.
  Called before TensorFlow is imported: its C++ side reads the variable once.

  TF 2.21 logs through Abseil, before any setting can reach it, straight to
  file descriptor 2, so fd 2 becomes a pipe into a filter process
  (launch/stderr_filter.py says why a process, not a thread) that copies all
  but the info noise to the real stderr. Python's own stderr keeps the real
  descriptor: tracebacks and our messages never depend on the filter. Returns
  the filter process (None: --verbose, or it could not start and the console
  stays unfiltered)."""
  if verbose:
    return None
  if 'TF_CPP_MIN_LOG_LEVEL' not in os.environ:  # older TensorFlow's C++ logging
    os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
    _SET_BY_QUIETING.add('TF_CPP_MIN_LOG_LEVEL')
  logging.get_absl_handler().addFilter(_drop_tensorflow_info)
  sys.stderr.flush()
  real = os.dup(2)
  read_end, write_end = os.pipe()
  try:
    # Its own session: a Ctrl-C or a sweep's signal to the launcher's process
    # group does not end it before the launcher's last lines are out.
    filter_process = subprocess.Popen(
        [sys.executable, '-I', '-S', stderr_filter.__file__], stdin=read_end,
        stdout=real, stderr=real, close_fds=True, start_new_session=True)
  except OSError as error:
    for descriptor in (real, read_end, write_end):
      os.close(descriptor)
    logging.warning('TensorFlow\'s log stays unfiltered: the stderr filter did not '
                    'start (%s)', error)
    return None
  os.close(read_end)  # the filter's alone: if it dies, writers get EPIPE, never block
  os.dup2(write_end, 2)
  os.close(write_end)
  sys.stderr = os.fdopen(real, 'w', buffering=1, closefd=False)
  logging.get_absl_handler().python_handler.stream = sys.stderr
  atexit.register(_finish_filtering, filter_process=filter_process, real=real)
  return filter_process


def _finish_filtering(*, filter_process: subprocess.Popen, real: int) -> None:
  """At a normal exit: fd 2 back to the real stderr (closing this process's
  end of the pipe), then a short wait until the filter has copied the last
  lines, so whoever reads this process's output sees them before it ends. An
  abort skips this; the filter still drains the pipe on its own."""
  os.dup2(real, 2)
  try:
    filter_process.wait(timeout=5)
  except subprocess.TimeoutExpired:
    pass  # a child of this process still holds the pipe: the filter stays for it


# The variables quiet_tensorflow set for this process's TensorFlow only; a
# launcher's children (sweep trials) quiet themselves, or not, as they are asked.
_SET_BY_QUIETING: set[str] = set()


def environment_for_children() -> dict[str, str]:
  """This process's environment without what quiet_tensorflow added to it."""
  return {name: value for name, value in os.environ.items()
          if name not in _SET_BY_QUIETING}


def _drop_tensorflow_info(record) -> bool:
  """TensorFlow's Python info lines (DTensor's mesh listing) stay off the console."""
  from_tensorflow = (record.name.startswith('tensorflow')
                     or f'{os.sep}tensorflow{os.sep}' in record.pathname)
  return not (from_tensorflow and record.levelno < python_logging.WARNING)


def require_model_dir(model_dir: str | None, what: str) -> None:
  """--model_dir has no default: one would quietly resume whatever used it last."""
  if not model_dir:
    raise ConfigError(f'--model_dir is not given: {what} needs its own directory, '
                      'which it resumes from when run again', where='the command line',
                      fix='add --model_dir=runs/<name>: a new directory starts afresh, '
                      'the directory given before resumes')


def run_guarded(body: Callable[[PreemptionWatcher], object]) -> None:
  """Runs `body(watcher)` with SIGTERM/SIGINT watched from the first moment.

  A ConfigError exits 2 with one paragraph (no traceback unless --verbose);
  a stop signal before the run starts writing exits 0 with a message."""
  quiet_tensorflow(verbose=VERBOSE.value)
  watcher = PreemptionWatcher(immediate=True)
  try:
    with watcher:
      body(watcher)
  except ConfigError as error:
    if VERBOSE.value:
      traceback.print_exc()
    message = ' '.join(str(error).split())
    print(f'\nConfiguration error: {message}\n(run with --verbose for the '
          'traceback)', file=sys.stderr)
    sys.exit(run_status.EXIT_CONFIG_ERROR)
  except Interrupted as stop:
    print(launch.stop_message(stop.signal_name), file=sys.stderr, flush=True)
    sys.exit(launch.stopped_status())
  except Exception:  # pylint: disable=broad-except
    if not watcher.stopped_during_start_up:
      raise
    # The stop, turned into another error by code it crossed (numpy's C
    # import turns it into an ImportError).
    print(launch.stop_message(watcher.signal_name), file=sys.stderr, flush=True)
    sys.exit(launch.stopped_status())
