"""The `python` of the runs the zygote forks: their own runs forked too.

Some runs the tests launch start runs of their own: `launch.local_cluster`
a `launch.train` per client, `launch.inspect --suggest` one per candidate
it measures, `launch.sweep` one per trial attempt. Each did so as
`sys.executable -m launch.train ...`, a fresh interpreter paying
TensorFlow's import again (6 CPU-s here), dozens of times a suite. Such a
run forked from the zygote has this shim as its `sys.executable`
(tests/zygote.py writes it next to the zygote's socket, and says which
launchers get it), so those commands come here first:

* `[-u] -m launch.X args...` whose environment the zygote can take (the same
  import-time variables; a `PYTHONPATH` naming the same directories) is
  forked from the zygote like a test's own run: same argv, working
  directory, environment and output descriptors. The shim stays as the
  process its parent started and waits on: it passes on every signal it
  can catch, exits with the run's status (or dies of its signal), and a
  SIGKILL to the shim closes its connection, on which the zygote kills the
  run and what it started in its session. The run's CPU seconds go to the
  zygote's spool, which tests/cpu_ledger.py charges to the test.
* anything else (`-c`, `-I`, another module, a refused fork) becomes the
  real interpreter with the same arguments (`os.execv`): what the command
  would have run. So does a run Slurm started (`SLURM_JOB_ID` set: a sweep
  trial submitted with `--launcher=slurm`): it stays Slurm's process, in its
  job, where Slurm's signals and limits reach it.

The shim runs with `python -IS` and imports only the standard library and
tests.zygote (no TensorFlow): about 40 ms.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Sequence

from tests import zygote

# The modules it forks: the launchers, and tests/test_runner.py's probe.
FORKED = ('launch.', 'tests.fixtures.zygote_probe')
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
           signal.SIGUSR2)


def forkable(argv: Sequence[str]) -> tuple[list[str], bool] | None:
  """([module, args...], unbuffered) for `[-u] -m MODULE args...` of a
  module in FORKED, else None."""
  flags = []
  for i, word in enumerate(argv):
    if word == '-m' and i + 1 < len(argv):
      module = argv[i + 1]
      if module.startswith(FORKED) and set(flags) <= {'-u'}:
        return [module, *argv[i + 2:]], '-u' in flags
      return None
    flags.append(word)
  return None


def main(config_path: str, argv: Sequence[str]) -> None:
  with open(config_path, encoding='utf-8') as f:
    config = json.load(f)
  become_python = lambda: os.execv(config['python'], [config['python'], *argv])  # noqa: E731
  run = forkable(argv)
  env = dict(os.environ)
  if run is None or 'SLURM_JOB_ID' in env or zygote.differs_at_import(env, config['env']):
    become_python()
  module_argv, unbuffered = run
  try:
    conn, pid, pending = zygote.request(
        config['socket'], {'argv': module_argv, 'cwd': os.getcwd(), 'env': env,
                           'unbuffered': unbuffered, 'new_session': True}, [1, 2])
  except zygote.ZygoteUnavailable:
    become_python()
  forked = zygote.Forked(conn, pid, pending, stdout=None, argv=module_argv)
  for signum in RELAYED:
    signal.signal(signum, lambda signum, _: forked.send_signal(signum))
  code = forked.wait()
  if forked.cpu is not None:
    with open(config['spool'], 'a', encoding='utf-8') as f:
      f.write(json.dumps({'cpu': forked.cpu, 'argv': module_argv}) + '\n')
  if code < 0:  # died of a signal: so does the shim, as its parent expects
    if -code != signal.SIGKILL:  # the one signal whose handling cannot be set (nor caught)
      signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  sys.exit(code)
