"""Sweep trials as Slurm jobs: each attempt of each trial is one `sbatch` job.

    launcher = SlurmLauncher(partition='gpu', tasks=2, sbatch_args=['--gres=gpu:4'])
    records = SweepRunner(sweep, parallel=8, launcher=launcher).run()
    # the same from the command line:
    #   python -m launch.sweep ... --launcher=slurm --slurm_partition=gpu --slurm_tasks=2

Everything else is the local sweep's (`driver.SweepRunner`): trial directories,
`sweep_trial.json`, resume, outcomes read from `run_status.json`, HParams
sessions, the results table. Each attempt writes `slurm_job.sh` into its trial
directory:

    #!/bin/bash
    srun python -m launch.train <the trial's flags> --cluster=slurm
    status=$?
    echo "$SLURM_JOB_ID $status" > <trial dir>/slurm_exit
    exit $status

and submits it with `sbatch --parsable --job-name=<sweep>/<trial>
--output=<trial dir>/trial.log --open-mode=append --chdir=<where the sweep started>
--ntasks=N [--partition=P] [--cpus-per-task=C] [--time=M] <extra args>`,
in the trial environment the runner builds (the CPU threads are not divided:
a job has its own allocation).

Why `sbatch` directly, one job per trial attempt:

* not a job array: a trial is resubmitted (resume), cancelled (stop) and
  adopted (a re-run finds it still queued) on its own, which with one job each
  is one job id per trial and no array-index bookkeeping;
* not submitit: the project's dependencies are fixed (tensorflow, gin-config,
  absl-py, tensorboard, pytest), and a batch script plus `squeue` and `scancel`
  need nothing more: what a trial did is in its trial.log and run_status.json.

Why `srun` inside the script: `scancel --signal=TERM <job>` (without --full)
signals the job's steps, never its batch shell, so the training must be a step.
It then saves a checkpoint, writes run_status 'preempted' and exits 143
(`run_status.EXIT_REQUEUE`); the shell, still alive, records that status.

Polling is one `squeue` call for all the sweep's live jobs, at most once a
second. A job squeue no longer knows (Slurm forgets a job MinJobAge after it
ends, e.g. one an earlier sweep left running) has ended: its outcome is read
from `slurm_exit` and run_status.json like any other's. A trial's clock (for
`--trial_timeout` and its wall time) starts when its job runs, not while it
waits in the queue; with a timeout the job also gets `--time`, the timeout
plus the stop grace in whole minutes, as the scheduler's hard backstop.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from typing import Any, Mapping, Sequence

from layout_core.errors import ConfigError
from plugins.sweep.spec import Trial
from plugins.sweep.trial_process import LOG_FILE, write_attempt_header

SCRIPT_FILE = 'slurm_job.sh'  # in each trial directory: the batch script of its last attempt
EXIT_FILE = 'slurm_exit'      # in each trial directory: "<job id> <srun's exit status>"
COMMANDS = ('sbatch', 'squeue', 'scancel')
ON_STOP = ('cancel', 'leave')
CLUSTER_FLAG = '--cluster=slurm'  # launch.train takes its clients from Slurm's variables
PENDING, RUNNING = 'PENDING', 'RUNNING'
GONE = 'GONE'  # no longer listed by squeue: finished long enough ago to be forgotten
FORGOTTEN = 'Invalid job id specified'  # squeue's answer for one job it does not know
TERMINAL_STATES = frozenset({'COMPLETED', 'FAILED', 'CANCELLED', 'TIMEOUT', 'NODE_FAIL',
                             'PREEMPTED', 'OUT_OF_MEMORY', 'BOOT_FAIL', 'DEADLINE', GONE})
# A job that waits again after it ran (requeued by the cluster's own policy).
REQUEUED_STATES = frozenset({PENDING, 'REQUEUED', 'REQUEUE_HOLD', 'REQUEUE_FED'})
_HEADER = re.compile(r'^===== sweep attempt \d+, .*$', re.M)


def time_limit_minutes(trial_timeout: float, stop_grace: float) -> int | None:
  """sbatch's --time for a sweep's --trial_timeout (None: no timeout, no limit)."""
  if trial_timeout <= 0:
    return None
  return math.ceil((trial_timeout + stop_grace) / 60)


def seconds_used(text: str) -> float:
  """squeue's %M ('5', '1:05', '2:01:05', '1-02:01:05') in seconds; 0 if unreadable."""
  days, _, clock = text.rpartition('-')
  try:
    seconds = 0.0
    for part in clock.split(':'):
      seconds = seconds * 60 + int(part)
    return seconds + 86400 * int(days or 0)
  except ValueError:
    return 0.0


