"""`python -m module args...` for the tests, forked from an interpreter that
has already imported TensorFlow.

Every launcher the tests start (`launch.train`, `launch.inspect`, ...) spends
about 3 CPU-seconds of its start-up importing TensorFlow (which imports Keras'
optimizers too) before it does anything of its own, and the suite starts
dozens of them on 2 cores. A `Zygote` is a process that imports TensorFlow,
gin, absl and this repository's libraries once and then, for each run the
tests ask for, forks: the child takes the run's argv, working directory,
environment and output pipes and runs the module as `__main__` with
`runpy`, exactly the code `python -m` runs; only the imports are inherited.
It is a real, separate process (its own pid, devices, TensorFlow context
and exit status): nothing TensorFlow initialises at run time (the eager
context, devices, threads) exists in the zygote when it forks, which is
what makes the fork safe. The zygote checks that before each fork
(`fork_hazards`) and refuses a run it cannot fork safely, which then gets a
fresh interpreter like the runs below. Modules that define absl flags
(`launch.*`) are not preloaded: each child defines them fresh, as `python -m`
does.

The one thing a child cannot change is what TensorFlow read from the
environment at import time, so a run whose environment differs from the
zygote's in such a variable (`IMPORT_TIME_VARIABLES`) is started with a
fresh interpreter instead: `Zygote.start` refuses it (ZygoteUnavailable) and
`conftest.run_module` / `conftest.Launched` fall back.

Protocol, on a Unix socket: the client sends a length-prefixed JSON request
({argv, cwd, env}) with its stdout and stderr descriptors (SCM_RIGHTS); the
zygote answers `pid N` at the fork and `exit CODE CPU_SECONDS` when the child ends, or
`refused WHY` instead of forking. A client that closes its connection before
then (or dies) takes its run with it: the zygote kills it. The zygote ends
when its stdin (a pipe from the test process) closes.

The runs of `STARTS_ITS_RUNS_FORKED` get tests/zygote_shim.py as their
`sys.executable`, so the `launch.train` runs they start are forked too.

    python -m tests.zygote SOCKET_PATH [MODULE:FUNCTION ...]

Each MODULE:FUNCTION is called once after the preload: tests/test_runner.py
makes a zygote of its own unsafe to fork with one.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Mapping, Sequence

from tests import cpu_ledger

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What TensorFlow, Keras, Python or the C libraries read when they are loaded:
# a run that sets any of these differently needs its own interpreter. Not
# TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS (a sweep's trials set them):
# TensorFlow reads them when its context starts, in the child (a child forked
# after `import tensorflow` that sets 1, 4, 8 runs 4, 10, 18 threads, the
# same pools as a fresh process's 5, 11, 19 less the zygote's one).
IMPORT_TIME_VARIABLES = ('TF_CPP_', 'TF_ENABLE_', 'TF_USE_LEGACY', 'KERAS_', 'CUDA_', 'XLA_',
                         'PYTHON', 'LD_', 'MALLOC_', 'OMP_', 'OPENBLAS_', 'MKL_')
PRELOAD = ('tensorflow', 'tensorflow.experimental.dtensor', 'numpy', 'gin', 'absl.app',
           'absl.logging', 'tensorboard.summary.writer.event_file_writer',
           'plugins.training', 'plugins.gin_setup', 'plugins.plan')
# Imported by Keras inside `import tensorflow` when installed (lm-eval, in the
# test extra, brings them), and each starts native threads at import
# (scikit-learn: OpenMP's; pandas: pyarrow's), which would make every fork
# unsafe. The zygote's preload finds them missing (Keras takes them as
# optional); a forked run that imports them gets them afresh.
KEPT_OUT = ('sklearn', 'pandas', 'pyarrow')
_LENGTH = struct.Struct('!I')
# The launchers whose own `python -m launch.train` runs are forked from the
# zygote too (tests/zygote_shim.py): local_cluster's clients, the candidates
# `launch.inspect --suggest` measures, a sweep's trials (a sweep believes a
# trial's run_status.json by the attempt name it gave it, not by a pid).
STARTS_ITS_RUNS_FORKED = ('launch.local_cluster', 'launch.inspect', 'launch.sweep')


def differs_at_import(env: Mapping[str, str], base: Mapping[str, str]) -> list[str]:
  """The import-time variables `env` sets differently from `base` (a
  PYTHONPATH naming the same directories, some twice, is the same:
  launch.local_cluster puts the repository in front of one that has it)."""
  def value(variables, name):
    if name != 'PYTHONPATH' or name not in variables:
      return variables.get(name)
    return list(dict.fromkeys(p for p in variables[name].split(os.pathsep) if p))
  names = set(env) | set(base)
  return sorted(n for n in names if n.startswith(IMPORT_TIME_VARIABLES)
                and value(env, n) != value(base, n))


# ---------------------------------------------------------------- the server


def _threads() -> frozenset[int]:
  """The ids of this process's threads, native ones included."""
  return frozenset(int(task) for task in os.listdir('/proc/self/task'))


