"""A real one-node Slurm for tests: munged, slurmctld and slurmd started as root
under a temporary directory, with at least 8 CPUs declared, and stopped after.

    with OneNodeSlurm(tmp_dir) as slurm:          # starts in a few seconds
      slurm.command('sbatch', '--parsable', 'job.sh')
      env = slurm.environment()                    # SLURM_CONF for subprocesses

Everything it writes (munge key and socket, slurm.conf, spool, logs) lies
under the directory, on its own free ports, so two test processes can run one
each. Needs Debian's `slurm-wlm` and `munge` (.ci/run installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

# How fast a requeued job runs again: Slurm holds it for AuthInfo's
# cred_expire (default 120 s), then the scheduler's next pass starts it.
CONFIG = """\
ClusterName=meshgin{port}
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/socket,cred_expire=5
CredType=cred/munge
SlurmctldPort={port}
SlurmdPort={slurmd_port}
StateSaveLocation={root}/spool/ctld
SlurmdSpoolDir={root}/spool/d
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
KillWait=60
MinJobAge=600
NodeName=localhost CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:16
"""

DAEMONS = ('munged', 'slurmctld', 'slurmd')
# The node declares at least this many CPUs (config_overrides: slurmd believes
# the file), so a test's srun -n 3 runs at once instead of waiting for cores.
CPUS = 8


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False


class OneNodeSlurm:
  """See the module docstring."""

  def __init__(self, root: str):
    missing = [name for name in DAEMONS + ('sbatch', 'srun') if not shutil.which(name)]
    assert not missing, (f'{", ".join(missing)} not found: the Slurm tests need '
                         '`apt-get install -y slurm-wlm munge` (as .ci/run does)')
    self.root = root
    self.conf = os.path.join(root, 'slurm.conf')
    for sub in ('munge', 'spool/ctld', 'spool/d', 'log'):
      os.makedirs(os.path.join(root, sub), exist_ok=True)
    port = _free_port()
    with open(self.conf, 'w') as f:
      f.write(CONFIG.format(root=root, port=port, slurmd_port=_free_port(),
                            cpus=max(CPUS, os.cpu_count() or 1)))

  def environment(self, base: dict | None = None) -> dict:
    return dict(os.environ if base is None else base, SLURM_CONF=self.conf)

  def command(self, *args: str, timeout: float = 60,
              check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                            env=self.environment())
    if check:
      assert result.returncode == 0, f'{" ".join(args)}: {result.stderr}'
    return result

  def start(self) -> 'OneNodeSlurm':
    munge = os.path.join(self.root, 'munge')
    with open(os.path.join(munge, 'key'), 'wb') as f:
      f.write(os.urandom(1024))
    os.chmod(os.path.join(munge, 'key'), 0o600)
    self.command('munged', '--force', f'--socket={munge}/socket', f'--key-file={munge}/key',
                 f'--pid-file={munge}/pid', f'--seed-file={munge}/seed',
                 f'--log-file={self.root}/log/munged.log')
    self.command('slurmctld')
    self.command('slurmd', '-N', 'localhost')  # the node of slurm.conf, whatever the hostname
    give_up = time.monotonic() + 60
    while True:
      state = self.command('sinfo', '-h', '-o', '%T', check=False).stdout.strip()
      if state == 'idle':
        return self
      assert time.monotonic() < give_up, f'the Slurm node never became idle ({state!r}):\n' + (
          self.log('slurmctld') + self.log('slurmd'))[-3000:]
      time.sleep(0.3)

  def log(self, daemon: str) -> str:
    try:
      with open(os.path.join(self.root, 'log', f'{daemon}.log')) as f:
        return f.read()
    except OSError:
      return ''

  def job_state(self, job_id: str) -> str:
    return self.command('squeue', '-h', '-t', 'all', '-j', job_id, '-o', '%T').stdout.strip()

  def stop(self) -> None:
    """Cancels every job, then stops the daemons (none is left running)."""
    self.command('scancel', '--user=root', check=False)
    pids = []
    for pid_file in ('slurmd.pid', 'slurmctld.pid', 'munge/pid'):
      try:
        with open(os.path.join(self.root, pid_file)) as f:
          pids.append(int(f.read().strip()))
        os.kill(pids[-1], signal.SIGTERM)
      except (OSError, ValueError):
        continue
    give_up = time.monotonic() + 10
    for pid in pids:
      while _alive(pid) and time.monotonic() < give_up:
        time.sleep(0.05)
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)

  def __enter__(self) -> 'OneNodeSlurm':
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