class SlurmLauncher:
  """Submits, watches and stops the sweep's Slurm jobs; see the module docstring."""
  kind = 'slurm'
  shares_machine = False  # each job has its own allocation: no thread division

  def __init__(self, *, partition: str | None = None, tasks: int = 1,
               cpus_per_task: int | None = None, sbatch_args: Sequence[str] = (),
               on_stop: str = 'cancel', time_limit_minutes: int | None = None,
               workdir: str | None = None,
               environment: Mapping[str, str] | None = None, poll_seconds: float = 1.0):
    self.partition = partition or None
    self.tasks = tasks                        # tasks (launch.train clients) per trial
    self.cpus_per_task = cpus_per_task
    self.sbatch_args = list(sbatch_args)      # passed to sbatch as written
    self.on_stop = on_stop                    # 'cancel' or 'leave' the jobs on a stop
    self.time_limit_minutes = time_limit_minutes
    # The jobs' --chdir: where the sweep was started, as for local trials, so
    # relative --gin_file paths mean the same (meshgin itself is found through
    # PYTHONPATH, checkout or installed).
    self.workdir = os.getcwd() if workdir is None else workdir
    # For squeue, scancel and the option check: the launcher's environment
    # (SLURM_CONF and PATH as the user has them); sbatch gets each trial's.
    self.environment = dict(os.environ if environment is None else environment)
    self.poll_seconds = max(1.0, poll_seconds)
    if tasks < 1:
      raise ConfigError(f'--slurm_tasks is {tasks}', where='--slurm_tasks',
                        fix='give each trial at least 1 task')
    if cpus_per_task is not None and cpus_per_task < 1:
      raise ConfigError(f'--slurm_cpus_per_task is {cpus_per_task}',
                        where='--slurm_cpus_per_task', fix='leave it out or give 1 or more')
    if on_stop not in ON_STOP:
      raise ConfigError(f'--slurm_on_stop is {on_stop!r}', where='--slurm_on_stop',
                        fix=f'use one of {", ".join(ON_STOP)}')
    path = self.environment.get('PATH', os.defpath)
    self.binaries = {name: shutil.which(name, path=path) for name in COMMANDS}
    missing = [name for name, found in self.binaries.items() if not found]
    if missing:
      raise ConfigError(
          f'{", ".join(missing)} not found on PATH ({path}): a Slurm sweep submits with '
          'sbatch, watches with squeue and stops with scancel', where='--launcher=slurm',
          fix='run the sweep on a Slurm login node, put the Slurm commands on PATH, '
              'or use --launcher=local')
    self._states: dict[str, tuple[str, float]] = {}  # job id -> (state, seconds run)
    self._watched: set[str] = set()                  # job ids not yet seen finished
    self._polled_at = -math.inf

  @property
  def leaves_trials_on_stop(self) -> bool:
    return self.on_stop == 'leave'

  def to_json(self) -> dict[str, Any]:
    return {'kind': self.kind, 'partition': self.partition, 'tasks': self.tasks,
            'cpus_per_task': self.cpus_per_task, 'sbatch_args': self.sbatch_args,
            'on_stop': self.on_stop, 'time_limit_minutes': self.time_limit_minutes}

  # -- Slurm's commands ---------------------------------------------------------
  def command(self, name: str, *args: str, environment: Mapping[str, str] | None = None,
              timeout: float = 60) -> subprocess.CompletedProcess:
    # Its own session: a Ctrl-C meant for the sweep never cuts an sbatch short
    # (a job submitted without its id recorded would be left unwatched).
    return subprocess.run([self.binaries[name], *args], capture_output=True, text=True,
                          timeout=timeout, start_new_session=True,
                          env=dict(self.environment if environment is None else environment))

  def options(self, job_name: str) -> list[str]:
    """sbatch's options for every job of the sweep (output and directory aside)."""
    return ([f'--job-name={job_name}', f'--ntasks={self.tasks}']
            + ([f'--partition={self.partition}'] if self.partition else [])
            + ([f'--cpus-per-task={self.cpus_per_task}'] if self.cpus_per_task else [])
            + ([f'--time={self.time_limit_minutes}'] if self.time_limit_minutes else [])
            + self.sbatch_args)

  # -- before anything is submitted -------------------------------------------------
  def check(self, plans: Mapping[str, Any]) -> None:
    """ConfigError for a task count the trials' meshes cannot take (`plans`:
    trial name -> RunPlan), or options Slurm refuses (`sbatch --test-only`)."""
    for name, plan in plans.items():
      devices = plan.mesh_spec.num_devices
      if devices % self.tasks:
        raise ConfigError(
            f'trial {name} has a {devices}-device mesh ({plan.mesh_spec.describe()}), '
            f'which {self.tasks} tasks cannot share evenly', where='--slurm_tasks',
            fix=f'use a task count that divides {devices} (1 runs each trial as one process)')
      problem = plan.clients_problem(self.tasks)
      if problem:
        raise ConfigError(f'trial {name}: {problem} ({self.tasks} tasks)', where='--slurm_tasks',
                          fix="use a task count whose devices each split that way (1 runs "
                              "each trial as one process), or pipeline.engine = 'spmd'")
    try:
      result = self.command('sbatch', '--test-only', *self.options('meshgin-sweep-check'),
                            '--wrap=true')
    except subprocess.TimeoutExpired as e:
      raise ConfigError('sbatch --test-only gave no answer in 60 s', where='--launcher=slurm',
                        fix='check that the Slurm controller is up (sinfo)') from e
    if result.returncode != 0:
      refusal = ' '.join(result.stderr.split()) or f'exit status {result.returncode}'
      raise ConfigError(
          f'Slurm refuses the sweep\'s job options ({" ".join(self.options("x")[1:])}): '
          f'{refusal}', where='--slurm_partition, --slurm_tasks, --slurm_cpus_per_task, '
          '--slurm_sbatch_arg', fix='use options this cluster accepts (sinfo lists its '
                                    'partitions and nodes)')

  # -- one attempt ----------------------------------------------------------------
  def start(self, trial: Trial, *, command: Sequence[str], directory: str,
            environment: Mapping[str, str], attempt: int) -> SlurmTrial:
    """Submits the trial's attempt: its header line in trial.log first, then the job."""
    command = [*command, CLUSTER_FLAG]
    log_path = os.path.join(directory, LOG_FILE)
    with open(log_path, 'a') as log:
      write_attempt_header(log, attempt=attempt, environment=environment, command=command)
      log_start = log.tell()
    exit_path = os.path.join(directory, EXIT_FILE)
    try:
      os.remove(exit_path)  # an earlier attempt's; its job id would not match anyway
    except FileNotFoundError:
      pass
    script = os.path.join(directory, SCRIPT_FILE)
    with open(script, 'w') as f:
      f.write(batch_script(trial, command=command, exit_path=exit_path, attempt=attempt))
    job_name = f'{os.path.basename(os.path.dirname(directory))}/{trial.name}'
    try:
      result = self.command('sbatch', '--parsable', *self.options(job_name),
                            f'--output={log_path}', '--open-mode=append',
                            f'--chdir={self.workdir}', script, environment=environment)
      job_id, refusal = result.stdout.strip().split(';')[0], ' '.join(result.stderr.split())
      if result.returncode != 0:
        job_id = ''
    except subprocess.TimeoutExpired:
      job_id, refusal = '', 'no answer in 60 s'
    if not job_id:
      with open(log_path, 'a') as log:  # the trial's error line, as a crash's would be
        log.write(f'sbatch refused the job: {refusal or "no job id"}\n')
      return SlurmTrial(trial, launcher=self, job_id=None, directory=directory,
                        log_start=log_start)
    self._watched.add(job_id)
    return SlurmTrial(trial, launcher=self, job_id=job_id, directory=directory,
                      log_start=log_start)

  def adopt(self, trial: Trial, record: Mapping[str, Any], *,
            directory: str) -> SlurmTrial | None:
    """The job an earlier sweep left RUNNING in `record` (its `slurm_job_id`),
    to be watched instead of submitting a second one on the same model_dir;
    None if there is none. It may have finished meanwhile (`finished()`)."""
    job_id = record.get('slurm_job_id')
    if record.get('status') != 'RUNNING' or not job_id:
      return None
    self._watched.add(job_id)
    self._polled_at = -math.inf  # its state now, not a cached one
    return SlurmTrial(trial, launcher=self, job_id=job_id, directory=directory,
                      log_start=None)

  # -- watching -------------------------------------------------------------------
  def job_state(self, job_id: str, *, max_age: float | None = None) -> tuple[str, float]:
    """(state, seconds run) of a job this launcher submitted or adopted, from
    one squeue call for all of them, at most `max_age` (default: the poll
    interval) old. A job squeue does not list is GONE."""
    max_age = self.poll_seconds if max_age is None else max_age
    if job_id in self._watched and time.monotonic() - self._polled_at >= max_age:
      self._poll()
    return self._states.get(job_id, (PENDING, 0.0) if job_id in self._watched else (GONE, 0.0))

  def _poll(self) -> None:
    self._polled_at = time.monotonic()
    ids = sorted(self._watched, key=lambda i: (len(i), i))
    try:
      result = self.command('squeue', '-h', '-t', 'all', '-o', '%i %T %M',
                            '-j', ','.join(ids), timeout=30)
    except subprocess.TimeoutExpired:
      return  # the controller is busy: the states stay as they were, asked again later
    # squeue lists none of the jobs it has forgotten (MinJobAge after they
    # ended), but asked for one such job alone it refuses: that one is GONE too.
    if result.returncode != 0 and not (len(ids) == 1 and FORGOTTEN in result.stderr):
      return  # e.g. the controller is down: asked again later
    listed = {}
    for line in result.stdout.splitlines():
      fields = line.split()
      if len(fields) >= 2:
        listed[fields[0]] = (fields[1].rstrip('+'), seconds_used(fields[2]) if len(fields) > 2
                             else 0.0)
    for job_id in ids:
      self._states[job_id] = listed.get(job_id, (GONE, 0.0))
      if self._states[job_id][0] in TERMINAL_STATES:
        self._watched.discard(job_id)

  def cancel(self, job_id: str, signum: int | None = None) -> None:
    """`scancel` (signum None or SIGKILL: the whole job) or `scancel --signal`
    (the job's steps only: the training, not the batch shell)."""
    args = [] if signum in (None, signal.SIGKILL) else [
        f'--signal={signal.Signals(signum).name.removeprefix("SIG")}']
    try:
      self.command('scancel', *args, job_id, timeout=30)
    except subprocess.TimeoutExpired:
      pass  # the stop grace ends in a plain scancel, tried again
    self._polled_at = -math.inf


