"""One writer per directory: an exclusive lock on a model_dir (or a sweep root).

    lock = DirectoryLock.acquire('/runs/lm', purpose='launch.train')   # or LockedError
    try:
      ...train...
    finally:
      lock.release()

The lock is `<directory>/.meshgin-lock`: an `fcntl.flock` held for the whole
run on a small JSON file that names its holder (pid, host, start time,
command). The kernel drops a flock when its process dies, however it dies, so
a lock left by a SIGKILLed run on the same host is free and is taken over
(with a warning naming the dead holder). A clean exit empties the file (an
empty file: free, and a directory whose lock was taken and given back holds
the same bytes as before). Only its holder deletes the file, and only while it
still holds the flock (`release` of a directory the lock created): a process
that opened the file before and gets its flock after sees that the path now
names another file, or none, and opens it anew, so two processes never both
believe they hold the lock.

Network filesystems: on NFSv4 and most cluster filesystems flock is carried
to the server and holds across hosts; where it is not (NFSv3 without lockd,
some FUSE mounts) each host sees only its own locks. The file's modification
time is therefore also a heartbeat, touched every `heartbeat_seconds` by a
thread of the holder (stopped and joined by `release` before the file is
touched or closed): a record from another host whose heartbeat is younger than
`stale_seconds` refuses the lock even when flock granted it, and an older one
is taken over as stale.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time

from absl import logging

from layout_core.errors import ConfigError

LOCK_NAME = '.meshgin-lock'


class LockedError(ConfigError):
  """The directory is held by another live process."""


@dataclasses.dataclass(frozen=True)
class Holder:
  pid: int
  host: str
  started_at: float
  command: str
  purpose: str = ''

  def describe(self) -> str:
    when = time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started_at))
    return (f'pid {self.pid} on {self.host}, started {when} ({self.purpose}): '
            f'{self.command}')


def _pid_running(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _read_holder(fd: int) -> Holder | None:
  try:
    text = os.pread(fd, 1 << 16, 0).decode()
    return Holder(**json.loads(text)) if text.strip() else None
  except (OSError, ValueError, TypeError):
    return None  # an unreadable record holds nothing


class DirectoryLock:
  """A held lock on one directory (see the module doc); `release()` it."""

  def __init__(self, *, directory: str, fd: int, holder: Holder, created_directory: bool,
               heartbeat_seconds: float):
    self.directory, self.holder = directory, holder
    self.path = os.path.join(directory, LOCK_NAME)
    self._fd = fd
    self._created_directory = created_directory
    self._stop = threading.Event()
    # The thread gets the descriptor and its stop event as arguments, never
    # through `self`: it cannot see the descriptor change or be closed under it.
    self._heartbeat = threading.Thread(
        target=_beat, kwargs=dict(fd=fd, seconds=heartbeat_seconds, stop=self._stop),
        name=f'lock-heartbeat {self.path}', daemon=True)
    self._heartbeat.start()

  @classmethod
  def acquire(cls, directory: str, *, purpose: str, stale_seconds: float = 120.0,
              heartbeat_seconds: float = 15.0) -> 'DirectoryLock':
    """Takes the lock, creating `directory` if needed; LockedError when a live
    process holds it (nothing in the directory changes then)."""
    created = not os.path.isdir(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    where = f'{directory} (lock file {path})'
    for _ in range(5):
      fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
          os.close(fd)
          raise
        holder = _read_holder(fd)
        for _ in range(20):  # a holder that locked this instant writes its name next
          if holder is not None:
            break
          time.sleep(0.1)
          holder = _read_holder(fd)
        os.close(fd)
        raise LockedError(
            f'{directory} is in use by another run: '
            f'{holder.describe() if holder else "a process that has not written its name yet"}',
            where=where, fix='wait for that run to finish, stop it (SIGTERM saves and exits), '
            'or give this run another --model_dir') from None
      try:  # the holder we waited on may have removed the file as it released it
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    else:
      raise RuntimeError(f'could not lock {path}: the file keeps being replaced')
    previous = _read_holder(fd)
    if previous is not None:
      age = time.time() - os.fstat(fd).st_mtime
      if previous.host != socket.gethostname() and age < stale_seconds:
        os.close(fd)  # flock does not reach that host: believe its heartbeat
        raise LockedError(
            f'{directory} is in use by a run on another host: {previous.describe()} '
            f'(heartbeat {age:.0f} s ago)', where=where,
            fix=f'wait for that run to finish, or, if it is gone, wait {stale_seconds:.0f} s '
            'after its last heartbeat and start again')
      if previous.host != socket.gethostname():
        reason = f'its heartbeat is {age:.0f} s old'
      elif _pid_running(previous.pid):
        reason = f'pid {previous.pid} is running but does not hold the lock (a reused pid)'
      else:
        reason = f'pid {previous.pid} is no longer running'
      logging.warning('Took over the lock on %s left by %s: %s', directory,
                      previous.describe(), reason)
    holder = Holder(pid=os.getpid(), host=socket.gethostname(), started_at=time.time(),
                    command=' '.join(sys.argv), purpose=purpose)
    _write_holder(fd, holder)
    return cls(directory=directory, fd=fd, holder=holder, created_directory=created,
               heartbeat_seconds=heartbeat_seconds)

  def release(self) -> None:
    """Stops the heartbeat, empties the record and unlocks. A directory this
    lock created that holds nothing else is removed (a run rejected at
    start-up leaves no trace): the file first, while the flock is still held
    (see the module doc), then the descriptor is closed."""
    if self._fd is None:
      return
    self._stop.set()
    self._heartbeat.join()  # no heartbeat touches the descriptor from here on
    try:
      if self._created_directory and os.listdir(self.directory) == [LOCK_NAME]:
        os.remove(self.path)
        os.rmdir(self.directory)
      else:
        os.ftruncate(self._fd, 0)
        os.fsync(self._fd)
    except OSError:
      pass
    finally:
      os.close(self._fd)  # drops the flock
      self._fd = None

  def __enter__(self) -> 'DirectoryLock':
    return self

  def __exit__(self, *exc) -> None:
    self.release()


def _beat(*, fd: int, seconds: float, stop: threading.Event) -> None:
  """Touches the lock file's mtime every `seconds` until `stop` is set."""
  while not stop.wait(seconds):
    try:
      os.utime(fd)
    except OSError:
      pass  # the directory went away: the next save recreates what it needs


def _write_holder(fd: int, holder: Holder) -> None:
  data = json.dumps(dataclasses.asdict(holder)).encode()
  os.ftruncate(fd, 0)
  os.pwrite(fd, data, 0)
  os.fsync(fd)
