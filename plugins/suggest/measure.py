"""A candidate layout trained for a few steps in its own process: step time and peak memory.

    trial = measure(files=['configs/experiments/quickstart.gin'], bindings=[],
                    candidate_bindings=suggester.bindings(candidate), steps=8,
                    kill_above=8 * 2**30)
    trial.step_seconds, trial.peak_bytes, trial.ok

`python -m launch.train` runs the config with the candidate's bindings on
top, `steps` steps logged one by one, no checkpoint, one evaluation batch,
in a temporary model_dir that is removed after. The step time is the median
of the steps after the first `warmup` (which compile and settle); the peak
is the child's peak resident memory (`wait4`'s ru_maxrss): on a CPU mesh,
every device of the process. A child whose resident memory passes
`kill_above` is killed and reported as not fitting, so a search never
swaps the machine. `launch.inspect --suggest --measure` and
`bench/suggest.py` both measure through here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Mapping, Sequence

STEP_LINE = re.compile(r'step (\d+)/\d+ .* ([\d.]+) steps/s')
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Trial:
  ok: bool                 # trained to the end
  step_seconds: float      # median after warm-up (0.0 when not ok)
  peak_bytes: int          # the process's peak resident memory
  killed_over: bool        # killed for passing kill_above
  exit_code: int
  seconds: float           # wall time of the whole child
  error: str = ''          # the child's error line when it failed

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def train_command(*, files: Sequence[str], bindings: Sequence[str],
                  candidate_bindings: Sequence[str], steps: int, model_dir: str,
                  search_paths: Sequence[str] = ()) -> list[str]:
  """The launch.train command line of one trial."""
  overrides = [f'train.num_steps = {steps}', 'train.log_every = 1', 'train.eval_every = 0',
               'train.eval_batches = 1', 'train.sample_every = 0',
               'checkpoint.every_steps = 0', 'checkpoint.save_at_end = False']
  return [sys.executable, '-m', 'launch.train', f'--model_dir={model_dir}',
          *[f'--gin_file={f}' for f in files],
          *([f'--gin_search_paths={",".join(search_paths)}'] if search_paths else []),
          *[f'--gin_bindings={b}' for b in [*bindings, *candidate_bindings, *overrides]]]


def measure(*, files: Sequence[str], bindings: Sequence[str],
            candidate_bindings: Sequence[str], steps: int = 8, warmup: int = 3,
            kill_above: int, env: Mapping[str, str] | None = None,
            search_paths: Sequence[str] = ()) -> Trial:
  """One trial (see the module docstring)."""
  model_dir = tempfile.mkdtemp(prefix='meshgin_suggest_')
  environment = dict(env if env is not None else os.environ)
  environment['PYTHONPATH'] = os.pathsep.join(
      p for p in (_REPO, environment.get('PYTHONPATH', '')) if p)
  command = train_command(files=files, bindings=bindings, candidate_bindings=candidate_bindings,
                          steps=steps, model_dir=model_dir, search_paths=search_paths)
  child = watch(command, env=environment, kill_above=kill_above)
  shutil.rmtree(model_dir, ignore_errors=True)
  rates = [float(m.group(2)) for m in STEP_LINE.finditer(child.stderr)
           if int(m.group(1)) > warmup]
  ok = child.exit_code == 0 and not child.killed_over and bool(rates)
  return Trial(ok=ok, step_seconds=statistics.median(1.0 / r for r in rates) if ok else 0.0,
               peak_bytes=child.peak_bytes, killed_over=child.killed_over,
               exit_code=child.exit_code, seconds=child.seconds,
               error='' if ok or child.killed_over else error_line(child.stderr))


@dataclasses.dataclass(frozen=True)
class Watched:
  """How a child process ended: its exit code, peak resident memory, whether
  it was killed for passing the limit, its stderr and its wall time."""
  exit_code: int
  peak_bytes: int
  killed_over: bool
  stderr: str
  seconds: float


def watch(command: Sequence[str], *, env: Mapping[str, str], kill_above: int,
          cwd: str | None = None) -> Watched:
  """Runs `command` to its end, killing it as soon as its resident memory
  passes `kill_above`; its stderr drained as it runs (so it never blocks on
  the pipe) and its peak read from `wait4`'s rusage (bench/memory.py too)."""
  start = time.perf_counter()
  child = subprocess.Popen(list(command), env=dict(env), cwd=cwd, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
  err_file = tempfile.TemporaryFile()
  drain = threading.Thread(target=lambda: shutil.copyfileobj(child.stderr, err_file),
                           daemon=True)
  drain.start()
  over = False
  while True:  # wait4, not poll: the child's rusage is ours to read
    pid, status, usage = os.wait4(child.pid, os.WNOHANG)
    if pid:
      break
    if rss_bytes(child.pid) > kill_above:
      over = True
      child.kill()
      _, status, usage = os.wait4(child.pid, 0)
      break
    time.sleep(0.05)
  code = child.returncode = os.waitstatus_to_exitcode(status)
  drain.join(5)
  err_file.seek(0)
  return Watched(exit_code=code, peak_bytes=usage.ru_maxrss * 1024, killed_over=over,
                 stderr=err_file.read().decode(errors='replace'),
                 seconds=time.perf_counter() - start)


def error_line(stderr: str) -> str:
  """The line of a failed launcher's stderr that says why."""
  lines = [l for l in stderr.splitlines()
           if l.startswith(('Configuration error', 'Training')) or 'Error' in l]
  return (lines[0] if lines else (stderr.strip().splitlines() or ['?'])[-1])[:300]


def rss_bytes(pid: int) -> int:
  try:
    with open(f'/proc/{pid}/status') as f:
      for line in f:
        if line.startswith('VmRSS:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0
