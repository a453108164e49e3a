"""The quiet console (`launch.gin_flags.quiet_tensorflow`), through real processes.

conftest's helpers set TF_CPP_MIN_LOG_LEVEL for every child, which hides the
quiet path; these tests start their children without it. A small child calls
the real `quiet_tensorflow(verbose=False)` and writes to file descriptor 2 as
TensorFlow's C++ side does (os.write, below Python's sys.stderr): info noise,
warnings, more than a pipe buffer of lines, a fatal line before an abort.
Real launchers on a user's console: tests/test_launch.py (quiet) and the
--verbose sweep in tests/test_sweep.py (TensorFlow's info lines shown).
"""

import os
import signal
import subprocess
import sys

from tests.conftest import REPO_ROOT

# TensorFlow's own start-up lines (copied from a real TF 2.21 run): all dropped.
NOISE = [
    b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR',
    b'I0000 00:00:1795653199.513757    7956 port.cc:153] oneDNN custom operations are on.',
    b'I0000 00:00:1795653199.599596    7956 cpu_feature_guard.cc:227] This TensorFlow binary',
    b'To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild',
    b'E0000 00:00:1795653204.243867    7956 cuda_platform.cc:52] failed call to cuInit: INTERNAL',
    # A lost peer's collective aborts (every device, every step; the launcher
    # says it in one paragraph).
    b'E0000 00:00:1795765890.433310   18752 base_collective_executor.cc:252] BaseCollectiveExec'
    b'utor::StartAbort UNAVAILABLE: recvmsg:Connection reset by peer',
    b'E0000 00:00:1795765890.433351   18752 ring_alg.cc:291] Aborting RingReduce with UNAVAILABLE'
    b': Collective ops is aborted by: recvmsg:Connection reset by peer',
    b'Additional GRPC error information from remote target /job:worker/replica:0/task:1 while',
    b':UNKNOWN:Error received from peer  {grpc_message:"recvmsg:Connection reset by peer"',
    b'The error could be from a previous operation. Restart your program to reset. [type.goo',
]
KEPT = [
    b'W0000 00:00:1795653204.3    7956 dtensor_device.cc:99] a warning from C++',
    b'E0000 00:00:1795653204.4    7956 collective_ops.cc:12] an error from C++',
    b'a plain line written to fd 2 by C code',
]
FATAL = b'F0000 00:00:1795653204.5    7956 dtensor_device.cc:42] Check failed: 0 == 1 fatal'
NUM_DATA_LINES = 3000  # 3000 x ~110 bytes: five times a 64 KiB pipe buffer

CHILD = r'''
import ast, os, sys
from launch import gin_flags
mode, noise, kept, fatal, num_data = sys.argv[1], *map(ast.literal_eval, sys.argv[2:])
filter_process = gin_flags.quiet_tensorflow(verbose=False)
print('log level', os.environ.get('TF_CPP_MIN_LOG_LEVEL'),
      'for children', gin_flags.environment_for_children().get('TF_CPP_MIN_LOG_LEVEL'),
      flush=True)
if mode == 'filter_killed':
  filter_process.kill()
  filter_process.wait()
lost = 0
for line in noise + kept + [b'data %05d ' % i + b'.' * 100 for i in range(num_data)]:
  try:
    os.write(2, line + b'\n')
  except BrokenPipeError:
    lost += 1  # what C code sees too (EPIPE): it goes on
if mode != 'unread':  # Python's own stderr is the real one: closed, it would raise
  print('python-level line', file=sys.stderr, flush=True)
if mode == 'abort':
  os.write(2, fatal + b'\n')
  os.abort()
print('finished; lines lost:', lost, flush=True)
'''


def child_environment(**variables: str) -> dict[str, str]:
  environment = {name: value for name, value in os.environ.items()
                 if name != 'TF_CPP_MIN_LOG_LEVEL'}
  environment.update(PYTHONPATH=REPO_ROOT, **variables)
  return environment


def start_child(mode: str, *, environment: dict[str, str] | None = None,
                **popen_arguments) -> subprocess.Popen:
  return subprocess.Popen(
      [sys.executable, '-c', CHILD, mode, repr(NOISE), repr(KEPT), repr(FATAL),
       str(NUM_DATA_LINES)], cwd=REPO_ROOT, env=environment or child_environment(),
      stdout=subprocess.PIPE, **popen_arguments)


def test_noise_is_dropped_and_everything_else_passes_without_blocking():
  child = start_child('drain', stderr=subprocess.PIPE)
  stdout, stderr = child.communicate(timeout=60)
  assert child.returncode == 0, stderr[-3000:]
  assert b'finished; lines lost: 0' in stdout
  # The child's own TensorFlow is quieted; its children are not told what to do.
  assert b'log level 3 for children None' in stdout
  lines = stderr.splitlines()
  for line in NOISE:
    assert line not in lines
  for line in KEPT + [b'python-level line']:
    assert line in lines
  data = [line for line in lines if line.startswith(b'data ')]
  assert data == [b'data %05d ' % i + b'.' * 100 for i in range(NUM_DATA_LINES)]


def test_a_fatal_line_written_just_before_an_abort_reaches_the_console():
  """TensorFlow's CHECK failures write 'F... Check failed' and abort: the
  line, and the 300 KB queued before it, must not die with the process."""
  child = start_child('abort', stderr=subprocess.PIPE)
  _, stderr = child.communicate(timeout=60)
  assert child.returncode == -signal.SIGABRT
  lines = stderr.splitlines()
  assert lines[-1] == FATAL, lines[-3:]
  assert b'data %05d ' % (NUM_DATA_LINES - 1) + b'.' * 100 in lines


def test_a_console_nobody_reads_never_blocks_or_fails_the_writer():
  """`launch.train ... 2>&1 | head`: the real stderr's reader is gone. The
  filter keeps draining the pipe, so TensorFlow's writes neither block nor fail."""
  child = start_child('unread', stderr=subprocess.PIPE)
  child.stderr.close()
  stdout, _ = child.communicate(timeout=60)
  assert b'finished; lines lost: 0' in stdout, stdout
  assert child.returncode == 0


def test_writers_are_never_blocked_once_the_filter_is_gone():
  """With no filter left, writes to fd 2 fail at once (EPIPE), never wait
  for a reader: the launcher holds no read end of the pipe."""
  child = start_child('filter_killed', stderr=subprocess.PIPE)
  stdout, _ = child.communicate(timeout=60)
  assert child.returncode == 0
  assert b'finished; lines lost: %d' % (len(NOISE) + len(KEPT) + NUM_DATA_LINES) in stdout


def test_a_log_level_the_user_set_is_kept_for_the_launcher_and_its_children():
  child = start_child('drain', stderr=subprocess.PIPE,
                      environment=child_environment(TF_CPP_MIN_LOG_LEVEL='1'))
  stdout, _ = child.communicate(timeout=60)
  assert b'log level 1 for children 1' in stdout, stdout