def fork_hazards(known_threads: frozenset[int]) -> list[str]:
  """Why a fork now would not be safe ([] when it is). A child inherits
  only the forking thread, so any other thread's locks (TensorFlow's
  runtime, a thread pool's queue) may be held forever in the child; and an
  initialised eager context or device list (CUDA's included) is state
  TensorFlow does not expect to find copied into another process. The
  threads allowed are `known_threads`, those numpy's import started (see
  `serve`), by id: a thread started since is not one of them even where the
  count is unchanged."""
  # pylint: disable=protected-access
  hazards = []
  eager = sys.modules.get('tensorflow.python.eager.context')
  context = eager._context if eager is not None else None  # made by context(), not at import
  # Read directly, not with getattr defaults: a TensorFlow that renames them
  # fails here (every run then falls back to a fresh interpreter, and
  # test_runner's forking test says so) instead of passing as safe.
  if context is not None and (context._context_handle is not None
                              or context._physical_devices is not None):
    hazards.append("TensorFlow's eager context or its physical devices are initialised")
  extra = _threads() - known_threads
  if extra:
    named = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    hazards.append(f'{len(extra)} thread(s) besides the main thread and those numpy\'s import '
                   f'started' + (f' (Python threads: {", ".join(named)})' if named else ''))
  return hazards


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
  data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)  # stdout, stderr (or one for both)
  while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
    more = conn.recv(1 << 20)
    if not more:
      raise ConnectionError('request cut short')
    data += more
  return json.loads(data[_LENGTH.size:]), list(fds)


def _run_child(request: dict, fds: Sequence[int]) -> None:
  """In the forked child: become `python -m module args...`; never returns."""
  code = 1
  try:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get('new_session'):
      os.setsid()
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)  # one descriptor: stderr merged into stdout
    for fd in set(fds):
      os.close(fd)
    if request.get('unbuffered'):  # python -u
      for name, fd in (('stdout', 1), ('stderr', 2)):
        setattr(sys, name, io.TextIOWrapper(open(fd, 'wb', buffering=0, closefd=False),
                                            write_through=True))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name in KEPT_OUT:
      if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]  # importable again, started in this process
    if request.get('python'):  # what the run starts its own runs with (tests/zygote_shim.py)
      sys.executable = request['python']
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    module, *args = request['argv']
    sys.argv = [module, *args]
    try:
      runpy.run_module(module, run_name='__main__', alter_sys=True)
      code = 0
    except SystemExit as e:  # as the interpreter reports it
      if e.code is None or isinstance(e.code, int):
        code = e.code or 0
      else:
        print(e.code, file=sys.stderr)
    threading._shutdown()  # pylint: disable=protected-access  # what interpreter exit does
    atexit._run_exitfuncs()  # pylint: disable=protected-access
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
  finally:
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    os._exit(code)  # pylint: disable=protected-access


