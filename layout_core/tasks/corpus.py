"""Language modelling on a tokenized corpus: documents packed into sequences.

    task = LMCorpusTask(train_files='/data/corpus/train-*.tfrecord',
                        eval_files='/data/corpus/eval-*.tfrecord',
                        vocab_size=1024, seq_len=128)
    batch = task.features(split='train', step=0, batch_size=8)
    # {'tokens': [8, 129], 'segments': [8, 129], 'positions': [8, 129]}

The files hold one `tf.train.Example` per document, its token ids as an
int64 list named `tokens` (`python -m launch.prepare_data` writes them with
a SentencePiece model). Documents are streamed (`layout_core.tasks.streams`)
and packed, as seqio/T5X pack: each row of seq_len + 1 tokens takes whole
documents while they fit; a document longer than a row fills rows of its own
(split); the rest of a row is padding. `segments` numbers the documents of a
row from 1 (0: padding) and `positions` counts tokens from 0 within each.
The model attends only within a segment (`layout_core.model.sequence`), and
the loss counts only targets in the same document as their input, so padding
and document boundaries add no loss and no gradient.

With `pack=False` every row holds one document (or one piece of a long one),
padded: causal attention alone keeps padding out, so that works with every
engine and any model (Keras models included).

The input position saved with each checkpoint is, per stream, (epoch,
document, tokens of it already used), with the files it was taken over
(`layout_core.tasks.reading`): resuming continues exactly, on any mesh and any
number of clients, and refuses files added or removed since.

`write_documents` writes such files (the one writer: `prepare_data` uses it
too), each under its name only once complete and on disk.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import numpy as np

from layout_core.durable import INCOMPLETE_SUFFIX, replace_durably
from layout_core.errors import ConfigError
from layout_core.fields import at_least
from layout_core.lazy import tf
from layout_core.tasks import reading, record_files, streams
from layout_core.tasks.base import SPLIT_INDEX, SPLITS, find_split_files
from layout_core.tasks.lm import LMTask
from layout_core.tasks.objective import Mean, masked_mean

FEATURE = 'tokens'


def target_mask(segments) -> 'tf.Tensor':
  """[B, T] True where target t (token t+1) belongs to input t's document."""
  inputs, targets = segments[:, :-1], segments[:, 1:]
  return tf.logical_and(tf.equal(inputs, targets), targets > 0)


def next_token_loss(outputs, tokens, mask) -> tuple[Mean, Mean]:
  """(cross entropy, accuracy) of the logits `outputs` [B, T, V] against the
  next tokens of `tokens` [B, T + 1], over the targets where `mask` [B, T]:
  each as its sum and count, so the parts of a batch add exactly."""
  labels = tf.cast(tokens[:, 1:], tf.int32)
  losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=outputs)
  correct = tf.equal(tf.argmax(outputs, axis=-1, output_type=tf.int32), labels)
  return masked_mean(losses, mask), masked_mean(tf.cast(correct, tf.float32), mask)


