"""absl entry points. The first thing any launcher does is catch SIGTERM and
SIGINT: until a run starts writing, a stop signal ends it at once with exit 0
(nothing to save, nothing half-written). `gin_flags.run_guarded` then keeps
that promise through start-up and hands over to "finish the step and save".
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


for _signal in (signal.SIGTERM, signal.SIGINT):
  signal.signal(_signal, _stop_during_start_up)
