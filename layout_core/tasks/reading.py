"""Opening a split's streams as one reader, for every streamed task.

`open_stream_reader` is where `TFRecordTask` and `LMCorpusTask` both make their
readers: it deals the split's files to streams (`streams.deal_streams`), reads
a short file around (`streams.wrap_short_file`), starts each of this client's
streams at its saved position, and hands each stream to the task's `source`
(parsed blocks, or packed rows) inside one `streams.StreamReader`.

    reader = open_stream_reader(
        files=files, split='train', batch_size=32, num_streams=0, rows=None, state=None,
        start_step=0, where='lm_corpus', parse=parse, seed=2 * 1234, window=256,
        position_length=3, unsaved=lambda k, spec, records: (0, 0, 0),
        source=lambda stream, position: Packer(stream, ..., used=position[2]))

Exact resume needs the same files as well as the positions: a position
(epoch, records taken) means nothing over another dealing of files to
streams. So the reader's state records the split's files (`files_record`:
each file's name relative to the files' common directory, so a corpus moved
as a whole still resumes, and its size in bytes), and a resume compares that
record with the files the pattern matches now (`check_files_unchanged`):

  * files added or removed: a ConfigError (exit 2) naming them, since every
    stream's files change under its saved position. Put the files back to
    resume exactly, or train on the new files in a new model_dir
    (`checkpoint.init_from` starts it from this run's weights).
  * a file's size changed, the same files otherwise: a warning naming it, and
    the run goes on. The dealing is the same, only that file's stream reads
    other records; this is what replacing a damaged file with a good copy
    does, which the data error (exit 5) tells the user to do.
  * a data state written before the record existed (no 'files'): resumed
    unchecked, as before.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Sequence

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.tasks import record_files, streams

FilesRecord = list[list]  # [[name relative to the common directory, bytes], ...]
_NAMED = 5  # files named in a message before "and N more"


def files_record(files: Sequence[str]) -> FilesRecord:
  """Each file's name relative to the files' common directory, and its size."""
  root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
  return [[os.path.relpath(os.path.abspath(f), root), os.path.getsize(f)] for f in files]


def _some(names: Sequence[str]) -> str:
  shown = ', '.join(names[:_NAMED])
  return shown + (f' and {len(names) - _NAMED} more' if len(names) > _NAMED else '')


def check_files_unchanged(saved: FilesRecord | None, current: FilesRecord, *,
                          where: str) -> None:
  """Refuses a resume over added or removed files; warns about resized ones
  (see the module docstring). `saved` None: an older data state, unchecked."""
  if saved is None:
    return
  before, now = dict(map(tuple, saved)), dict(map(tuple, current))
  added = [name for name in now if name not in before]
  removed = [name for name in before if name not in now]
  if added or removed:
    change = '; '.join(part for part in (
        f'added {_some(added)}' if added else '',
        f'removed {_some(removed)}' if removed else '') if part)
    raise ConfigError(
        f'the checkpoint\'s data position was taken over {len(before)} file(s), and the '
        f'pattern now matches {len(now)} ({change}): the files would be dealt to the '
        'streams differently, so the saved positions would point at other records',
        where=where,
        fix='put the files back as they were to resume exactly, or train on the new '
            'files in a new --model_dir (checkpoint.init_from = this run\'s last '
            'checkpoint starts it from these weights)')
  resized = [f'{name} ({before[name]:,} -> {now[name]:,} bytes)' for name in now
             if now[name] != before[name]]
  if resized:
    logging.warning('Resuming over %d data file(s) whose size changed since the '
                    'checkpoint (%s): %s: their streams continue at the saved '
                    'positions, over other records than the checkpointed run read',
                    len(resized), where, _some(resized))


def count_records(spec: streams.StreamSpec) -> int:
  """Records in one stream's epoch (reads its files through, parsing nothing)."""
  records = tf.data.TFRecordDataset(list(spec.files), buffer_size=1 << 20)
  if spec.every > 1:
    records = records.shard(spec.every, spec.offset)
  return int(records.reduce(np.int64(0), lambda count, _: count + 1))


def position_after(spec: streams.StreamSpec, *, records: int) -> tuple[int, int]:
  """The (epoch, index) of a stream after `records` records (counts the
  stream's records once when not at the start: a checkpoint without a data
  state)."""
  if not records:
    return (0, 0)
  length = count_records(spec)
  if not length:
    raise ConfigError(f'the data files {list(spec.files)} hold no records',
                      fix='write records into them')
  return (records // length, records % length)


def open_stream_reader(
    *, files: Sequence[str], split: str, batch_size: int, num_streams: int,
    rows: np.ndarray | None, state: Mapping | None, start_step: int, where: str,
    parse: Callable, seed: int, window: int, position_length: int,
    unsaved: Callable[[int, streams.StreamSpec, int], tuple[int, ...]],
    source: Callable[[streams.RecordStream, tuple[int, ...]], object],
    records: Callable = streams.tfrecord_files, count: Callable[..., int] = record_files.records_in
) -> streams.StreamReader:
  """The reader of one split (see the module docstring).

  `num_streams` 0 chooses (`streams.default_num_streams`). A stream's start
  is its position in `state` (a reader's `state()`), padded to
  `position_length`, else `unsaved(stream, spec, records before start_step)`.
  `source(stream, position)` turns a `RecordStream` opened at the position's
  (epoch, index) into what `StreamReader` reads blocks from. `records` and
  `count` read and count the files' records (default: TFRecord files)."""
  num_streams = num_streams or streams.default_num_streams(num_files=len(files),
                                                           batch_size=batch_size)
  specs = streams.deal_streams(files=files, num_streams=num_streams, where=where)
  record = files_record(files)
  check_files_unchanged((state or {}).get(streams.FILES_KEY), record,
                        where=f'{where}.{split}_files')
  block = batch_size // num_streams if batch_size % num_streams == 0 else 0
  sources = {}
  for k in streams.rows_to_streams(rows, batch_size=batch_size, num_streams=num_streams):
    spec = streams.wrap_short_file(specs[k], count=count)
    position = (streams.saved_position(state, k, position_length)
                or unsaved(k, spec, start_step * block))
    stream = streams.RecordStream(spec, parse=parse, seed=seed, stream_id=k, window=window,
                                  position=tuple(position[:2]), records=records)
    sources[k] = source(stream, tuple(position))
  return streams.StreamReader(sources=sources, batch_size=batch_size,
                              num_streams=num_streams, files=record)
