"""Runs a sweep: each trial a `launch.train` subprocess in its own directory.

    sweep = Sweep(root='/tmp/lr', gin_files=['configs/experiments/quickstart.gin'],
                  gin_bindings=['train.num_steps = 50'],
                  axes=[parse_axis('optimizer.learning_rate=[3e-3, 1e-3]')])
    records = SweepRunner(sweep, parallel=2).run()

What the runner guarantees:

* **Isolation.** A trial is a separate process (its own session, so a signal
  meant for one trial reaches no other). Whatever it does (exit 2 on a bad
  config, 3 on a NaN loss, a crash, a hang past `trial_timeout`) is recorded with
  its exit status and the first line of its error, and the other trials go on.
  How it ended is read from the trial's `run_status.json` (written by
  `launch.train`), never from its printed output; a trial that wrote no final
  status (killed by SIGKILL) crashed.
* **Resume.** Each trial's outcome is kept in `ROOT/<trial>/sweep_trial.json`.
  Running the same sweep again skips trials that succeeded and runs the others:
  failed ones from the start of their config, interrupted or timed-out ones
  from their last checkpoint (`launch.train` resumes from its model_dir). The
  base config may change between runs (e.g. to fix the binding a trial failed
  on): finished trials are kept, and the table says which ones ran on another
  base config.
* **Clean stop.** SIGTERM or SIGINT to the sweep is passed to every running
  trial, which saves a checkpoint and exits; the sweep records them as
  INTERRUPTED and exits; a re-run picks them up.
* **Threads.** With `parallel` > 1 the machine's threads are divided between the
  trials (TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS, unless already set).
* **Where trials run.** A launcher starts each attempt: `LocalLauncher` (the
  default, a subprocess here) or `slurm.SlurmLauncher` (one sbatch job per
  attempt; a re-run adopts a job an earlier sweep left queued or running).
  Both hand back objects with `TrialProcess`'s interface, so everything above
  holds for either.
* **Its own console.** A trial logs as its flags ask (`train_flags`, e.g.
  --verbose from the sweep's own flag): the runner adds no log setting to its
  environment (see `trial_process`, which starts, stops and reads each attempt).

The sweep root gets `sweep.json` (the resolved trial list and each outcome),
`sweep.tsv` (the results table, best eval loss first) and the HParams
experiment config (see `plugins/sweep/board.py`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, Mapping, Sequence, TextIO

from layout_core.checkpoint.lock import DirectoryLock
from layout_core.errors import ConfigError
from plugins.sweep import board as sweep_board
from plugins import run_status
from plugins.sweep.spec import Axis, Trial, expand
from plugins.sweep.trial_process import (FAILURE, INTERRUPTED, STATUS_FILE, STOPPED_AT_START_UP,
                                         SUCCESS, LocalLauncher, TrialProcess, first_error_line,
                                         read_status, trial_environment, trial_outcome,
                                         write_json)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STOP_GRACE = 120  # seconds a stopped trial gets to save before it is killed


@dataclasses.dataclass
class Sweep:
  """The resolved sweep: base config, axes and how trials are drawn from them."""
  root: str                                   # sweep directory; trials below it
  gin_files: list[str]                        # base config files, as for launch.train
  axes: list[Axis]                            # swept bindings
  gin_bindings: list[str] = dataclasses.field(default_factory=list)  # base bindings
  gin_search_paths: list[str] = dataclasses.field(default_factory=list)
  mode: str = 'product'                       # product | zip | random
  num_trials: int = 0                         # random: draws; else 0 = all combinations
  seed: int = 0                               # random search seed
  # launch.train flags every trial gets besides its config, e.g. ['--verbose']
  train_flags: list[str] = dataclasses.field(default_factory=list)

  def trials(self) -> list[Trial]:
    return expand(self.axes, mode=self.mode, num_trials=self.num_trials, seed=self.seed)

  def base(self) -> dict[str, list[str]]:
    """The part of the config every trial shares (recorded with each outcome)."""
    return {'gin_files': list(self.gin_files), 'gin_bindings': list(self.gin_bindings),
            'gin_search_paths': list(self.gin_search_paths)}

  def train_command(self, trial: Trial, python: str = sys.executable) -> list[str]:
    return ([python, '-m', 'launch.train']
            + [f'--gin_file={f}' for f in self.gin_files]
            + [f'--gin_bindings={b}' for b in self.gin_bindings + trial.bindings]
            + ([f'--gin_search_paths={",".join(self.gin_search_paths)}']
               if self.gin_search_paths else [])
            + list(self.train_flags)
            + [f'--model_dir={os.path.join(self.root, trial.name)}'])


def check_config(sweep: Sweep, trials: Sequence[Trial]) -> dict[str, Any]:
  """Resolves the base config and every trial's into the typed plan (gin and
  plain Python, no TensorFlow: well under a second each), as launch.train
  does first. A broken base, or a swept key every trial fails on, is the
  sweep's own error (ConfigError); a value only some trials fail on is left to
  those trials, which record it. Returns the plans of the trials that parsed
  (trial name -> RunPlan), for the launcher's own checks."""
  from plugins import gin_setup, plan  # pylint: disable=g-import-not-at-top
  import gin  # pylint: disable=g-import-not-at-top

  def parse(extra: Sequence[str]) -> plan.RunPlan:
    with gin_setup.parsed_config(files=sweep.gin_files,
                                 bindings=sweep.gin_bindings + list(extra),
                                 search_paths=sweep.gin_search_paths):
      return plan.make_plan()

  try:
    parse([])
    errors, plans = [], {}
    for trial in trials:
      try:
        plans[trial.name] = parse(trial.bindings)
      except ConfigError as e:
        errors.append((trial, e))
    if errors and len(errors) == len(trials):
      trial, error = errors[0]
      raise ConfigError(f'every trial fails to parse; the first, {trial.name}: {error}',
                        where='--sweep', fix='check the swept keys and values')
    return plans
  finally:
    gin.clear_config()


