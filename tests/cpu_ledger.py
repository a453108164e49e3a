"""Where the suite's CPU time goes: per test file, and per process a test launched.

Each pytest process (a shard of `tests/run.py`) charges every test file with
the CPU seconds spent while its tests (and the module fixtures they start)
ran: its own threads, the children it reaped, and the runs the zygote forked
for it (each run's seconds come back with its exit status, `tests/zygote.py`).
A run started with a fresh interpreter is measured the same way at its exit
(`exited_cpu`). With MESHGIN_TEST_CPU_LOG=FILE the shard writes the ledger
there at its end; `tests/run.py` adds up the shards' ledgers and prints them
under its own total, which counts every process it waited for.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import threading
import time
from typing import Iterable, Sequence

_LOCK = threading.Lock()
_LAUNCHES: list[dict] = []      # {'test', 'run', 'cpu'}
_FILES: collections.Counter = collections.Counter()
_REPORTED = [0.0]               # CPU seconds of runs reaped by someone else (the zygote)
_SPOOLS: dict[str, int] = {}    # file the runs' runs are reported to -> bytes read of it


def label(argv: Sequence[str]) -> str:
  """A launched run in a few words: its module and its first flags."""
  words = ' '.join(a for a in argv if not a.startswith('--model_dir='))
  return words if len(words) <= 100 else words[:97] + '...'


def add(cpu: float, argv: Sequence[str], *, reaped_here: bool = False,
        test: str | None = None) -> None:
  """Records a launched run's CPU seconds, charged to the test running now.
  `reaped_here`: this process reaped it, so its seconds are in RUSAGE_CHILDREN
  already (they are listed, not counted twice)."""
  test = test or os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]
  with _LOCK:
    _LAUNCHES.append({'test': test, 'run': label(argv), 'cpu': round(cpu, 2)})
    if not reaped_here:
      _REPORTED[0] += cpu


def watch(spool: str) -> None:
  """Also counts the runs reported to `spool`, one JSON line ({'cpu', 'argv'})
  each: those a launched run started itself through the zygote
  (tests/zygote_shim.py), which the zygote reaped."""
  with _LOCK:
    _SPOOLS.setdefault(spool, 0)


def _read_spools(test: str | None) -> None:
  with _LOCK:
    spools = dict(_SPOOLS)
  for spool, offset in spools.items():
    try:
      with open(spool, 'rb') as f:
        f.seek(offset)
        complete = f.read().rpartition(b'\n')[0]
    except FileNotFoundError:
      continue
    if complete:
      with _LOCK:
        _SPOOLS[spool] = offset + len(complete) + 1
      for line in complete.split(b'\n'):
        run = json.loads(line)
        add(run['cpu'], run['argv'], test=test)


def exited_cpu(pid: int, timeout: float | None) -> float | None:
  """Waits for child `pid` to exit without reaping it (the caller still reaps
  it, so its exit status is kept) and returns its CPU seconds, its reaped
  children's included; None if it is still running after `timeout`."""
  deadline = None if timeout is None else time.monotonic() + timeout
  while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
    if deadline is not None and time.monotonic() > deadline:
      return None
    time.sleep(0.02)
  with open(f'/proc/{pid}/stat') as f:
    fields = f.read().rsplit(')', 1)[1].split()
  utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
  return (utime + stime + cutime + cstime) / os.sysconf('SC_CLK_TCK')


def seconds_so_far(test: str | None = None) -> float:
  """This process's CPU seconds, with its reaped children's and the runs the
  zygote reaped for it (`test`: the test the runs reported since are charged to)."""
  _read_spools(test)
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  with _LOCK:
    reported = _REPORTED[0]
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + reported


def charge(test_file: str, seconds: float) -> None:
  with _LOCK:
    _FILES[test_file] += seconds


def write(path: str) -> None:
  with _LOCK:
    ledger = {'files': dict(_FILES), 'launches': list(_LAUNCHES)}
  with open(path, 'w') as f:
    json.dump(ledger, f)


def report(ledgers: Iterable[dict], *, total: float, wall: float, top: int = 15) -> str:
  """The shards' ledgers as a few lines: the costliest files and runs, and the total."""
  ledgers = list(ledgers)
  files: collections.Counter = collections.Counter()
  for ledger in ledgers:
    files.update(ledger['files'])
  launches = sorted((l for ledger in ledgers for l in ledger['launches']),
                    key=lambda l: -l['cpu'])
  lines = [f'--- CPU seconds per test file (top {top} of {len(files)}) ---']
  lines += [f'{seconds:8.1f}  {name}' for name, seconds in files.most_common(top)]
  lines.append(f'--- CPU seconds per launched process (top {top} of {len(launches)}, '
               f'{sum(l["cpu"] for l in launches):.0f} s in all) ---')
  lines += [f'{l["cpu"]:8.1f}  {l["run"]}  [{l["test"]}]' for l in launches[:top]]
  lines.append(f'CPU seconds: {total:.0f} in all ({sum(files.values()):.0f} charged to test '
               f'files), over {wall:.0f} s wall')
  return '\n'.join(lines)
