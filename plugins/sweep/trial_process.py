"""One attempt of one sweep trial: the `launch.train` process, its log and its ending.

The runner (`driver.SweepRunner`) decides which trial runs when; this module
owns what happens to one of them:

    environment = trial_environment(base=launcher_environment, parallel=2)
    attempt = TrialProcess.launch(trial, command=sweep.train_command(trial),
                                  directory=trial_dir, environment=environment,
                                  attempt=1)
    ...                                   # attempt.stop() on SIGTERM or a timeout
    if attempt.finished():
      outcome = trial_outcome(run_status.read_run_status(trial_dir),
                              attempt.exit_code, attempt=record['attempt_id'])
      why = first_error_line(attempt.output(), attempt.exit_code)

A trial runs in its own session (a signal meant for one trial reaches no
other, and a SIGKILL reaches the trial's own children), with stdout and stderr
appended to `trial.log` in its directory. Its environment is the launcher's as
the user gave it: a trial's console is quiet or verbose as its own flags say
(each `launch.train` quiets itself), never as the sweep process's was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import time
from typing import Any, Mapping, Sequence, TextIO

from plugins import run_status
from plugins.sweep.spec import Trial

STATUS_FILE = 'sweep_trial.json'  # in each trial directory: the trial's outcome
LOG_FILE = 'trial.log'            # in each trial directory: stdout+stderr of every attempt
SUCCESS, FAILURE, INTERRUPTED = 'SUCCESS', 'FAILURE', 'INTERRUPTED'
STOPPED_AT_START_UP = 'stopped_at_start_up'  # a signal before the run wrote anything
# TensorFlow sizes its thread pools from these (checked: 1, 4, 8 give 5, 11, 19 threads).
THREAD_VARIABLES = ('TF_NUM_INTRAOP_THREADS', 'TF_NUM_INTEROP_THREADS')
# Shown in each attempt's log header when set: they change what the trial does or logs.
SHOWN_VARIABLES = THREAD_VARIABLES + ('TF_CPP_MIN_LOG_LEVEL',)


def threads_per_trial(parallel: int) -> int:
  return max(1, (os.cpu_count() or 1) // parallel)


def trial_environment(*, base: Mapping[str, str], repo_root: str,
                      parallel: int) -> dict[str, str]:
  """`base` (the launcher's environment) with the repository importable and,
  for `parallel` > 1, the machine's threads divided between the trials
  (unless already set). Nothing about logging is added: each trial's own
  flags (--verbose or not) decide its console."""
  environment = dict(base)
  environment['PYTHONPATH'] = os.pathsep.join(
      [repo_root] + [p for p in environment.get('PYTHONPATH', '').split(os.pathsep) if p])
  if parallel > 1:
    for name in THREAD_VARIABLES:
      environment.setdefault(name, str(threads_per_trial(parallel)))
  return environment


def write_attempt_header(log: TextIO, *, attempt: int, environment: Mapping[str, str],
                         command: Sequence[str]) -> None:
  """The '===== sweep attempt N, date, settings: command' line that heads each
  attempt's part of trial.log (flushed: the trial appends after it)."""
  shown = ' '.join(f'{name}={environment[name]}' for name in SHOWN_VARIABLES
                   if name in environment)
  log.write(f'\n===== sweep attempt {attempt}, {time.strftime("%Y-%m-%d %H:%M:%S")}'
            f'{", " + shown if shown else ""}: {subprocess.list2cmdline(command)}\n')
  log.flush()


class LocalLauncher:
  """Starts each attempt as a local subprocess (`TrialProcess`); the runner's
  default. The Slurm launcher (`plugins.sweep.slurm`) has the same methods."""
  kind = 'local'
  shares_machine = True          # the runner divides the CPU threads between trials
  leaves_trials_on_stop = False  # a stopped sweep stops its trials and waits for them

  def check(self, plans: Mapping[str, Any]) -> None:
    """Nothing to check beyond the config (`plans`: trial name -> RunPlan)."""
    del plans

  def adopt(self, trial: Trial, record: Mapping[str, Any], *,
            directory: str) -> None:
    """A local trial left running by an earlier sweep is never taken over."""
    del trial, record, directory

  def start(self, trial: Trial, *, command: Sequence[str], directory: str,
            environment: Mapping[str, str], attempt: int) -> TrialProcess:
    return TrialProcess.launch(trial, command=command, directory=directory,
                               environment=environment, attempt=attempt)

  def to_json(self) -> dict[str, Any]:
    return {'kind': self.kind}


@dataclasses.dataclass
class TrialProcess:
  """A running (or finished) attempt; `launch` starts one."""
  trial: Trial
  process: subprocess.Popen
  log: TextIO
  log_start: int          # offset of this attempt's output in the log
  started: float          # time.monotonic()
  stop_sent: float = 0.0  # when SIGTERM was sent (0: not sent)
  timed_out: bool = False

  @classmethod
  def launch(cls, trial: Trial, *, command: Sequence[str], directory: str,
             environment: Mapping[str, str], attempt: int) -> TrialProcess:
    log = open(os.path.join(directory, LOG_FILE), 'a')
    write_attempt_header(log, attempt=attempt, environment=environment, command=command)
    log_start = log.tell()
    process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                               env=dict(environment), start_new_session=True)
    return cls(trial=trial, process=process, log=log, log_start=log_start,
               started=time.monotonic())

  def record_fields(self, previous: Mapping[str, Any]) -> dict[str, Any]:
    """What the sweep records about this attempt besides its outcome (given the
    trial's `previous` record): nothing, for a local process."""
    del previous
    return {}

  @property
  def exit_code(self) -> int | None:
    return self.process.returncode

  def finished(self) -> bool:
    return self.process.poll() is not None

  def send(self, signum: int) -> None:
    try:
      os.killpg(self.process.pid, signum)  # the trial's own session: it and its children
    except ProcessLookupError:
      pass  # already gone

  def stop(self) -> None:
    """SIGTERM the trial (it finishes its step, saves, then exits); once only."""
    if not self.stop_sent:
      self.stop_sent = time.monotonic()
      self.send(signal.SIGTERM)

  def output(self) -> str:
    """This attempt's stdout+stderr, once it has finished (closes the log)."""
    self.log.close()
    with open(self.log.name, errors='replace') as f:
      f.seek(self.log_start)
      return f.read()


