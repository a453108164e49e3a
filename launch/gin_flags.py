"""Flags shared by the launchers, and the exit-code-2 handling of bad config.

Flags are defined here and in the launchers' own modules only; library code
receives plain values.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable

from absl import flags, logging

from layout_core.errors import ConfigError

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

EXIT_CONFIG_ERROR = 2


def run_guarded(body: Callable[[], object]) -> None:
  """Runs `body`; a ConfigError (or gin's required-binding error) exits 2."""
  from plugins.gin_setup import explain_gin_error  # pylint: disable=g-import-not-at-top
  try:
    body()
  except (ConfigError, RuntimeError) as e:
    if isinstance(e, RuntimeError) and 'Required bindings' not in str(e):
      raise
    error = e if isinstance(e, ConfigError) else explain_gin_error(e)
    if VERBOSE.value:
      traceback.print_exc()
    message = ' '.join(str(error).split())
    logging.error('Configuration error: %s', message)
    print(f'\nConfiguration error: {message}\n(run with --verbose for the '
          'traceback)', file=sys.stderr)
    sys.exit(EXIT_CONFIG_ERROR)
