"""Streamed record files: shuffled, dealt to streams, resumable to the record.

A split's files are dealt to `num_streams` streams, and every global batch is
the streams' blocks side by side: with batch size B and K streams, rows
[k*B/K, (k+1)*B/K) of every batch come from stream k. K depends on the data
and the batch size only, never on the mesh or the number of clients, so the
batches are the same on any mesh; a client reads only the streams whose rows
its devices hold (`reader(rows=...)`), so it opens only their files.

    streams = deal_streams(files=sorted(glob.glob('/data/train-*')), num_streams=8)
    stream = RecordStream(streams[3], parse=parse_fn, seed=1, stream_id=3, window=1024)
    block = stream.take(4)       # {'x': [4, 16], 'label': [4]}, parsed
    stream.position              # (epoch, index): where the next record comes from

A stream reads its files one after another with `tf.data` (never a whole split
in host memory): each epoch in an order drawn from (seed, stream, epoch), its
records shuffled within windows of `window` consecutive records (a
permutation drawn from (seed, stream, epoch, window)). The position (epoch,
records taken in it) fixes everything that follows, so a stream restarted
from a saved position yields exactly the records the uninterrupted one would
have: the reader skips the window's earlier records without parsing them.

When there are fewer files than streams, K must be a multiple of the number
of files F, and stream k reads every (K/F)-th record of file k mod F, starting
with record k // F. A file holding no more records than that start (a small
eval split: 3 documents in a file read by 4 streams) is read around:
the stream reads record (k // F) mod n of its n records (`wrap_short_file`), so
every stream of a non-empty file has a record. That rule depends on the files
alone, never on the mesh or the clients, and leaves every stream that had
records before it unchanged (they start below n), so batches of data that
trained before are the same bit for bit. A stream whose files are all empty
still has nothing to read and says so. (Counting a file's records and
checking its first one against the declared features, in Python:
`layout_core.tasks.record_files`.)
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import gc
import itertools
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.tasks.record_files import records_in

Position = tuple[int, int]           # (epoch, records taken in that epoch)
_EPOCHS_AHEAD = 16  # how far a stream's epochs may run ahead of its reader
Window = dict[str, np.ndarray]       # parsed records: name -> [n, ...] (object for ragged)


PARSE_THREADS = 2  # windows parsed at once per stream (no autotuning: without_autotune)


class DataIterator:
  """Iterates `iterable` (a tf.data dataset or its numpy iterator) until the
  interpreter starts to exit, then lets it go.

  A tf.data iterator whose threads run Python (`py_function`, `numpy_function`)
  can wait forever for them when destroyed while Python finalizes
  (tensorflow#21277). `close_data_iterators` runs at exit, before
  finalization, and drops every open one. (The exit hang this suite met was
  the autotune thread's: `without_autotune`.)"""

  def __init__(self, iterable: Iterable):
    self._iterator = iter(iterable)
    _OPEN_ITERATORS.add(self)

  def __iter__(self):
    return self

  def __next__(self) -> Any:
    if self._iterator is None:
      raise StopIteration
    return next(self._iterator)

  def close(self) -> None:
    self._iterator = None


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` with no tf.data autotuning thread.

  A full test run hung twice after its last test, in an iterator's destructor
  joining that thread (`RootDataset::Iterator` waiting on `Model::OptimizeLoop`,
  which never saw the cancellation; TF 2.21), once at finalization and once in
  `close_data_iterators`. These pipelines set their parallelism themselves, and
  their input is ~0.1% of a step (bench/input.py), so autotuning buys nothing."""
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


_OPEN_ITERATORS: 'weakref.WeakSet[DataIterator]' = weakref.WeakSet()


@atexit.register
def close_data_iterators() -> None:
  """Drops every open `DataIterator` and collects what held them, while the
  interpreter can still run their threads' Python to the end."""
  for iterator in list(_OPEN_ITERATORS):
    iterator.close()
  gc.collect()


class DataError(RuntimeError):
  """A data file that cannot be read mid-run (corrupt or truncated record).

  The launchers exit with code 5 on it; checkpoints written before stay."""


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  files: tuple[str, ...]
  every: int = 1        # read every `every`-th record ...
  offset: int = 0       # ... starting with this one


def default_num_streams(*, num_files: int, batch_size: int) -> int:
  """The largest divisor of `batch_size` that is at most the number of files,
  or a multiple of it up to 8 (so even one file splits over up to 8 clients)."""
  divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
  return max(d for d in divisors if d <= num_files or (d % num_files == 0 and d <= 8))


def deal_streams(*, files: Sequence[str], num_streams: int, where: str = 'data') -> list[StreamSpec]:
  """Deals `files` to `num_streams` streams (see module docstring)."""
  files, count = tuple(files), len(files)
  if num_streams >= count:
    if num_streams % count:
      raise ConfigError(f'{num_streams} streams cannot share {count} files evenly',
                        where=f'{where}.num_streams',
                        fix=f'use at most {count} streams or a multiple of {count} '
                            '(0 chooses one)')
    every = num_streams // count
    return [StreamSpec((files[k % count],), every, k // count) for k in range(num_streams)]
  return [StreamSpec(files[k::num_streams]) for k in range(num_streams)]


def tfrecord_files(files) -> 'tf.data.Dataset':
  """The records of `files` (a string tensor [n]) in order: the default kind
  of record file (`RecordStream(records=...)`)."""
  return tf.data.TFRecordDataset(files, buffer_size=1 << 20)


def wrap_short_file(spec: StreamSpec, *,
                    count: Callable[..., int] = records_in) -> StreamSpec:
  """`spec`, reading its file around when it holds no more records than the
  stream's first one (module docstring): record offset mod n of n records.
  `count(path, at_most=)` counts a file's records (default: TFRecord's)."""
  if spec.every == 1:
    return spec  # whole files: a stream of any non-empty file has records
  (path,) = spec.files
  held = count(path, at_most=spec.offset + 1)
  if 0 < held <= spec.offset:
    return dataclasses.replace(spec, offset=spec.offset % held)
  return spec


# The streams whose pipelines are open, by token: a pipeline's Python steps (the
# epoch's file order, how far ahead it may run) look their stream up here, so
# one traced pipeline serves every stream of a task (`_pipeline_factory`).
_OPEN_STREAMS: 'weakref.WeakValueDictionary[int, RecordStream]' = weakref.WeakValueDictionary()
_TOKENS = itertools.count(1)


def _epoch_files(token: tf.Tensor, epoch: tf.Tensor) -> tf.Tensor:
  return tf.constant(_OPEN_STREAMS[int(token)].epoch_files(int(epoch)))


def _close_enough(token: tf.Tensor, epoch: tf.Tensor) -> bool:
  """Epochs run ahead of the reader only by what tf.data prefetches (false:
  the stream holds no records, or its reader is gone)."""
  stream = _OPEN_STREAMS.get(int(token))
  return stream is not None and int(epoch) <= stream.last_epoch + _EPOCHS_AHEAD


@functools.lru_cache(maxsize=16)
def _pipeline_factory(records: Callable, parse: Callable, window: int) -> Callable:
  """A tf.function (token, first epoch, first window, every, offset) -> the
  dataset of a stream's (epoch, window number, parsed window), from `first
  epoch` on, starting at window `first window`; each epoch's files in the
  stream's order for it, read through `records`, every `every`-th record from
  `offset`, `window` at a time.

  Traced once per (records, parse, window), not once per stream each time it
  opens: a stream's tf.data functions took most of its opening (8 streams of
  a corpus opened in 1.8 CPU-s, now 0.9: bench/stream_open.py)."""
  parse = tf.function(parse, input_signature=[tf.TensorSpec([None], tf.string)])
  scalar = tf.TensorSpec([], tf.int64)

  @tf.function(input_signature=[scalar] * 5, autograph=False)
  def make(token, first_epoch, first_window, every, offset):
    def files_of(epoch):  # the epoch's file order, drawn in Python (epoch_files)
      files = tf.py_function(_epoch_files, [token, epoch], tf.string)
      files.set_shape([None])
      return epoch, files

    def windows_of(epoch, files):
      skipped = tf.where(tf.equal(epoch, first_epoch), first_window, np.int64(0))
      windows = records(files).shard(every, offset).skip(skipped * window)
      return windows.batch(window).enumerate().map(
          lambda number, rows: (epoch, number + skipped, rows))

    def close_enough(epoch):
      return tf.py_function(_close_enough, [token, epoch], tf.bool)

    pipeline = tf.data.Dataset.range(first_epoch, 2**62).take_while(close_enough)
    pipeline = pipeline.map(files_of).flat_map(windows_of).map(
        lambda epoch, number, rows: (epoch, number, parse(rows)),
        num_parallel_calls=PARSE_THREADS, deterministic=True)
    return without_autotune(pipeline.prefetch(2))
  return make


class RecordStream:
  """The records of one stream, parsed, epoch after epoch (see module docstring).

  `parse(serialized [n]) -> {name: tensor [n, ...]}` runs inside tf.data on a
  window at a time; a ragged result is handed over as an object array of
  rows. `records(files [n]) -> dataset of strings` reads the files
  (default: TFRecord; `layout_core.tasks.instruct` reads JSON lines)."""

  def __init__(self, spec: StreamSpec, *, parse: Callable[[tf.Tensor], Mapping[str, tf.Tensor]],
               seed: int, stream_id: int, window: int, position: Position = (0, 0),
               records: Callable[[tf.Tensor], 'tf.data.Dataset'] = tfrecord_files):
    self.spec, self.parse, self.seed, self.stream_id = spec, parse, seed, stream_id
    self.records = records
    self.window = max(1, window)
    self._token = next(_TOKENS)  # how its pipeline's Python steps find it (`_OPEN_STREAMS`)
    self.epoch, self.index = position
    self.last_epoch = self.epoch         # the epoch of the last window loaded
    self._buffer: Window | None = None   # the current window, permuted
    self._buffer_start = 0               # its first record's index in the epoch
    self._iterator = None

  @property
  def position(self) -> Position:
    return (self.epoch, self.index)

  def epoch_files(self, epoch: int) -> list[str]:
    files = list(self.spec.files)
    order = np.random.default_rng([self.seed, self.stream_id, epoch, 0]).permutation(len(files))
    return [files[i] for i in order]

  def _open(self) -> None:
    """One tf.data pipeline from the current epoch on, starting at the window
    that holds `index`; windows never straddle epochs (`_pipeline_factory`)."""
    first_epoch, first_window = self.epoch, self.index // self.window
    self.last_epoch = first_epoch
    _OPEN_STREAMS[self._token] = self
    logging.vlog(1, 'stream %d opens at epoch %d window %d: %s', self.stream_id, first_epoch,
                 first_window, list(self.spec.files))
    try:
      make = _pipeline_factory(self.records, self.parse, self.window)
    except TypeError:  # an unhashable parse (a callable object with __eq__): its own
      make = _pipeline_factory.__wrapped__(self.records, self.parse, self.window)
    self._iterator = DataIterator(make(*(np.int64(v) for v in (
        self._token, first_epoch, first_window, self.spec.every, self.spec.offset))))
    self._buffer = None

  def _next_window(self) -> None:
    """Loads and permutes the next window (of this epoch or, at its end, the next)."""
    if self._iterator is None:
      self._open()
    try:
      epoch, number, window = next(self._iterator)
    except StopIteration:
      raise ConfigError(f'data stream {self.stream_id} holds no records: its files '
                        f'{list(self.spec.files)} are empty', where='the data files',
                        fix='write records into these files, or leave them out of the '
                            'pattern') from None
    except tf.errors.DataLossError as e:
      raise self._locate_fault(e) from None
    epoch, number = int(epoch), int(number)
    if epoch != self.epoch:  # the previous epoch is used up
      self.epoch, self.index = epoch, 0
    self.last_epoch = epoch
    window = {name: _to_numpy(value) for name, value in window.items()}
    count = len(next(iter(window.values())))
    order = np.random.default_rng([self.seed, self.stream_id, epoch, number + 1]).permutation(count)
    self._buffer = {name: value[order] for name, value in window.items()}
    self._buffer_start = number * self.window
    self._buffer_end = self._buffer_start + count

  def take(self, count: int) -> Window:
    """The next `count` records, parsed, continuing into the next epoch."""
    parts: list[Window] = []
    while count:
      buffered = 0 if self._buffer is None else self._buffer_end - self.index
      if buffered <= 0:
        self._next_window()
        continue
      start = self.index - self._buffer_start
      n = min(count, buffered)
      parts.append({name: value[start:start + n] for name, value in self._buffer.items()})
      self.index += n
      count -= n
    return concatenate(parts)

  def _locate_fault(self, error: Exception) -> DataError:
    """The DataError naming the first file of this epoch that cannot be read."""
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    for path in self.epoch_files(self.epoch):
      try:
        for _ in self.records(tf.constant([path])).batch(4096):
          pass
      except tf.errors.OpError as e:
        found = str(e).splitlines()[0]
        return DataError(f'data file {path} cannot be read: {found} (TFRecord, stream '
                         f'{self.stream_id}, epoch {self.epoch}). Replace the file with '
                         'a good copy and run the same command: training resumes from '
                         'the last checkpoint')
    return DataError(f'reading stream {self.stream_id} failed: {detail}')


def _to_numpy(value) -> np.ndarray:
  if isinstance(value, tf.RaggedTensor):
    rows = value.numpy()
    out = np.empty(len(rows), object)
    out[:] = list(rows)
    return out
  return value.numpy()


def concatenate(parts: Sequence[Window]) -> Window:
  if len(parts) == 1:
    return parts[0]
  return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def rows_to_streams(rows: np.ndarray | None, *, batch_size: int, num_streams: int) -> list[int]:
  """The streams whose blocks hold any of `rows` (all for None)."""
  if rows is None:
    return list(range(num_streams))
  block = batch_size // num_streams
  return sorted({int(r) // block for r in rows})


class StreamReader:
  """Global batches of `batch_size` rows from `num_streams` streams: rows
  [k*R, (k+1)*R) of each batch (R = batch_size / num_streams) are the next
  block of stream k. Only the streams in `sources` are read; the rows of the
  others stay zero (a client packs only the rows its devices hold).

  `sources[k]` has `block(rows) -> {name: [rows, ...]}` and `position`
  (a tuple of ints), which `state()` reports for the checkpoint, beside
  `files`: what the positions were taken over (`layout_core.tasks.reading`)."""

  def __init__(self, *, sources: Mapping[int, object], batch_size: int, num_streams: int,
               files: list | None = None):
    if batch_size % num_streams:
      raise ConfigError(f'the batch of {batch_size} rows does not split into '
                        f'{num_streams} streams',
                        where="the task's num_streams (tfrecord_task or lm_corpus)",
                        fix=f'use a number of streams that divides {batch_size} (0 chooses one)')
    self.sources, self.batch_size, self.num_streams = dict(sources), batch_size, num_streams
    self.block = batch_size // num_streams
    self.files = files

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch: dict[str, np.ndarray] = {}
    for k, source in self.sources.items():
      for name, value in source.block(self.block).items():
        if name not in batch:
          batch[name] = np.zeros((self.batch_size,) + value.shape[1:], value.dtype)
        batch[name][k * self.block:(k + 1) * self.block] = value
    return batch

  def state(self) -> dict[str, list]:
    """{'<stream>': position, ..., 'files': [[name, bytes], ...]}: the streams
    share one dict so that clients' states merge by key (each reports its own
    streams and the same files)."""
    state: dict[str, list] = {str(k): list(source.position)
                              for k, source in self.sources.items()}
    if self.files is not None:
      state[FILES_KEY] = self.files
    return state

  def describe(self) -> str:
    """Which streams and files this reader reads (a client: only its own)."""
    files = sorted({f for source in self.sources.values() for f in source.stream.spec.files})
    return (f'streams {sorted(self.sources)} of {self.num_streams}, {len(files)} file(s): '
            f'{", ".join(files)}')


FILES_KEY = 'files'  # the key of a data state that is not a stream's position


def saved_position(state: Mapping[str, Sequence[int]] | None, stream: int,
                   length: int) -> tuple[int, ...] | None:
  """Stream `stream`'s position in a checkpoint's data state, or None."""
  if not state or str(stream) not in state:
    return None
  position = tuple(int(v) for v in state[str(stream)])
  return position + (0,) * (length - len(position))