def batch_script(trial: Trial, *, command: Sequence[str], exit_path: str,
                 attempt: int) -> str:
  """The job's script: the trial as a job step, then its exit status recorded."""
  return (f'#!/bin/bash\n'
          f'# launch.sweep: trial {trial.name}, attempt {attempt}. The training runs as\n'
          f'# a job step (srun), which `scancel --signal=TERM` reaches (this shell it\n'
          f'# does not): it saves, exits 143, and its status is recorded below.\n'
          f'srun {shlex.join(command)}\n'
          f'status=$?\n'
          f'echo "$SLURM_JOB_ID $status" > {shlex.quote(exit_path)}\n'
          f'exit $status\n')


class SlurmTrial:
  """One submitted (or adopted) attempt, with `TrialProcess`'s interface for the
  runner."""

  def __init__(self, trial: Trial, *, launcher: SlurmLauncher, job_id: str | None,
               directory: str, log_start: int | None):
    self.trial = trial
    self.launcher = launcher
    self.job_id = job_id          # None: sbatch refused it (finished, exit 1)
    self.directory = directory
    self.log_start = log_start    # None (adopted): after the log's last attempt header
    self.stop_sent = 0.0          # when the stop was sent (0: not sent)
    self.timed_out = False
    self._running_since: float | None = None  # time.monotonic() the job started running
    self._exit_code: int | None = None
    self._cancelled = False       # a plain scancel was sent
    self._finished = job_id is None
    if self._finished:
      self._exit_code = 1

  @property
  def started(self) -> float:
    """When the job began to run: a queued job's clock has not started (now)."""
    return time.monotonic() if self._running_since is None else self._running_since

  @property
  def exit_code(self) -> int | None:
    return self._exit_code

  def record_fields(self, previous: Mapping[str, Any]) -> dict[str, Any]:
    """The job id of this attempt, and of every attempt so far (sweep_trial.json)."""
    if self.job_id is None:
      return {}
    return {'slurm_job_id': self.job_id,
            'slurm_job_ids': list(previous.get('slurm_job_ids', [])) + [self.job_id]}

  def state(self, *, max_age: float | None = None) -> str:
    state, used = self.launcher.job_state(self.job_id, max_age=max_age)
    if self._running_since is None and (state == RUNNING or state in TERMINAL_STATES):
      self._running_since = time.monotonic() - used  # an adopted job ran before we looked
    return state

  def finished(self) -> bool:
    if self._finished:
      return True
    state = self.state()
    if self.stop_sent and state in REQUEUED_STATES and not self._cancelled:
      self._cancelled = True  # stopped, then queued again (the cluster's requeue): end it
      self.launcher.cancel(self.job_id)
    if state in TERMINAL_STATES:
      self._finished = True
      self._exit_code = self._recorded_exit_code()
    return self._finished

  def _recorded_exit_code(self) -> int:
    """srun's status from the script's EXIT_FILE when this job wrote it; else 1
    (the job ended before its script did: cancelled, timed out, node failure),
    which leaves the verdict to run_status.json."""
    try:
      with open(os.path.join(self.directory, EXIT_FILE)) as f:
        job_id, status = f.read().split()
      if job_id == self.job_id:
        return int(status)
    except (OSError, ValueError):
      pass
    return 1

  def send(self, signum: int) -> None:
    """SIGKILL: `scancel` (the whole job); another signal: to the job's steps."""
    if self.job_id is not None:
      self.launcher.cancel(self.job_id, signum)

  def stop(self) -> None:
    """A queued job is cancelled; a running one gets SIGTERM (it saves, exits); once."""
    if self.stop_sent or self._finished:
      return
    self.stop_sent = time.monotonic()
    state = self.state(max_age=0.2)
    if state == RUNNING or state == 'COMPLETING':
      self.send(signal.SIGTERM)
    elif state not in TERMINAL_STATES:
      self._cancelled = True
      self.send(signal.SIGKILL)

  def output(self) -> str:
    """This attempt's part of trial.log (Slurm appends the job's output to it)."""
    try:
      with open(os.path.join(self.directory, LOG_FILE), 'rb') as f:
        f.seek(self.log_start or 0)
        text = f.read().decode(errors='replace')
    except OSError:
      return ''
    if self.log_start is not None:
      return text
    headers = list(_HEADER.finditer(text))
    return text[headers[-1].end():] if headers else text
