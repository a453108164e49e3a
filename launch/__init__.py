"""absl entry points: `train`, `inspect`, `sweep`, `local_cluster`, `prepare_data`;
using a trained model: `eval`, `decode`, `export`, `lm_eval`.

The first thing each does (in its `__main__` block, before absl parses flags
or anything heavy is imported) is `install_start_up_handlers()`: until a run
starts writing, a stop signal ends it at once with exit 0 (nothing to save,
nothing half-written). `gin_flags.run_guarded` then keeps that promise
through start-up and hands over to "finish the step and save". Each parses
its flags with `parse_flags`: a flag absl cannot parse, or one out of its
range, ends it with exit 2 (a configuration error) before anything loads.
Importing this package does nothing.
"""

import atexit
import faulthandler
import gc
import os
import signal
import sys


def stop_message(signal_name: str) -> str:
  return (f'Stopped by {signal_name} during start-up, before anything was written. '
          'Run the same command to start again.')


# layout_core.layout.scheduler.SOURCES, not imported: `stopped_status` runs in a
# start-up signal handler, before meshgin's library is loaded.
SCHEDULERS = ('slurm', 'tf_config')


def stopped_status(argv: list[str] | None = None) -> int:
  """The exit status of a run stopped before it trained: 0, or under a
  scheduler (--cluster=slurm / tf_config) 143, which asks it to run the job
  again: a job preempted while starting is not done."""
  argv = sys.argv if argv is None else argv
  for number, arg in enumerate(argv):
    value = (arg.split('=', 1)[1] if arg.startswith('--cluster=') else
             argv[number + 1] if arg == '--cluster' and number + 1 < len(argv) else None)
    if value in SCHEDULERS:
      from plugins.run_status import EXIT_REQUEUE  # pylint: disable=g-import-not-at-top
      return EXIT_REQUEUE
  return 0


def _stop_during_start_up(signum, frame):
  """Leaves at once: nothing is written yet, so nothing needs unwinding, and an
  exception raised here could land inside a C extension's import (numpy turns
  it into an ImportError, exit 1 with a traceback)."""
  del frame
  print(stop_message(signal.Signals(signum).name), file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(stopped_status())  # pylint: disable=protected-access


def install_start_up_handlers() -> None:
  """SIGTERM, SIGINT and SIGUSR1 end the process at once with exit 0 (start-up;
  143 under a scheduler, see `stopped_status`). SIGUSR2, for the whole run,
  prints every thread's Python stack to stderr and changes nothing else: a run
  that seems stuck says where (`kill -USR2 <pid>`). At exit, once every
  other exit handler has run (this one is registered first, so it runs
  last), the interpreter's last garbage collection is skipped: after a run
  it walked TensorFlow's traced graphs for seconds (8.8 s of the
  quickstart's exit on a loaded 2-core machine, `gc_collect_main` all the
  while) to free memory the process is about to give back whole. Files,
  writers and locks are closed by their owners before that, as the tests'
  runs show: they end through `os._exit` after the exit handlers
  (tests/zygote.py)."""
  atexit.register(gc.freeze)
  for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(signum, _stop_during_start_up)
  faulthandler.register(signal.SIGUSR2, all_threads=True)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing for `app.run(main, flags_parser=launch.parse_flags)`:
  a value it cannot parse (`--temperature=abc`) or one out of range
  (`--batch_size=0`) exits 2, as every other configuration error
  (plugins.run_status.EXIT_CONFIG_ERROR), not absl's 1."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    sys.stderr.write(f'FATAL Flags parsing error: {error}\n'
                     'Pass --helpshort or --helpfull to see help on flags.\n')
    sys.exit(2)