class Packer:
  """Rows of `length` tokens from one stream of documents (see module doc).
  Its position is (epoch, document, tokens of that document already used).

  A document is {'tokens': ids, name: values per token, ...}: the names of
  `extra_features` are packed beside the tokens (zero in padding).
  `too_long` says what becomes of a document longer than a row: 'split'
  fills rows of its own with it, 'cut' keeps its first `length` tokens,
  'drop' leaves it out; `cut` and `dropped` count them."""

  extra_features: tuple[str, ...] = ()

  def __init__(self, stream: streams.RecordStream, *, length: int, pack: bool,
               vocab_size: int, used: int = 0, too_long: str = 'split'):
    self.stream, self.length, self.pack, self.vocab_size = stream, length, pack, vocab_size
    self.too_long = too_long
    self.cut = self.dropped = 0
    self._document: dict[str, np.ndarray] | None = None   # taken, not fully used
    self._document_position = stream.position
    self._used = used
    if used:
      self._document = self._take()

  def _take(self) -> dict[str, np.ndarray]:
    self._document_position = self.stream.position
    return self.read_document()

  def read_document(self) -> dict[str, np.ndarray]:
    """The next document of the stream, checked."""
    document = np.asarray(self.stream.take(1)[FEATURE][0], np.int64)
    if len(document) and (document.max() >= self.vocab_size or document.min() < 0):
      bad = int(document.max() if document.max() >= self.vocab_size else document.min())
      raise ConfigError(f'token id {bad} in document {self._document_position[1]} of data '
                        f'stream {self.stream.stream_id} (files {list(self.stream.spec.files)}) '
                        f'is outside the vocabulary 0..{self.vocab_size - 1}',
                        where='lm_corpus.vocab_size',
                        fix='set lm_corpus.vocab_size to the SentencePiece model\'s '
                            'vocabulary size (corpus.json says it)')
    return {FEATURE: document.astype(np.int32)}

  @property
  def position(self) -> tuple[int, int, int]:
    if self._document is None:
      return self.stream.position + (0,)
    return self._document_position + (self._used,)

  def block(self, rows: int) -> dict[str, np.ndarray]:
    names = ('tokens', 'segments', 'positions') + self.extra_features
    out = {name: np.zeros((rows, self.length), np.int32) for name in names}
    for row in range(rows):
      filled, segment = 0, 0
      while filled < self.length:
        if self._document is None:
          self._document, self._used = self._take(), 0
          if self.too_long == 'drop' and len(self._document[FEATURE]) > self.length:
            self._document = None
            self.dropped += 1
            continue
        rest = self._document[FEATURE][self._used:]
        space = self.length - filled
        if len(rest) > space and filled:
          break  # starts the next row whole
        piece = rest[:space]
        segment += 1
        out['tokens'][row, filled:filled + len(piece)] = piece
        out['segments'][row, filled:filled + len(piece)] = segment
        out['positions'][row, filled:filled + len(piece)] = np.arange(len(piece))
        for name in self.extra_features:
          out[name][row, filled:filled + len(piece)] = (
              self._document[name][self._used:self._used + len(piece)])
        filled += len(piece)
        self._used += len(piece)
        if self.too_long == 'cut' and len(rest) > len(piece):
          self._used = len(self._document[FEATURE])  # the rest is left out
          self.cut += 1
        if self._used >= len(self._document[FEATURE]):
          self._document = None
        if not self.pack:
          break
    return out


class LMCorpusTask(LMTask):
  """Next-token prediction on packed documents of token ids (see module doc).

  Args:
    train_files: Glob pattern of the train split's TFRecord files, one Example
      per document with its token ids as an int64 `tokens` list (as
      `launch.prepare_data` writes them); it must match at least one file.
    eval_files: Glob pattern of the eval split's files, in the same format.
    vocab_size: Number of token ids (>= 2), the SentencePiece model's vocabulary
      size (corpus.json says it); a token id outside 0..vocab_size-1 is an error.
    seq_len: Model input length in tokens (>= 1); each row holds seq_len + 1
      tokens (inputs plus next-token labels).
    pack: True packs whole documents into each row (segment-aware attention:
      needs a Params model on the one-program engine); False gives each row one
      document, or one piece of a long one, padded (any engine and model).
    seed: As tfrecord_task.seed (the same stream reader).
    num_streams: As tfrecord_task.num_streams (the same stream reader).
    shuffle_window: As tfrecord_task.shuffle_window, counting documents.
  """

  settings_name = 'lm_corpus'

  def __init__(self, *, train_files: str, eval_files: str, vocab_size: int,
               seq_len: int = 128, pack: bool = True, seed: int = 1234,
               num_streams: int = 0, shuffle_window: int = 256):
    at_least(dict(vocab_size=vocab_size, seq_len=seq_len), 'lm_corpus', vocab_size=2,
             seq_len=1)
    self.patterns = {'train': train_files, 'eval': eval_files}
    self.checked: dict[str, str] = {}  # split: what check_data found, for describe
    self.vocab_size, self.seq_len, self.pack, self.seed = vocab_size, seq_len, pack, seed
    self.num_streams, self.shuffle_window = num_streams, shuffle_window

  @property
  def tokens_per_example(self) -> int:  # type: ignore[override]
    return self.seq_len

  def check_data(self, splits=SPLITS):
    for split in splits:
      files = self.split_files(split)
      record_files.check_first_records(files, {FEATURE: ('int64', ())},
                                  where=f'{self.settings_name}.{split}_files', varlen=(FEATURE,))
      self.checked[split] = f'{len(files)} file(s) '

  def split_files(self, split: str) -> list[str]:
    """The files of `split`: its pattern's matches, sorted (a ConfigError if none)."""
    return find_split_files({split: self.patterns[split]}, where=self.settings_name)[split]

  @property
  def needs_segments(self) -> bool:
    """Packed rows need a model that attends within segments only."""
    return self.pack

  @staticmethod
  def _parse(serialized):
    return tf.io.parse_example(serialized, {FEATURE: tf.io.RaggedFeature(tf.int64)})

  def reader(self, *, split, batch_size, start_step=0, rows=None, state=None):
    if start_step and not state:
      raise ConfigError(f'resuming at step {start_step} needs the data position saved with '
                        'the checkpoint (data_state.json), and this checkpoint has none',
                        where=self.settings_name, fix='resume from a checkpoint written by '
                        'this version, or start a new model_dir')

    def unsaved(stream, spec, records):
      del spec, records  # a packed stream's position cannot follow from the step
      if state:
        saved = sorted((k for k in state if k != streams.FILES_KEY), key=int)
        raise ConfigError(f'the checkpoint\'s data position has no stream {stream} (it has '
                          f'{saved})', where=f'{self.settings_name}.num_streams',
                          fix='resume with the number of streams and files of the run '
                              'that wrote it')
      return (0, 0, 0)

    return reading.open_stream_reader(
        files=self.split_files(split), split=split, batch_size=batch_size,
        num_streams=self.num_streams, rows=rows, state=state, start_step=start_step,
        where=self.settings_name, parse=self._parse, seed=2 * self.seed + SPLIT_INDEX[split],
        window=self.shuffle_window, position_length=3, unsaved=unsaved,
        source=lambda stream, position: self._packer(stream, used=position[2]),
        **self._record_format())

  def _packer(self, stream: streams.RecordStream, *, used: int) -> Packer:
    """The rows of one stream, `used` tokens into its current document."""
    return Packer(stream, length=self.seq_len + 1, pack=self.pack, vocab_size=self.vocab_size,
                  used=used)

  def _record_format(self) -> dict:
    """How the streams read the files (`reading.open_stream_reader`'s
    `records` and `count`): TFRecord files by default."""
    return {}

  def features(self, *, split, step, batch_size):
    reader = self.reader(split=split, batch_size=batch_size)
    for _ in range(step):
      next(reader)
    return next(reader)

  def model_inputs(self, batch):
    return (batch['tokens'][:, :-1],)

  def sequence_inputs(self, batch):
    """(segments, positions) of the model's inputs, for segment-aware attention."""
    return batch['segments'][:, :-1], batch['positions'][:, :-1]

  def loss_and_metrics(self, outputs, batch):
    mask = target_mask(batch['segments'])
    loss, accuracy = next_token_loss(outputs, batch['tokens'], mask)
    return loss, {'accuracy': accuracy,
                  'target_fraction': tf.reduce_mean(tf.cast(mask, tf.float32))}

  def input_specs(self, batch_size):
    return (((batch_size, self.seq_len), 'int32'),)

  def describe(self) -> str:
    counts = ', '.join(f'{split} {self.checked.get(split, "")}{pattern}'
                       for split, pattern in self.patterns.items())
    packing = 'packed' if self.pack else 'one document per row'
    return (f'token corpus, vocab {self.vocab_size}, seq_len {self.seq_len}, '
            f'{packing}: {counts}')