def serve(path: str, setup: Sequence[str] = ()) -> None:
  # numpy first, alone: its import starts OpenBLAS's thread server (one thread
  # per core but one), the only threads besides the main one that a fork may
  # find here. OpenBLAS stops them itself before a fork (pthread_atfork) and
  # starts new ones when it next multiplies; whatever thread the rest of the
  # preload, or anything later, starts makes the zygote refuse to fork.
  __import__('numpy')
  known_threads = _threads()
  for name in KEPT_OUT:
    sys.modules.setdefault(name, None)  # `import name` raises ImportError
  for name in PRELOAD:
    __import__(name)
  for hook in setup:
    module, _, function = hook.partition(':')
    getattr(importlib.import_module(module), function)()
  gc.collect()
  gc.freeze()  # a child's collections (one at its exit) skip what it inherits
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path)
  listener.listen(16)
  selector = selectors.DefaultSelector()
  selector.register(listener, selectors.EVENT_READ, 'request')
  selector.register(sys.stdin, selectors.EVENT_READ, 'parent')
  print('ready', flush=True)
  children: dict[int, socket.socket] = {}
  while True:
    for key, _ in selector.select(timeout=0.05):
      if key.data == 'parent':
        if not os.read(sys.stdin.fileno(), 4096):  # the tests are done
          for pid in children:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
          return
        continue
      if key.data != 'request':  # a run's client closed its connection: the run goes too
        _client_gone(selector, key.fileobj, *key.data)
        continue
      conn, _ = listener.accept()
      try:
        request, fds = _receive(conn)
      except (OSError, ValueError) as e:
        conn.close()
        print(f'zygote: bad request: {e}', file=sys.stderr, flush=True)
        continue
      hazards = fork_hazards(known_threads)
      if hazards:  # the client starts the run with a fresh interpreter instead
        for fd in fds:
          os.close(fd)
        try:
          conn.sendall(f'refused {"; ".join(hazards)}\n'.encode())
        except OSError:
          pass
        conn.close()
        continue
      sys.stdout.flush()
      sys.stderr.flush()
      pid = os.fork()
      if pid == 0:
        listener.close()
        for other in children.values():
          other.close()
        conn.close()
        _run_child(request, fds)
      for fd in fds:
        os.close(fd)
      conn.sendall(f'pid {pid}\n'.encode())
      children[pid] = conn
      selector.register(conn, selectors.EVENT_READ, (pid, bool(request.get('new_session'))))
    while children:
      pid, status, usage = os.wait4(-1, os.WNOHANG)
      if not pid:
        break
      conn = children.pop(pid, None)
      if conn is not None and conn.fileno() >= 0:
        selector.unregister(conn)
        try:
          cpu = usage.ru_utime + usage.ru_stime  # its own and its reaped children's
          conn.sendall(f'exit {os.waitstatus_to_exitcode(status)} {cpu:.3f}\n'.encode())
        except OSError:
          pass
        conn.close()


