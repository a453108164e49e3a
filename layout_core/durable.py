"""Files that survive a crash whole or not at all: the one place meshgin
writes through when a half-written file would mislead a later run.

    write_atomically('corpus/corpus.json', text.encode())   # temp, fsync, rename, fsync dir
    replace_durably('shard.tfrecord.incomplete', 'shard.tfrecord')
    sync_directory('checkpoints')   # the names in it (renames, new files) are on disk
    check_writable('out/samples.jsonl', where='--output')   # before a run: exit 2, not a traceback

Checkpoints (`layout_core.checkpoint`), prepared corpora and token documents
(`layout_core.tasks`) use these; a reader never sees a partial file under the
final name.
"""

from __future__ import annotations

import os

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