def _format_duration(seconds: float | None) -> str:
  if seconds is None:
    return '?'
  seconds = int(round(seconds))
  return f'{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


class SweepRunner:
  """Runs the trials of `sweep`, `parallel` at a time; see the module docstring."""

  def __init__(self, sweep: Sweep, *, parallel: int = 1, trial_timeout: float = 0,
               stop_grace: float = STOP_GRACE, python: str = sys.executable,
               out: TextIO = sys.stdout, progress_every: float = 30,
               command_line: Sequence[str] = (),
               environment: Mapping[str, str] | None = None, launcher: Any = None):
    if parallel < 1:
      raise ConfigError(f'--parallel is {parallel}', where='--parallel',
                        fix='run at least 1 trial at a time')
    if trial_timeout < 0:
      raise ConfigError(f'--trial_timeout is {trial_timeout}', where='--trial_timeout',
                        fix='use 0 (none) or a number of seconds')
    self.sweep = sweep
    self.trials = sweep.trials()
    self.parallel = parallel
    self.trial_timeout = trial_timeout  # seconds; 0: no limit
    self.stop_grace = stop_grace        # seconds a stopped trial gets to save
    self.python = python
    self.out = out
    self.progress_every = progress_every
    self.command_line = list(command_line)
    # The trials' environment before the runner's additions (default: this
    # process's, read at each start); launch.sweep passes its environment as
    # the user gave it, without what quieting its own console set.
    self.environment: Mapping[str, str] = (os.environ if environment is None
                                           else dict(environment))
    # Starts each attempt: LocalLauncher (a subprocess here) or
    # slurm.SlurmLauncher (a Slurm job); both return TrialProcess's interface.
    self.launcher = LocalLauncher() if launcher is None else launcher
    self.stop_signal: str | None = None
    self.records: dict[str, dict[str, Any]] = {}
    self._finished_walls: list[float] = []

  # -- set-up ------------------------------------------------------------------
  def trial_dir(self, trial: Trial) -> str:
    return os.path.join(self.sweep.root, trial.name)

  def trial_id(self, trial: Trial) -> str:
    return sweep_board.trial_id(trial, number=self.trials.index(trial) + 1,
                                count=len(self.trials))

  def _say(self, line: str) -> None:
    print(line, file=self.out, flush=True)

  def write_sweep_json(self) -> None:
    trials = []
    for trial in self.trials:
      entry = trial.to_json()
      entry.update(self.records.get(trial.name) or {'status': 'PENDING'})
      entry['name'], entry['trial_id'] = trial.name, self.trial_id(trial)
      trials.append(entry)
    write_json(os.path.join(self.sweep.root, 'sweep.json'), {
        'command': self.command_line, **self.sweep.base(), 'mode': self.sweep.mode,
        'num_trials': self.sweep.num_trials, 'seed': self.sweep.seed,
        'train_flags': self.sweep.train_flags, 'parallel': self.parallel,
        'trial_timeout': self.trial_timeout, 'launcher': self.launcher.to_json(),
        'axes': [a.to_json() for a in self.sweep.axes], 'trials': trials})

  # -- one trial ------------------------------------------------------------------
  def _start(self, trial: Trial) -> TrialProcess:
    directory = self.trial_dir(trial)
    os.makedirs(directory, exist_ok=True)
    previous = read_status(directory) or {}
    run_status.remove_run_status(directory)  # this attempt's outcome is its own
    sweep_board.clear_sessions(directory)
    sweep_board.write_session_start(directory, trial, self.sweep.axes,
                                    trial_id=self.trial_id(trial))
    attempt = previous.get('attempts', 0) + 1
    self.records[trial.name] = {
        'status': 'RUNNING', 'attempts': attempt, 'base': self.sweep.base(),
        # what this attempt's run_status.json must name to be believed (kept
        # here for a re-run that adopts the attempt's Slurm job)
        'attempt_id': f'{trial.name}/{attempt}/{uuid.uuid4().hex[:12]}',
        'started_at': time.time(),
        # an interrupted trial continues, so its time adds up; a failed one restarts
        'wall_seconds': previous.get('wall_seconds', 0.0) if previous.get(
            'status') in (INTERRUPTED, 'RUNNING') else 0.0}
    write_json(os.path.join(directory, STATUS_FILE), self.records[trial.name])
    # Trials on this machine share its threads; a scheduler's jobs have their own.
    environment = trial_environment(
        base=self.environment, repo_root=REPO_ROOT,
        parallel=self.parallel if self.launcher.shares_machine else 1)
    environment[run_status.ATTEMPT_VARIABLE] = self.records[trial.name]['attempt_id']
    started = self.launcher.start(trial, command=self.sweep.train_command(trial, self.python),
                                  directory=directory, environment=environment,
                                  attempt=attempt)
    fields = started.record_fields(previous)  # e.g. the Slurm job id, for adoption
    if fields:
      self.records[trial.name].update(fields)
      write_json(os.path.join(directory, STATUS_FILE), self.records[trial.name])
    return started

  def _finish(self, running: TrialProcess) -> dict[str, Any]:
    trial, exit_code = running.trial, running.exit_code
    output = running.output()
    directory = self.trial_dir(trial)
    record = self.records[trial.name]
    wall = record['wall_seconds'] + time.monotonic() - running.started
    outcome = trial_outcome(run_status.read_run_status(directory), exit_code,
                            attempt=record.get('attempt_id'))
    if running.timed_out:
      status, error = FAILURE, (f'timed out after {self.trial_timeout:g} s '
                                f'(stopped; a re-run continues from its checkpoint)')
    elif outcome == run_status.COMPLETED:
      status, error = SUCCESS, ''
    elif self.stop_signal or outcome in (run_status.PREEMPTED, STOPPED_AT_START_UP):
      status, error = INTERRUPTED, f'stopped by {self.stop_signal or "a signal"}'
    else:
      status, error = FAILURE, first_error_line(output, exit_code)
      if outcome == run_status.CRASHED:
        error = f'crashed: {error}'
    record.update(status=status, outcome=outcome, exit_code=exit_code, error=error,
                  wall_seconds=wall, ended_at=time.time())
    if status != INTERRUPTED:  # an interrupted session goes on in the next attempt
      sweep_board.write_session_end(directory, status=status, wall_seconds=wall)
    record['metrics'] = sweep_board.final_metrics(directory)
    write_json(os.path.join(directory, STATUS_FILE), record)
    if status == SUCCESS:
      self._finished_walls.append(wall)
    return record

  # -- the loop -----------------------------------------------------------------
  def _handle_signal(self, signum, frame) -> None:
    del frame
    self.stop_signal = signal.Signals(signum).name

  def progress_line(self, running: int, waiting: int, started: float) -> str:
    counts = {SUCCESS: 0, FAILURE: 0, INTERRUPTED: 0}
    for record in self.records.values():
      if record['status'] in counts:
        counts[record['status']] += 1
    eta = None
    if self._finished_walls:
      mean = sum(self._finished_walls) / len(self._finished_walls)
      eta = mean * math.ceil((running + waiting) / self.parallel)
    return (f'[sweep] {counts[SUCCESS]} done, {counts[FAILURE]} failed, {running} running, '
            f'{waiting} waiting of {len(self.trials)}; elapsed '
            f'{_format_duration(time.monotonic() - started)}, ETA {_format_duration(eta)}')

  def run(self) -> list[dict[str, Any]]:
    """Runs every unfinished trial; returns one record per trial (sweep order)."""
    # One driver per sweep root (a second one exits 2 naming this one); a
    # root this run created is removed again if the config is rejected.
    with DirectoryLock.acquire(self.sweep.root, purpose='launch.sweep'):
      plans = check_config(self.sweep, self.trials)
      self.launcher.check(plans)  # e.g. options Slurm refuses: before anything starts
      sweep_board.write_experiment(self.sweep.root, self.sweep.axes)
      adopted, waiting = self._unfinished_trials()
      self.write_sweep_json()
      handlers = {}
      if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
          handlers[signum] = signal.signal(signum, self._handle_signal)
      try:
        self._run_trials(waiting, adopted)
      finally:
        for signum, handler in handlers.items():
          signal.signal(signum, handler)
      self.write_sweep_json()
      return self._write_results()

  def _unfinished_trials(self) -> tuple[list[TrialProcess], list[Trial]]:
    """Trials still running under the launcher (a Slurm job an earlier sweep
    left queued or running: watched, never submitted twice), and trials to
    run now: all but those that succeeded before (their records kept)."""
    adopted, waiting, other_base = [], [], []
    for trial in self.trials:
      status = read_status(self.trial_dir(trial))
      left = status and self.launcher.adopt(trial, status, directory=self.trial_dir(trial))
      if left:
        self.records[trial.name] = status
        if not left.finished():
          adopted.append(left)
          continue
        status = self._finish(left)  # it ended while no sweep watched it
        self._say(f'[sweep] {status["status"].lower():7s} {trial.name} (its job ended '
                  f'while no sweep was watching)')
      if status and status.get('status') == SUCCESS:
        self.records[trial.name] = status
        if status.get('base') != self.sweep.base():
          other_base.append(trial.name)
      else:
        waiting.append(trial)
    skipped = len(self.trials) - len(waiting) - len(adopted)
    self._say(f'[sweep] {len(self.trials)} trials in {self.sweep.root}: {skipped} already '
              f'done (skipped), {len(waiting)} to run, {self.parallel} at a time')
    if adopted:
      self._say(f'[sweep] watching {len(adopted)} trials still queued or running from an '
                f'earlier sweep: {", ".join(a.trial.name for a in adopted)}')
    if other_base:
      self._say(f'[sweep] note: {len(other_base)} finished trials ran with another base '
                f'config ({", ".join(other_base)}); delete their directories to redo them')
    return adopted, waiting

  def _run_trials(self, waiting: list[Trial], adopted: Sequence[TrialProcess] = ()) -> None:
    """Keeps `parallel` trials running, polls them, enforces timeouts and stops."""
    running: list[TrialProcess] = list(adopted)
    started = last_progress = time.monotonic()
    try:
      while waiting or running:
        if self.stop_signal:
          waiting = []
          if self.launcher.leaves_trials_on_stop:  # their records keep the job ids
            self._say(f'[sweep] stopped by {self.stop_signal}; left running: '
                      f'{", ".join(item.trial.name for item in running) or "none"} '
                      '(run the same command to watch them again)')
            running = []
            break
          for item in running:
            item.stop()
        while waiting and len(running) < self.parallel:
          trial = waiting.pop(0)
          running.append(self._start(trial))
          self._say(f'[sweep] start  {trial.name}')
          self._say(self.progress_line(len(running), len(waiting), started))
        time.sleep(0.2)
        now = time.monotonic()
        for item in list(running):
          if (self.trial_timeout and not item.stop_sent
              and now - item.started > self.trial_timeout):
            item.timed_out = True
            item.stop()
          if not item.finished():
            if item.stop_sent and now - item.stop_sent > self.stop_grace:
              item.send(signal.SIGKILL)  # it did not save in time
            continue
          running.remove(item)
          record = self._finish(item)
          detail = f' (exit {record["exit_code"]}): {record["error"]}' if record['error'] else ''
          self._say(f'[sweep] {record["status"].lower():7s} {item.trial.name} in '
                    f'{record["wall_seconds"]:.1f} s{detail}')
          self._say(self.progress_line(len(running), len(waiting), started))
          self.write_sweep_json()
        if now - last_progress > self.progress_every:
          last_progress = now
          self._say(self.progress_line(len(running), len(waiting), started))
    finally:
      for item in running:  # only after an unexpected error in this loop
        item.stop()

  def _write_results(self) -> list[dict[str, Any]]:
    """sweep.tsv and the printed table; returns the records in sweep order."""
    records = []
    for trial in self.trials:
      record = dict(self.records.get(trial.name) or {'status': 'PENDING'})
      record.update(name=trial.name, values=trial.values)
      records.append(record)
    table = results_table(records, self.sweep.axes)
    with open(os.path.join(self.sweep.root, 'sweep.tsv'), 'w') as f:
      f.write(table_tsv(table))
    self._say('\n' + table_text(table))
    return records