def _client_gone(selector, conn: socket.socket, pid: int, own_session: bool) -> None:
  """A client never writes after its request: readable means it closed the
  connection (or died, as a SIGKILLed zygote_shim does), and its run is
  killed with what it started in its session."""
  try:
    if conn.recv(1):
      return
  except OSError:  # reset by a client that died: gone all the same
    pass
  selector.unregister(conn)
  conn.close()
  try:
    (os.killpg if own_session else os.kill)(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


# ---------------------------------------------------------------- the client

_SESSION: list = []  # [Zygote or None]: made at the first run a test asks for
_SESSION_LOCK = threading.Lock()


def session_zygote(env: Mapping[str, str]) -> 'Zygote | None':
  """The test session's zygote, started with `env` on first use; None with
  MESHGIN_TEST_FRESH_PROCESSES=1. (Here, not in conftest.py: pytest imports
  conftest.py as `conftest` and test modules import it again as
  `tests.conftest`, two copies of its globals; this module is imported once.)"""
  with _SESSION_LOCK:
    if not _SESSION:
      fresh = os.environ.get('MESHGIN_TEST_FRESH_PROCESSES') == '1'
      _SESSION.append(None if fresh else Zygote(tempfile.mkdtemp(prefix='meshgin-zygote-'),
                                                env=env))
    return _SESSION[0]


def close_session_zygote() -> None:
  with _SESSION_LOCK:
    if _SESSION and _SESSION[0] is not None:
      _SESSION[0].close()
      _SESSION[0] = None



def _write_shim(scratch: str, *, socket_path: str, env: Mapping[str, str]) -> str:
  """Writes `scratch/python`, the `sys.executable` of the runs this zygote
  forks (tests/zygote_shim.py), and returns its path."""
  config = os.path.join(scratch, 'shim.json')
  spool = os.path.join(scratch, 'cpu.spool')
  with open(config, 'w', encoding='utf-8') as f:
    json.dump({'socket': socket_path, 'python': sys.executable, 'env': dict(env),
               'spool': spool}, f)
  open(spool, 'w').close()  # pylint: disable=consider-using-with
  cpu_ledger.watch(spool)
  shim = os.path.join(scratch, 'python')
  with open(shim, 'w', encoding='utf-8') as f:
    f.write(f'#!{sys.executable} -IS\nimport sys\nsys.path.insert(0, {REPO_ROOT!r})\n'
            f'from tests.zygote_shim import main\nmain({config!r}, sys.argv[1:])\n')
  os.chmod(shim, 0o755)
  return shim


class ZygoteUnavailable(RuntimeError):
  """The zygote could not start a run (nothing was forked)."""


def request(path: str, run: dict, fds: Sequence[int]) -> tuple[socket.socket, int, bytes]:
  """Asks the zygote at `path` to fork `run` ({argv, cwd, env, ...}) with
  `fds`: (connection, the child's pid, bytes read past its line);
  ZygoteUnavailable if it forked nothing."""
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    conn.connect(path)
    body = json.dumps(run).encode()
    socket.send_fds(conn, [_LENGTH.pack(len(body)) + body], list(fds))
    reply = b''
    while b'\n' not in reply:
      more = conn.recv(4096)
      if not more:
        raise ConnectionError('the zygote closed the connection without forking')
      reply += more
  except OSError as e:
    conn.close()
    raise ZygoteUnavailable(f'test zygote {path}: {e}') from e
  line, pending = reply.split(b'\n', 1)
  word, _, rest = line.decode(errors='replace').partition(' ')
  if word == 'refused':
    conn.close()
    raise ZygoteUnavailable(f'test zygote {path} refused to fork: {rest}')
  return conn, int(rest), pending


class Zygote:
  """A zygote process and the runs forked from it (see the module doc)."""

  def __init__(self, scratch: str, env: Mapping[str, str], setup: Sequence[str] = ()):
    """`setup`: MODULE:FUNCTION names the zygote calls after its preload."""
    self.env = dict(env)
    self.path = os.path.join(scratch, 'zygote.sock')
    self.python = _write_shim(scratch, socket_path=self.path, env=self.env)
    self.process = subprocess.Popen([sys.executable, '-m', 'tests.zygote', self.path, *setup],
                                    cwd=REPO_ROOT, env=self.env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    ready = self.process.stdout.readline()
    if ready.strip() != b'ready':
      raise RuntimeError(f'the test zygote did not start (exit {self.process.poll()})')

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait(30)
    shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)

  def start(self, argv: Sequence[str], *, env: Mapping[str, str], unbuffered: bool = False,
            new_session: bool = False, stderr_apart: bool = False) -> 'Forked':
    """`python [-u] -m argv...` (argv[0] the module) from the repo root, started
    like `subprocess.Popen(..., stdout=PIPE, stderr=STDOUT (or PIPE with
    `stderr_apart`), text=True, start_new_session=new_session)`.
    ZygoteUnavailable if nothing was started: the zygote is gone, refused
    to fork (`fork_hazards`), or `env` sets an import-time variable
    differently from the zygote's."""
    differs = differs_at_import(env, self.env)
    if differs:
      raise ZygoteUnavailable(f'set differently from the zygote\'s at import: {differs}')
    pipes = [os.pipe() for _ in range(2 if stderr_apart else 1)]
    try:
      conn, pid, pending = request(
          self.path, {'argv': list(argv), 'cwd': REPO_ROOT, 'env': dict(env),
                      'unbuffered': unbuffered, 'new_session': new_session,
                      'python': self.python if argv[0] in STARTS_ITS_RUNS_FORKED else None},
          [w for _, w in pipes])
    except ZygoteUnavailable:
      for r, _ in pipes:
        os.close(r)
      raise
    finally:
      for _, w in pipes:
        os.close(w)
    streams = [open(r, encoding='utf-8', errors='replace') for r, _ in pipes]
    return Forked(conn, pid, pending, stdout=streams[0],
                  stderr=streams[1] if stderr_apart else None, argv=argv)

  def run(self, argv: Sequence[str], *, env: Mapping[str, str],
          timeout: float) -> subprocess.CompletedProcess:
    """`start` run to the end like `subprocess.run(..., capture_output=True,
    text=True, timeout=timeout)`."""
    process = self.start(argv, env=env, stderr_apart=True)
    return run_to_end(process, [sys.executable, '-m', *argv], process.wait, timeout)


def run_to_end(process, command: list[str], wait, timeout: float) -> subprocess.CompletedProcess:
  """Reads `process`'s stdout and stderr to their ends while `wait(timeout)`
  waits for its exit code, like `subprocess.run(..., capture_output=True,
  text=True, timeout=timeout)`; past the timeout (`wait` raises
  TimeoutExpired) the process is killed and TimeoutExpired raised with what
  it printed."""
  captured = {}
  readers = [threading.Thread(target=lambda name, f: captured.__setitem__(name, f.read()),
                              args=(name, getattr(process, name)), daemon=True)
             for name in ('stdout', 'stderr')]
  for reader in readers:
    reader.start()
  try:
    code = wait(timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait(10)  # a forked run's exit status closes its connection
    for reader in readers:
      reader.join(10)
    raise subprocess.TimeoutExpired(command, timeout, output=captured.get('stdout'),
                                    stderr=captured.get('stderr')) from None
  for reader in readers:
    reader.join()
  return subprocess.CompletedProcess(command, code, captured['stdout'], captured['stderr'])


class Forked:
  """A run forked by the zygote, with the parts of `subprocess.Popen` the
  tests use: pid, stdout and stderr (text; stderr None when merged),
  returncode, poll, wait, send_signal, terminate, kill. Its exit status
  comes over the socket."""

  def __init__(self, conn: socket.socket, pid: int, pending: bytes, stdout, stderr=None,
               argv: Sequence[str] = ()):
    self.argv = list(argv)
    self._conn = conn
    self._pending = pending
    self.stdout = stdout
    self.stderr = stderr
    self.returncode: int | None = None
    self.cpu: float | None = None  # its CPU seconds (its reaped children's too), at exit
    self.pid = pid

  def _line(self, timeout: float | None) -> bytes:
    """The zygote's next line; b'' if it closed the connection."""
    self._conn.settimeout(timeout)
    while b'\n' not in self._pending:
      more = self._conn.recv(4096)  # socket.timeout past `timeout`
      if not more:
        return b''
      self._pending += more
    line, self._pending = self._pending.split(b'\n', 1)
    return line

  def _exited(self, timeout: float | None) -> int | None:
    if self.returncode is None:
      try:
        line = self._line(timeout)
      except (socket.timeout, BlockingIOError):
        return None
      words = line.split()
      self.returncode = int(words[1]) if line else -signal.SIGKILL
      self._conn.close()
      if line:
        self.cpu = float(words[2])
        cpu_ledger.add(self.cpu, self.argv)
    return self.returncode

  def poll(self) -> int | None:
    return self._exited(0)

  def wait(self, timeout: float | None = None) -> int:
    code = self._exited(timeout)
    if code is None:
      raise subprocess.TimeoutExpired(f'forked pid {self.pid}', timeout)
    return code

  def send_signal(self, signum: int) -> None:
    if self.returncode is None:
      try:
        os.kill(self.pid, signum)
      except ProcessLookupError:
        pass

  def terminate(self) -> None:
    self.send_signal(signal.SIGTERM)

  def kill(self) -> None:
    self.send_signal(signal.SIGKILL)


if __name__ == '__main__':
  serve(sys.argv[1], sys.argv[2:])
