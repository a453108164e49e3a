"""TFRecord files read in Python: counted, and checked before a run starts.

    records_in('/data/train-00000.tfrecord', at_most=4)   # 4, or fewer in a small file
    check_first_records(files, {'x': ('float32', (16,))}, where='tfrecord_task.train_files')

A stream (`layout_core.tasks.streams`) counts a short file's records to read
it around, and a task checks the first record of every file against its
declared features while the plan is made. Both walk the record headers in
Python, without TensorFlow's runtime (it may not have started yet), and a
fault is a ConfigError naming the file, the feature and both shapes, before
anything is written.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

from layout_core.errors import ConfigError
from layout_core.lazy import tf


def records_in(path: str, *, at_most: int) -> int:
  """The number of records of a TFRecord file, counted up to `at_most` by
  walking the record headers in Python (no record is read or parsed)."""
  count = 0
  with open(path, 'rb') as f:
    while count < at_most:
      header = f.read(12)   # uint64 length, uint32 masked CRC of the length
      if len(header) < 12:
        break
      f.seek(int.from_bytes(header[:8], 'little') + 4, os.SEEK_CUR)  # data + its CRC
      count += 1
  return count


def first_record(path: str) -> bytes | None:
  """The first record of a TFRecord file, read in Python (this runs while
  the plan is made, before TensorFlow's runtime may start); None if empty."""
  with open(path, 'rb') as f:
    header = f.read(12)   # uint64 length, uint32 masked CRC of the length
    if not header:
      return None
    if len(header) < 12:
      raise ValueError(f'it ends after {len(header)} bytes, inside the first record\'s header')
    length = int.from_bytes(header[:8], 'little')
    data = f.read(min(length, 1 << 30))
    if len(data) < length:
      raise ValueError(f'its first record declares {length} bytes but the file holds '
                       f'{len(data)} after the header (truncated, or not a TFRecord file)')
    return data


def check_first_records(files: Sequence[str], features: Mapping[str, tuple[str, tuple[int, ...]]],
                        *, where: str, varlen: Sequence[str] = ()) -> None:
  """Parses the first record of every file against the declared features:
  a ConfigError names the file, the feature, the declared and the found
  shape (a wrong spec, a corrupt file) before anything is written."""
  kinds = {'float32': 'float_list', 'int64': 'int64_list'}
  for path in files:
    try:
      first = first_record(path)
    except (OSError, ValueError) as e:
      raise ConfigError(f'data file {path} cannot be read: {e}', where=where,
                        fix='replace the file, or leave it out of the pattern') from None
    if first is None:
      continue  # an empty shard is allowed; an empty split is caught by its task
    try:
      example = tf.train.Example.FromString(first)
    except Exception:  # pylint: disable=broad-except  # protobuf's DecodeError
      raise ConfigError(f'the first record of {path} is not a tf.train.Example',
                        where=where, fix='write the files with tf.train.Example records '
                                         '(layout_core.tasks.write_tfrecords)') from None
    stored = example.features.feature
    for name, (dtype, shape) in features.items():
      if name not in stored:
        raise ConfigError(f'feature {name!r} is not in {path} (its first record has '
                          f'{", ".join(sorted(stored)) or "no features"})', where=where,
                          fix='name a stored feature, or rewrite the files')
      kind = stored[name].WhichOneof('kind')
      found = len(getattr(stored[name], kind).value) if kind else 0
      if kind != kinds[dtype]:
        raise ConfigError(f'feature {name!r} of {path} holds {kind or "nothing"} but is '
                          f'declared {dtype}', where=where,
                          fix=f"declare it as {'float32' if kind == 'float_list' else 'int64'}")
      if name not in varlen and found != math.prod(shape):
        raise ConfigError(f'feature {name!r} of {path} holds {found} values per record, '
                          f'but is declared with shape {list(shape)} '
                          f'({math.prod(shape)} values)', where=where,
                          fix=f'declare a shape of {found} values, e.g. [{found}]')
