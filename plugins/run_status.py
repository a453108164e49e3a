"""How a run ended, for programs: exit codes, and `<model_dir>/run_status.json`.

    record = RunStatusFile(model_dir, attempt=os.environ.get(ATTEMPT_VARIABLE))
    record.write(RUNNING, step=0)              # once the run is validated
    record.write(COMPLETED, step=300, exit_code=EXIT_OK, metrics={'eval_loss': 1.02})
    read_run_status(model_dir).status          # 'completed'
    read_run_status(model_dir).attempts        # the earlier attempts in model_dir
    one_line(str(tf_error))                    # its first line, without TF's function names

`launch.train` writes the file, atomically (temp file, fsync, rename), from
client 0 only; `launch.sweep` classifies its trials by it rather than by their
printed output. A process killed with SIGKILL writes nothing more, so a file
still saying `running` once its process is gone means the run crashed.

Statuses: running, completed, preempted (stopped by a signal after saving),
diverged (non-finite loss), peer_lost (another client of a multi-client run
was lost mid-run: killed, hung or its host gone; written by a surviving client 0),
config_error (rejected before training: written
only into an existing directory that holds no status of an earlier run, so a
rejected command never overwrites the record of a run that trained), crashed
(any other exception, best effort).

Each attempt (a resume, a scheduler's requeue) starts a new record and keeps
the earlier ones' outcomes in `attempts`; `restart_count` is the scheduler's
count of restarts (SLURM_RESTART_COUNT; None outside a scheduler). `attempt`
is the name whoever started the run gave this attempt (`ATTEMPT_VARIABLE` in
its environment): `launch.sweep` believes a file only from the attempt it
started, which a pid cannot say (the process it started may be a wrapper,
srun or a container runtime, and pids are reused).

Nothing here imports TensorFlow or gin.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Mapping

EXIT_OK = 0                # also: stopped by SIGTERM/SIGINT, after saving
EXIT_CONFIG_ERROR = 2      # the config was rejected; nothing was written
EXIT_DIVERGED = 3          # the loss became NaN or infinite
EXIT_SWEEP_FAILED = 1      # launch.sweep: some trial failed
EXIT_SWEEP_INTERRUPTED = 4  # launch.sweep: stopped by a signal; run it again to continue
EXIT_DATA_ERROR = 5        # a data file could not be read mid-run; checkpoints stay
# A multi-client run lost a client (killed, its host gone, hung past TF's
# heartbeats): the survivors exit 1, as for any failure of a peer, whose
# outcome is the same: the checkpoints stay, and relaunching every client resumes.
EXIT_PEER_LOST = 1
# Under a scheduler (--cluster=slurm or tf_config), a run stopped by a signal
# saves and exits 143 (128 + SIGTERM): "not finished, run me again". Slurm
# requeues on it (the sbatch script's check, or RequeueExit=143); Kubeflow's
# training operator counts it retryable under restartPolicy: ExitCode.
EXIT_REQUEUE = 143

STATUS_FILE = 'run_status.json'
# Set by what starts a run to name this attempt of it (launch.sweep: one per
# trial attempt); launch.train records it as run_status.json's `attempt`.
ATTEMPT_VARIABLE = 'MESHGIN_ATTEMPT'
ATTEMPT_FIELDS = ('status', 'step', 'exit_code', 'started_at', 'updated_at', 'restart_count')
MAX_ATTEMPTS = 100  # earlier attempts kept in the file
RUNNING, COMPLETED, PREEMPTED = 'running', 'completed', 'preempted'
DIVERGED, CONFIG_ERROR, CRASHED = 'diverged', 'config_error', 'crashed'
DATA_ERROR, PEER_LOST = 'data_error', 'peer_lost'
STATUSES = (RUNNING, COMPLETED, PREEMPTED, DIVERGED, CONFIG_ERROR, CRASHED, DATA_ERROR,
            PEER_LOST)
# What TensorFlow adds to an op's error text that names its own internals, not
# the user's problem: `{{function_node __inference_train_step_123}}` before the
# message, `[[{{node Sum/AllReduce}}]]` and `[Op:__inference_...] name: ` after it.
_TF_NOISE = re.compile(r'\{\{function_node [^}]*\}\}|\[\[\{\{node [^}]*\}\}\]\]'
                       r'|\[Op:[^\]]*\](?: name:)?')


def shell_status(returncode: int) -> int:
  """A child's Popen returncode as a shell reports it: killed by signal N
  (-N) is 128 + N, anything else itself."""
  return 128 - returncode if returncode < 0 else returncode


def one_line(text: str) -> str:
  """The first non-empty line of an error's text, without the function and
  node names TensorFlow adds to it (they name generated graphs, and bury the
  message); how meshgin shows a TensorFlow error in one line."""
  for line in str(text).splitlines():
    line = ' '.join(_TF_NOISE.sub(' ', line).split())
    if line:
      return line
  return ''


@dataclasses.dataclass(frozen=True)
class RunStatus:
  status: str                      # one of STATUSES
  step: int | None                 # the last step done (None: before training)
  exit_code: int | None            # None while running
  metrics: dict[str, float]        # final eval metrics ('eval_loss', ...), train_loss
  wall_seconds: float              # since the process started
  started_at: float                # time.time() of the process start
  updated_at: float
  pid: int
  error: str = ''                  # the first line of what went wrong
  restart_count: int | None = None  # the scheduler's restarts of this job (Slurm requeues)
  attempt: str | None = None       # the starter's name for this attempt (ATTEMPT_VARIABLE)
  # The earlier attempts in this model_dir, oldest first: each one's status,
  # step, exit_code, started_at, updated_at and restart_count.
  attempts: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def status_path(model_dir: str) -> str:
  return os.path.join(model_dir, STATUS_FILE)


class RunStatusFile:
  """Writes one process's run_status.json (see the module doc)."""

  def __init__(self, model_dir: str, *, enabled: bool = True,
               restart_count: int | None = None, attempt: str | None = None):
    self.model_dir, self.enabled = model_dir, enabled
    self.restart_count, self.attempt = restart_count, attempt
    self.started_at, self._start = time.time(), time.monotonic()
    self._wrote = False  # this process wrote the file (a run that started)
    self._earlier: list[dict[str, Any]] | None = None  # read at the first write

  def _earlier_attempts(self) -> list[dict[str, Any]]:
    """The attempts before this process's, from the file an earlier one left."""
    previous = read_run_status(self.model_dir)
    if previous is None:
      return []
    summary = {name: getattr(previous, name) for name in ATTEMPT_FIELDS}
    return (previous.attempts + [summary])[-MAX_ATTEMPTS:]

  def write(self, status: str, *, step: int | None = None, exit_code: int | None = None,
            metrics: Mapping[str, float] | None = None, error: str = '') -> None:
    if not self.enabled:
      return
    if status not in STATUSES:
      raise ValueError(f'run status {status!r} is not one of {STATUSES}')
    if self._earlier is None:
      self._earlier = self._earlier_attempts()
    record = RunStatus(status=status, step=step, exit_code=exit_code,
                       metrics=dict(metrics or {}),
                       wall_seconds=round(time.monotonic() - self._start, 3),
                       started_at=self.started_at, updated_at=time.time(), pid=os.getpid(),
                       error=one_line(error),
                       restart_count=self.restart_count, attempt=self.attempt,
                       attempts=self._earlier)
    path = status_path(self.model_dir)
    temporary = f'{path}.tmp-{os.getpid()}'
    with open(temporary, 'w') as f:
      json.dump(dataclasses.asdict(record), f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temporary, path)
    self._wrote = True

  def write_rejection(self, error: BaseException) -> None:
    """config_error, only into an existing directory without an earlier run's
    status (a rejected command changes nothing of a run that trained), or
    over this process's own `running`."""
    if self.enabled and os.path.isdir(self.model_dir) and (
        self._wrote or not os.path.exists(status_path(self.model_dir))):
      try:
        self.write(CONFIG_ERROR, exit_code=EXIT_CONFIG_ERROR, error=' '.join(str(error).split()))
      except OSError:
        pass  # not writable: the error message says so already


def read_run_status(model_dir: str) -> RunStatus | None:
  """The run's status, or None when there is none (or it cannot be read)."""
  try:
    with open(status_path(model_dir)) as f:
      values: dict[str, Any] = json.load(f)
    return RunStatus(**values)
  except (OSError, ValueError, TypeError):
    return None


def remove_run_status(model_dir: str) -> None:
  """Before a new attempt: an old status must never be read as this one's."""
  try:
    os.remove(status_path(model_dir))
  except FileNotFoundError:
    pass
