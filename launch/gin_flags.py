"""Flags shared by the launchers, and how a run ends on bad config or a signal.

Flags are defined here and in the launchers' own modules only; library code
receives plain values. `run_guarded` gives every launcher the same endings:
exit 2 with one paragraph for a configuration error, exit 0 with a message
for a stop signal during start-up.
"""

from __future__ import annotations

import logging as python_logging
import os
import re
import sys
import threading
import traceback
from typing import Callable

from absl import flags
from absl import logging

import launch

from layout_core.errors import ConfigError
from plugins import run_status
from layout_core.train.preemption import Interrupted, PreemptionWatcher

GIN_FILES = flags.DEFINE_multi_string(
    'gin_file', [], 'A .gin config file; repeat to combine several (later files '
    'override earlier ones). Paths are looked up in --gin_search_paths, the '
    'current directory and the repository root.')
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


def quiet_tensorflow(*, verbose: bool) -> None:
  """Keeps TensorFlow's and DTensor's own log lines (C++ start-up notes,
  compile-cache misses, mesh listings) off the console unless --verbose.
  Called before TensorFlow is imported: its C++ side reads the variable once."""
  if verbose:
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')  # older TensorFlow's C++ logging
  logging.get_absl_handler().addFilter(_drop_tensorflow_info)
  # TF 2.21 logs through Abseil, before any setting can reach it, straight to
  # file descriptor 2: C-level writes go through a filter thread; Python's own
  # stderr keeps the real descriptor (tracebacks and our messages never wait).
  real = os.dup(2)
  read_end, write_end = os.pipe()
  os.dup2(write_end, 2)
  os.close(write_end)
  sys.stderr.flush()
  sys.stderr = os.fdopen(real, 'w', buffering=1, closefd=False)
  logging.get_absl_handler().python_handler.stream = sys.stderr

  def copy_lines():
    with os.fdopen(read_end, 'rb') as lines:
      for line in lines:
        if not _TF_NOISE.match(line):
          os.write(real, line)

  threading.Thread(target=copy_lines, name='stderr-filter', daemon=True).start()


# Info lines of TensorFlow's C++ side ('I0000 00:00:... port.cc:153] ...') and
# its fixed start-up notes; warnings and errors pass.
_TF_NOISE = re.compile(rb'I\d{4} [^\]]*\.cc:\d+\] |WARNING: All log messages before absl::InitializeLog|'
                       rb'To enable the following instructions|E\d{4} .*failed call to cuInit')


def _drop_tensorflow_info(record) -> bool:
  """TensorFlow's Python info lines (DTensor's mesh listing) stay off the console."""
  from_tensorflow = (record.name.startswith('tensorflow')
                     or f'{os.sep}tensorflow{os.sep}' in record.pathname)
  return not (from_tensorflow and record.levelno < python_logging.WARNING)


def run_guarded(body: Callable[[PreemptionWatcher], object]) -> None:
  """Runs `body(watcher)` with SIGTERM/SIGINT watched from the first moment.

  A ConfigError exits 2 with one paragraph (no traceback unless --verbose);
  a stop signal before the run starts writing exits 0 with a message."""
  quiet_tensorflow(verbose=VERBOSE.value)
  try:
    with PreemptionWatcher(immediate=True) as watcher:
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
    sys.exit(0)