def trial_outcome(status: run_status.RunStatus | None, exit_code: int, *,
                  attempt: str | None = None) -> str:
  """How a finished trial process ended, from its run_status.json (removed
  before it started, and believed only when it names the `attempt` the sweep
  started, so never an earlier attempt's; None, an attempt recorded before
  attempts were named: believed): one of run_status's statuses. A process
  gone while its status still says running (SIGKILL, a hard crash) crashed;
  so did one that wrote nothing and exited non-zero. Exit 0 (or 143, under a
  scheduler) with nothing written: stopped by a signal during start-up."""
  if status is not None and attempt is not None and status.attempt != attempt:
    status = None
  if status is None:  # exit 143: stopped under a scheduler, which asks to run again
    return (STOPPED_AT_START_UP if exit_code in (0, run_status.EXIT_REQUEUE)
            else run_status.CRASHED)
  if status.status == run_status.RUNNING:
    return run_status.CRASHED
  return status.status


def first_error_line(output: str, exit_code: int) -> str:
  """The line that says why a trial failed, from its stdout+stderr."""
  lines = [line.strip() for line in output.splitlines() if line.strip()]
  for prefix in ('Configuration error:', 'Training diverged:'):
    for line in lines:
      if line.startswith(prefix):
        return line
  for line in reversed(lines):  # a traceback's last line names the exception
    if re.match(r'^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b', line):
      return line
  if exit_code < 0:
    return f'killed by {signal.Signals(-exit_code).name}'
  return lines[-1] if lines else f'exit status {exit_code} with no output'


def write_json(path: str, value: Any) -> None:
  temporary = path + '.tmp'
  with open(temporary, 'w') as f:
    json.dump(value, f, indent=1)
  os.replace(temporary, path)


def read_status(trial_dir: str) -> dict[str, Any] | None:
  """The trial's sweep record (STATUS_FILE), or None if it has none readable."""
  try:
    with open(os.path.join(trial_dir, STATUS_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None
