"""absl entry points: `train`, `inspect`, `sweep`, `local_cluster`.

The first thing each does (in its `__main__` block, before absl parses flags
or anything heavy is imported) is `install_start_up_handlers()`: until a run
starts writing, a stop signal ends it at once with exit 0 (nothing to save,
nothing half-written). `gin_flags.run_guarded` then keeps that promise
through start-up and hands over to "finish the step and save". Importing this
package does nothing.
"""

import signal
import sys


def stop_message(signal_name: str) -> str:
  return (f'Stopped by {signal_name} during start-up, before anything was written. '
          'Run the same command to start again.')


def _stop_during_start_up(signum, frame):
  del frame
  print(stop_message(signal.Signals(signum).name), file=sys.stderr, flush=True)
  sys.exit(0)


def install_start_up_handlers() -> None:
  """SIGTERM and SIGINT end the process at once with exit 0 (start-up)."""
  for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, _stop_during_start_up)
