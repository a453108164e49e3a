"""Flags shared by the launchers, and how a run ends on bad config or a signal.

Flags are defined here and in the launchers' own modules only; library code
receives plain values. `run_guarded` gives every launcher the same endings:
exit 2 with one paragraph for a configuration error, exit 0 with a message
for a stop signal during start-up.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable

from absl import flags

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
    'verbose', False, 'On a configuration error, also print the Python traceback.')

def parsed_config():
  """The flags' gin config, parsed (see plugins.gin_setup.parsed_config)."""
  from plugins import gin_setup  # pylint: disable=g-import-not-at-top
  return gin_setup.parsed_config(files=GIN_FILES.value, bindings=GIN_BINDINGS.value,
                                 search_paths=GIN_SEARCH_PATHS.value)


def run_guarded(body: Callable[[PreemptionWatcher], object]) -> None:
  """Runs `body(watcher)` with SIGTERM/SIGINT watched from the first moment.

  A ConfigError exits 2 with one paragraph (no traceback unless --verbose);
  a stop signal before the run starts writing exits 0 with a message."""
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