# -- results table -------------------------------------------------------------------
TABLE_METRICS = (('eval/loss', 'eval_loss', '{:.4f}'),
                 ('train/tokens_per_sec', 'tokens_per_sec', '{:.0f}'),
                 ('usage/param_bytes_per_device_max', 'bytes_per_device', '{:.0f}'))


def results_table(records: Sequence[dict[str, Any]],
                  axes: Sequence[Axis]) -> list[list[str]]:
  """Header + one row per trial, lowest final eval loss first (no loss: last)."""
  def loss(record):
    value = (record.get('metrics') or {}).get('eval/loss')
    return (record.get('status') != SUCCESS, value if value is not None else math.inf)

  header = (['trial', 'status'] + [a.key for a in axes]
            + [name for _, name, _ in TABLE_METRICS] + ['wall_seconds', 'exit', 'error'])
  rows = [header]
  for record in sorted(records, key=loss):
    metrics = record.get('metrics') or {}
    row = [record['name'], record.get('status', 'PENDING')]
    row += [record['values'][a.key] for a in axes]
    row += [fmt.format(metrics[tag]) if tag in metrics else '' for tag, _, fmt in TABLE_METRICS]
    wall = record.get('wall_seconds')
    row += [f'{wall:.1f}' if wall else '', str(record.get('exit_code', '')),
            record.get('error', '')]
    rows.append(row)
  return rows


def table_tsv(rows: Sequence[Sequence[str]]) -> str:
  return ''.join('\t'.join(cell.replace('\t', ' ') for cell in row) + '\n' for row in rows)


def table_text(rows: Sequence[Sequence[str]], *, max_error: int = 100) -> str:
  rows = [list(row[:-1]) + [row[-1][:max_error]] for row in rows]
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  return '\n'.join('  '.join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                   for row in rows)
