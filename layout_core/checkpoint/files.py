"""A checkpoint directory on disk: finding, validating and fsyncing checkpoints.

    write_manifest(tmp, step=200, reason='periodic')  # fsyncs, sizes, checksums
    checkpoint_dirs('/run/checkpoints')      # [(200, '/run/checkpoints/ckpt-200'), ...]
    validate('/run/checkpoints/ckpt-200')    # None, or what is wrong with it
    validate(path, check_contents=True)      # ... also every file's crc32
    latest_valid('/run/checkpoints')         # (200, '/run/checkpoints/ckpt-200/ckpt')

A checkpoint is valid when its `manifest.json` exists, matches its own sha256,
and every file it lists has its recorded size (`layout_core.checkpoint.manager`
writes it last, after fsyncing everything else). The manifest also holds each
file's crc32 (zlib's, computed in 4 MiB chunks while the file is fsynced, so
large shards cost one sequential read from the page cache): restore checks
them, which finds damage that keeps a file's size (junk written over it, a
flipped byte); listing and pruning check sizes only, so they stay cheap.
Manifests written before checksums existed (no `crc32` field) are checked by
size alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from typing import Mapping

from layout_core.checkpoint.damage import CheckpointDamage
from layout_core.durable import sync_directory
from layout_core.errors import ConfigError
from layout_core.lazy import tf

CHECKPOINT_NAME = re.compile(r'^ckpt-(\d+)$')
MANIFEST = 'manifest.json'
DATA_STATE_FILE = 'data_state.json'
_CHUNK = 4 << 20  # bytes read at a time when checksumming


class DirectoryWatch:
  """Tells whether a directory was removed since it was opened, even when
  something has created a new directory of the same name since (TF's SaveV2
  creates its prefix's directory): an open descriptor keeps the old inode,
  whose link count is 0 once it is removed.

      watch = DirectoryWatch(tmp); ...write into tmp...; watch.removed()
  """

  def __init__(self, path: str):
    self.path = path
    self._fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)

  def removed(self) -> bool:
    try:
      return os.fstat(self._fd).st_nlink == 0
    except OSError:  # e.g. ESTALE: a network filesystem's word for the same
      return True

  def close(self) -> None:
    os.close(self._fd)


def resolve_checkpoint_path(path: str, *, where: str = 'checkpoint.init_from') -> str:
  """A checkpoint prefix from a prefix, a ckpt-N directory or a model_dir
  (ConfigError at `where` when there is none)."""
  if tf.io.gfile.exists(path + '.index'):
    return path
  for candidate in (os.path.join(path, 'ckpt'), os.path.join(path, 'checkpoints')):
    if tf.io.gfile.exists(candidate + '.index'):
      return candidate
    if os.path.isdir(candidate):
      found = latest_valid(candidate)
      if found:
        return found[1]
  latest = tf.train.latest_checkpoint(path)
  if latest:
    return latest
  raise ConfigError(f'no checkpoint found at {path!r}', where=where,
                    fix='give a checkpoint prefix, a ckpt-N directory or a model_dir')


def directory_size(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def file_checksum(path: str, *, sync: bool = False) -> tuple[int, int]:
  """(size, zlib crc32) of the file at `path`, read in chunks; fsynced too
  with `sync` (the read then comes from the page cache the write filled)."""
  size, crc = 0, 0
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      size, crc = size + len(chunk), zlib.crc32(chunk, crc)
    if sync:
      os.fsync(f.fileno())
  return size, crc


def write_manifest(directory: str, *, step: int, reason: str) -> None:
  """Fsyncs every file in `directory`, then writes `manifest.json` (their
  sizes and crc32s, and its own digest) and fsyncs it and the directory."""
  files, checksums = {}, {}
  for name in os.listdir(directory):
    files[name], checksums[name] = file_checksum(os.path.join(directory, name), sync=True)
  manifest = {'step': step, 'reason': reason, 'files': files, 'crc32': checksums}
  manifest['digest'] = manifest_digest(manifest)
  with open(os.path.join(directory, MANIFEST), 'w') as f:
    json.dump(manifest, f, indent=1)
    f.flush()
    os.fsync(f.fileno())
  sync_directory(directory)


def validate(directory: str, *, check_contents: bool = False) -> str | None:
  """None if `directory` is a complete checkpoint, else what is wrong with it.
  `check_contents` also reads every file to compare its crc32."""
  manifest_path = os.path.join(directory, MANIFEST)
  if not os.path.isfile(manifest_path):
    return f'{manifest_path} is missing (an interrupted save?)'
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
    files = manifest['files']
    checksums = manifest.get('crc32', {})
    digest = manifest.get('digest')
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    return f'{manifest_path} is unreadable: {type(e).__name__}: {e}'
  if digest is not None and digest != manifest_digest(manifest):
    return f'{manifest_path} does not match its own digest (corrupt)'
  if not isinstance(files, dict) or not isinstance(checksums, dict):
    return f'{manifest_path} is unreadable: no file list'
  for name, size in files.items():
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      return f'{path} is missing'
    actual = os.path.getsize(path)
    if actual != size:
      return f'{path} is {actual} bytes but the manifest says {size} (truncated or corrupt)'
  if check_contents:
    for name in files:
      path = os.path.join(directory, name)
      if name in checksums and file_checksum(path)[1] != checksums[name]:
        return (f'{path} does not match its crc32 in {manifest_path} (corrupt: '
                'the same size, other bytes)')
  return None


def read_data_state(directory: str) -> dict | None:
  """A checkpoint directory's data state (where the input streams stood),
  None when it has none; CheckpointDamage when the file is not JSON."""
  path = os.path.join(directory, DATA_STATE_FILE)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: junk in the file
    raise CheckpointDamage(f'{path} is unreadable: {type(e).__name__}: {e}') from e


def manifest_digest(manifest: Mapping) -> str:
  """sha256 of a manifest's content (all but the digest itself), so a
  flipped byte anywhere in it is noticed."""
  body = {k: v for k, v in manifest.items() if k != 'digest'}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def checkpoint_dirs(directory: str) -> list[tuple[int, str]]:
  """(step, path) of every ckpt-N directory, newest first."""
  if not os.path.isdir(directory):
    return []
  found = []
  for name in os.listdir(directory):
    match = CHECKPOINT_NAME.match(name)
    if match:
      found.append((int(match.group(1)), os.path.join(directory, name)))
  return sorted(found, reverse=True)


def latest_valid(directory: str) -> tuple[int, str] | None:
  """(step, prefix) of the newest checkpoint that passes `validate`."""
  for step, path in checkpoint_dirs(directory):
    if validate(path) is None:
      return step, os.path.join(path, 'ckpt')
  return None
