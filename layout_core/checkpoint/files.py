"""A checkpoint directory on disk: finding, validating and fsyncing checkpoints.

    checkpoint_dirs('/run/checkpoints')      # [(200, '/run/checkpoints/ckpt-200'), ...]
    validate('/run/checkpoints/ckpt-200')    # None, or what is wrong with it
    latest_valid('/run/checkpoints')         # (200, '/run/checkpoints/ckpt-200/ckpt')

A checkpoint is valid when its `manifest.json` exists, matches its own sha256,
and every file it lists has its recorded size (`layout_core.checkpoint.manager`
writes it last, after fsyncing everything else).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Mapping

from layout_core.errors import ConfigError
from layout_core.lazy import tf

CHECKPOINT_NAME = re.compile(r'^ckpt-(\d+)$')


def fsync_files(paths) -> None:
  for path in paths:
    with open(path, 'rb') as f:
      os.fsync(f.fileno())


def fsync_tree(directory: str) -> None:
  fsync_files(os.path.join(directory, name) for name in os.listdir(directory))
  fsync_dir(directory)


def fsync_dir(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def resolve_checkpoint_path(path: str) -> str:
  """A checkpoint prefix from a prefix, a ckpt-N directory or a model_dir."""
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
  raise ConfigError(f'no checkpoint found at {path!r}',
                    where='checkpoint.init_from',
                    fix='give a checkpoint prefix, a ckpt-N directory or a model_dir')


def directory_size(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))


def validate(directory: str) -> str | None:
  """None if `directory` is a complete checkpoint, else what is wrong with it."""
  manifest_path = os.path.join(directory, 'manifest.json')
  if not os.path.isfile(manifest_path):
    return f'{manifest_path} is missing (an interrupted save?)'
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
    files = manifest['files']
    digest = manifest.get('digest')
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    return f'{manifest_path} is unreadable: {type(e).__name__}: {e}'
  if digest is not None and digest != manifest_digest(manifest):
    return f'{manifest_path} does not match its own digest (corrupt)'
  if not isinstance(files, dict):
    return f'{manifest_path} is unreadable: no file list'
  for name, size in files.items():
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      return f'{path} is missing'
    actual = os.path.getsize(path)
    if actual != size:
      return f'{path} is {actual} bytes but the manifest says {size} (truncated or corrupt)'
  return None


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
