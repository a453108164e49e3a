"""Files that survive a crash whole or not at all: the one place meshgin
writes through when a half-written file would mislead a later run.

    write_atomically('corpus/corpus.json', text.encode())   # temp, fsync, rename, fsync dir
    replace_durably('shard.tfrecord.incomplete', 'shard.tfrecord')
    sync_directory('checkpoints')   # the names in it (renames, new files) are on disk
    check_writable('out/samples.jsonl', where='--output')   # before a run: exit 2, not a traceback
    with directory_aside('exports/llama-hf', replace=True) as partial:
      write_files_into(partial)     # renamed to exports/llama-hf once the block ends

Checkpoints (`layout_core.checkpoint`), prepared corpora and token documents
(`layout_core.tasks`) use the file functions; imported runs, Hugging Face,
PEFT and SavedModel exports (`layout_core.convert`, `layout_core.infer.export`,
`plugins.hf`) the directory one. A reader never sees a partial file or
directory under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Callable, Iterator

from layout_core.errors import ConfigError

INCOMPLETE_SUFFIX = '.incomplete'


def sync_directory(path: str) -> None:
  """fsync of a directory: the names in it (renames, new files) survive a crash."""
  descriptor = os.open(path, os.O_RDONLY)
  try:
    os.fsync(descriptor)
  finally:
    os.close(descriptor)


def replace_durably(partial: str, path: str) -> None:
  """Renames the complete file `partial` to `path` once its bytes are on
  disk, then makes the rename itself durable (fsync of the directory)."""
  with open(partial, 'rb') as f:
    os.fsync(f.fileno())
  os.replace(partial, path)
  sync_directory(os.path.dirname(path) or '.')


def write_atomically(path: str, data: bytes) -> None:
  """`data` as the file `path`, through `path + INCOMPLETE_SUFFIX`."""
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  partial = path + INCOMPLETE_SUFFIX
  with open(partial, 'wb') as f:
    f.write(data)
  replace_durably(partial, path)


def check_writable(path: str, *, where: str) -> None:
  """ConfigError unless `write_atomically(path, ...)` can write there: `path`
  is not a directory, and its nearest existing parent is a directory this
  process may write in (the missing ones below it are made). Checked before
  the work whose result it will hold, so a bad path costs a second."""
  if os.path.isdir(path):
    raise ConfigError(f'{where} {path!r} is a directory', where=where,
                      fix='give the path of a file, e.g. ' + os.path.join(path, 'out.jsonl'))
  parent = os.path.dirname(os.path.abspath(path))
  while not os.path.exists(parent):
    parent = os.path.dirname(parent)
  if not os.path.isdir(parent):
    raise ConfigError(f'{where} {path!r} cannot be written: {parent!r} is a file, not a '
                      'directory', where=where,
                      fix='give a path whose directories are directories (or do not exist yet)')
  if not os.access(parent, os.W_OK | os.X_OK):
    raise ConfigError(f'{where} {path!r} cannot be written: no permission to write in '
                      f'{parent!r}', where=where, fix='give a path in a directory you can write')


def sync_tree(directory: str) -> None:
  """Every file under `directory`, and the directories' names, on disk."""
  for path, _, files in os.walk(directory):
    for name in files:
      with open(os.path.join(path, name), 'rb') as f:
        os.fsync(f.fileno())
    sync_directory(path)


@contextlib.contextmanager
def directory_aside(target: str, *, replace: bool = False,
                    check: Callable[[], None] | None = None) -> Iterator[str]:
  """Yields a new empty directory beside `target` (`.<name>.partial-<pid>`)
  to write into. When the block ends normally every file in it is synced
  (`sync_tree`), `check()` runs (the caller's last look at `target`: time
  has passed), and one rename makes it `target`: an existing `target`, which
  only `replace` allows, is moved aside first (a reader sees the old
  directory, the new one, or for the instant between the two renames none),
  put back if the rename fails, and deleted once the new one is in place.
  When the block raises, the partial directory is deleted, and so are the
  parent directories this call created."""
  target = os.path.abspath(target)
  parent = os.path.dirname(target)
  created = []
  path = parent
  while not os.path.isdir(path):
    created.append(path)
    path = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  partial = os.path.join(parent, f'.{os.path.basename(target)}.partial-{os.getpid()}')
  shutil.rmtree(partial, ignore_errors=True)
  os.makedirs(partial)
  done = False
  try:
    yield partial
    sync_tree(partial)
    if check is not None:
      check()
    if os.path.lexists(target) and not replace:
      raise FileExistsError(f'{target} appeared while it was being written')
    old = None
    if os.path.lexists(target):
      old = f'{partial}.old'
      os.rename(target, old)
    try:
      os.rename(partial, target)
    except OSError:
      if old is not None:
        os.rename(old, target)
      raise
    sync_directory(parent)
    done = True
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
  finally:
    if not done:
      shutil.rmtree(partial, ignore_errors=True)
      for directory in created:  # innermost first: a failed write leaves none
        if os.path.isdir(directory) and not os.listdir(directory):
          os.rmdir(directory)