def token_example(ids) -> bytes:
  """One document as a serialized `tf.train.Example`: its ids as the int64 `tokens`."""
  feature = tf.train.Feature(int64_list=tf.train.Int64List(value=list(ids)))
  return tf.train.Example(features=tf.train.Features(
      feature={FEATURE: feature})).SerializeToString()


def write_documents(pattern: str, documents: Iterable[Sequence[int]], *,
                    num_shards: int = 1) -> list[str]:
  """Writes each document (a sequence of token ids) as one Example with an
  int64 `tokens` list, dealt round-robin over `num_shards` files named by
  `pattern.format(shard=k, num_shards=n)`; returns the paths.

  A file appears under its name only once complete and on disk (written as
  `name.incomplete`, flushed with fsync, renamed): a run stopped by an error,
  a signal or a kill never leaves a partial file under a final name, and an
  error or a signal leaves no partial file at all."""
  if num_shards < 1:
    raise ConfigError(f'num_shards = {num_shards} must be at least 1', where='num_shards',
                      fix='give the number of files to write, e.g. 8')
  paths = [pattern.format(shard=k, num_shards=num_shards) for k in range(num_shards)]
  if len(set(paths)) != num_shards:
    raise ConfigError(f'output pattern {pattern!r} names the same file for different '
                      'shards', where='output_pattern',
                      fix='put {shard} in the pattern, e.g. train-{shard:05d}.tfrecord')
  for path in paths:
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  partials = [path + INCOMPLETE_SUFFIX for path in paths]
  writers = []
  try:
    writers.extend(tf.io.TFRecordWriter(partial) for partial in partials)
    for i, document in enumerate(documents):
      writers[i % num_shards].write(token_example(document))
    while writers:
      writers.pop().close()
  except BaseException:  # also a stop signal: leave no partial file behind
    for writer in writers:
      writer.close()
    for partial in partials:
      if os.path.exists(partial):
        os.remove(partial)
    raise
  for partial, path in zip(partials, paths):
    replace_durably(partial, path)
  return paths
