"""A prepared corpus's directory, replaced whole: versions behind one link.

    check_output_dir('/data/corpus')          # absent, empty, or a link made here
    version = start_version('/data/corpus')   # /data/corpus.versions/00002.incomplete
    ...                                       # write the corpus into it
    publish('/data/corpus', version)          # /data/corpus -> corpus.versions/00002

`output_dir` is a link to a complete version, `<output_dir>.versions/NNNNN`.
A run writes everything into the next version (`NNNNN.incomplete` until
complete and on disk), then switches the link with one rename, so a reader
globbing `output_dir/train-*` sees the old corpus or the new one, never a
mix, and a run killed at any point leaves the old corpus as it was (the next
run removes its partial version). The version replaced stays for a training
that may still read it; older ones are deleted
(`layout_core.tasks.prepare` uses it).
"""

from __future__ import annotations

import os
import shutil

from layout_core.durable import INCOMPLETE_SUFFIX, sync_directory
from layout_core.errors import ConfigError

VERSIONS_SUFFIX = '.versions'   # <output_dir>.versions/NNNNN: the complete corpora


def _versions_dir(output_dir: str) -> str:
  return os.path.abspath(output_dir) + VERSIONS_SUFFIX


def _link_target(link: str) -> str:
  return os.path.normpath(os.path.join(os.path.dirname(link), os.readlink(link)))


def check_output_dir(output_dir: str) -> None:
  """`output_dir` must be absent, an empty directory, or a link to a version
  of ours: anything else cannot be replaced by one rename."""
  path = os.path.abspath(output_dir)  # also without a trailing '/', which follows a link
  if os.path.islink(path):
    if os.path.dirname(_link_target(path)) != _versions_dir(path):
      raise ConfigError(f'output_dir {output_dir!r} is a link to {_link_target(path)!r}, '
                        f'not to a corpus version in {_versions_dir(path)!r}',
                        where='output_dir',
                        fix='give a new output_dir (prepare_data makes the link itself)')
  elif os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    what = 'a directory holding files' if os.path.isdir(path) else 'a file'
    raise ConfigError(
        f'output_dir {output_dir!r} is {what}: prepare_data publishes a corpus by '
        'switching a link to a complete version in one rename (so a stopped run never '
        'mixes two corpora), and cannot do that over it', where='output_dir',
        fix='give a new output_dir, or move or delete this one (a corpus written by an '
            'older prepare_data is made again in seconds)')


def start_version(output_dir: str) -> str:
  """A new, empty `<output_dir>.versions/NNNNN.incomplete`, after removing
  the partial versions of runs that were killed."""
  versions = _versions_dir(output_dir)
  os.makedirs(versions, exist_ok=True)
  numbers = [0]
  for name in os.listdir(versions):
    if name.endswith(INCOMPLETE_SUFFIX):
      shutil.rmtree(os.path.join(versions, name), ignore_errors=True)
    number = name.split('.')[0]
    if number.isdigit():
      numbers.append(int(number))
  version = os.path.join(versions, f'{max(numbers) + 1:05d}{INCOMPLETE_SUFFIX}')
  os.makedirs(version)
  return version


def publish(output_dir: str, version: str) -> None:
  """Makes the complete `version` the corpus at `output_dir` with one rename of
  a link; keeps the version it replaces, deletes older ones."""
  final = version[:-len(INCOMPLETE_SUFFIX)]
  os.rename(version, final)
  versions = os.path.dirname(final)
  sync_directory(versions)
  path = os.path.abspath(output_dir)
  parent = os.path.dirname(path)
  previous = _link_target(path) if os.path.islink(path) else None
  link = path + '.link' + INCOMPLETE_SUFFIX
  if os.path.lexists(link):
    os.remove(link)
  os.symlink(os.path.relpath(final, parent), link)  # relative: the parent may move
  if os.path.isdir(path) and not os.path.islink(path):
    os.rmdir(path)  # empty (check_output_dir): a link cannot replace a directory
  os.replace(link, path)
  sync_directory(parent)
  for name in os.listdir(versions):
    path = os.path.join(versions, name)
    if path not in (final, previous):
      shutil.rmtree(path, ignore_errors=True)
