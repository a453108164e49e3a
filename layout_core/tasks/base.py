"""Tasks: what a model learns from, as a small interface the trainer drives.

A task answers four questions (and reads, below: `reader` has a default):

  * `features(split=, step=, batch_size=)`: one global batch as a dict of numpy
    arrays, each with the batch as its first dimension;
  * `model_inputs(batch)`: the tensors the model is called with (in order);
  * `loss_and_metrics(outputs, batch)`: the scalar loss to minimise and extra
    scalar metrics (written to TensorBoard as `train/<name>`, `eval/<name>`);
  * `input_specs(batch_size)`: shape and dtype of each model input, so a model
    can be planned (FLOPs, Keras' stateless build) without data.

    task = TFRecordTask(train_files='/data/blobs/train-*.tfrecord',
                        eval_files='/data/blobs/eval-*.tfrecord',
                        features={'x': ('float32', [16]), 'label': ('int64', [])},
                        inputs=['x'], label='label', num_classes=4)
    batch = task.features(split='train', step=0, batch_size=32)  # {'x': [32, 16], 'label': [32]}

How the trainer reads: `reader(split=, batch_size=, start_step=, rows=,
state=)` gives consecutive global batches, and `reader.state()` is where it
stands. The trainer checkpoints the step and that state (`data_state.json`
beside the weights) and, after a restart, asks for a reader at the
checkpoint's step with the checkpoint's state, so the resumed run sees exactly
the batches it would have seen:

  * a task whose batch is a pure function of (seed, split, step) (the LM
    tasks of `layout_core.tasks.lm`, the default `reader` over `iterate`)
    needs no state: its position is the step;
  * a streamed task (`TFRecordTask`, `LMCorpusTask`) saves each stream's
    position and the files they were taken over, and continues from them
    (`layout_core.tasks.reading`): on any mesh and any number of clients;
  * a task that cannot promise either (a live stream) sets
    `deterministic = False`; resume then continues from wherever its
    `iterate` starts, and the loss curve is no longer bit-identical.

The language-model tasks (`MarkovTask`, `TextFileTask` in `layout_core.tasks.lm`)
are implementations of this interface; `TFRecordTask` reads
`tf.train.Example`s with a feature spec and trains classifiers or regressors.
"""

from __future__ import annotations

import glob
import itertools
import math
from typing import Iterator, Mapping, Sequence

import numpy as np

from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.tasks import reading, record_files, streams

SPLITS = ('train', 'eval')
SPLIT_INDEX = {'train': 0, 'eval': 1}  # a split's part in its random streams' seeds

Batch = Mapping[str, np.ndarray]


class Task:
  """The interface (see the module docstring). Subclasses override the four
  questions and `describe`; `iterate` serves consecutive steps from `features`.

  A task's settings are its constructor's keyword arguments, bindable in gin
  once the class is registered (`plugins.registry.register_task`). The
  trainer asks for global batches (every device's rows) and splits each
  array over `train.batch_axis` along its first dimension.

  A whole task, tested: `tests/fixtures/my_project/tasks.py` (shown on
  docs/own-model.md and the API reference).

  Attributes:
    deterministic: `features` is a pure function of (seed, split, step), so a
      resumed run sees the batches it would have seen. A task that cannot
      promise it (a live stream) sets False and overrides `iterate`.
    tokens_per_example: Tokens per batch row, for the train/tokens_per_sec
      scalar.
    needs_segments: A row may hold several documents (packed): the model must
      attend within each document only, so the trainer puts the task's
      `sequence_inputs(batch)` (segments, positions) in the step context
      (`StepContext.sequence`) and refuses engines that cannot.
    settings_name: The configurable the task's settings are bound under, for
      messages that name a setting ('lm_corpus.seq_len'): the name the user
      wrote.
    needs_reference: The loss compares the model with its reference, the
      same model with its LoRA adapters off (preference tuning): every
      engine runs that model too, forward only, and adds
      `reference_features(its outputs, batch)` to the batch the loss reads.
    reference_pending: The reference is computed before training
      (`layout_core.train.reference_logps`) and not given yet: the loop
      refuses to train.
    console_metrics: Metrics the training progress line shows after the loss.
  """

  deterministic: bool = True   # features() is a pure function of (seed, split, step)
  tokens_per_example: int = 1  # for the train/tokens_per_sec scalar
  needs_segments: bool = False  # rows may hold several documents (packed)
  settings_name: str = 'data'   # what the user bound the task's settings under
  needs_reference: bool = False          # the engine runs the reference model too
  reference_pending: bool = False        # a precomputed reference not given yet
  console_metrics: tuple[str, ...] = ()  # shown on the training progress line

  def reference_features(self, reference_outputs: 'tf.Tensor', batch: Mapping[str, 'tf.Tensor']
                         ) -> dict[str, 'tf.Tensor']:
    """What `loss_and_metrics` needs of the reference model's outputs on
    this batch, added to the batch it gets (only with `needs_reference`)."""
    raise NotImplementedError

  def features(self, *, split: str, step: int, batch_size: int) -> dict[str, np.ndarray]:
    """One global batch: the whole batch of step `step`, every device's rows.

    Args:
      split: 'train' or 'eval'.
      step: The step the batch is for (0, 1, ...): after a restart the
        trainer asks for the checkpoint's step, so a batch that is a pure
        function of (seed, split, step) resumes exactly (`split_rng`).
      batch_size: The global batch size (rows).

    Returns:
      {name: numpy array}, each with `batch_size` rows as its first
      dimension.
    """
    raise NotImplementedError

  def model_inputs(self, batch: Mapping[str, 'tf.Tensor']) -> tuple['tf.Tensor', ...]:
    """The model's inputs, in the order it takes them, from a batch (the
    arrays of `features`, as tensors laid out over the mesh).

        return (batch['x'],)
    """
    raise NotImplementedError

  def loss_and_metrics(self, outputs: 'tf.Tensor', batch: Mapping[str, 'tf.Tensor']
                       ) -> tuple['tf.Tensor', dict[str, 'tf.Tensor']]:
    """The scalar loss to minimise and extra scalar metrics.

    `outputs` is the model's output on `model_inputs(batch)`, floating
    outputs as float32 whatever the compute dtype. Each metric is written
    to TensorBoard as `train/<name>` and `eval/<name>`.

        return (softmax_cross_entropy(outputs, batch['label']),
                {'accuracy': accuracy(outputs, batch['label'])})

    A mean over some of the batch's positions (a loss mask) is returned as
    its sums, `layout_core.tasks.objective.Mean(total, count)` (`masked_mean`
    makes one), and a count of the batch as `Total(value)`: the parts of a
    split batch add them and the mean is taken once.

    Returns:
      (loss, {metric name: scalar, Mean or Total}).
    """
    raise NotImplementedError

  def input_specs(self, batch_size: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype) of each model input, in `model_inputs` order.

    Plans a model without data: a Params model's FLOPs (`fprop_meta`), a
    Keras model's stateless build.

        return (((batch_size, self.dim), 'float32'),)
    """
    raise NotImplementedError

  def check_data(self, splits: Sequence[str] = SPLITS) -> None:
    """Reads and checks the data files of `splits` (a ConfigError naming the
    file); the plan of a run calls it for the splits the program reads:
    training both, eval 'eval', decode and export none, so those never need
    (nor read) the training data. Default: nothing to check."""
    del splits

  def trained_targets(self, batch: Batch) -> int | None:
    """How many targets of a host batch (numpy, as `reader` gives it) the
    loss trains on, for the check that a batch trains something
    (`layout_core.train.trained_tokens`); None (the default): not counted,
    every batch trains."""
    del batch
    return None

  def untrained_reason(self, reader: 'BatchReader') -> tuple[str, str, str]:
    """(why, where, fix) for a batch of `reader`'s with no trained target
    (`trained_targets` 0): what the data did, the setting to change as the
    user wrote it, and its value that would train."""
    del reader
    return ('every target is masked out', self.settings_name,
            'check the data and the task\'s settings')

  def describe(self) -> str:
    """One line naming the task and its settings (default: the class name),
    for the run's log (`Data: ...`) and the check that every client of a
    multi-host run trains the same: so the same on every host."""
    return type(self).__name__

  def iterate(self, *, start_step: int, batch_size: int,
              split: str = 'train') -> Iterator[dict[str, np.ndarray]]:
    """Batches for steps start_step, start_step + 1, ..."""
    for step in itertools.count(start_step):
      yield self.features(split=split, step=step, batch_size=batch_size)

  def reader(self, *, split: str, batch_size: int, start_step: int = 0,
             rows: np.ndarray | None = None, state: Mapping | None = None) -> 'BatchReader':
    """Consecutive global batches from `start_step` (or from a checkpoint's
    `state`, as the reader's `state()` gave it). `rows`: the global batch rows
    this client packs (None: all); a streaming task reads only those and
    leaves the others zero. Default: `iterate`, with the step as position."""
    del rows, state  # a function of the step reads everything and needs no state
    return StepReader(self.iterate(start_step=start_step, batch_size=batch_size,
                                   split=split))


class StepReader:
  """A reader over a task's `iterate`: its position is the step itself."""

  def __init__(self, batches: Iterator[dict[str, np.ndarray]]):
    self.batches = batches

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self.batches)

  def state(self) -> None:
    return None


BatchReader = StepReader | streams.StreamReader


def split_rng(seed: int, split: str, step: int) -> np.random.Generator:
  """The generator for one (seed, split, step): independent streams per split.

  A task that draws each batch from it is a pure function of (seed, split,
  step), and so resumes exactly:

      rng = split_rng(self.seed, split, step)
      labels = rng.integers(0, self.num_classes, batch_size)

  Raises:
    ValueError: `split` is not 'train' or 'eval'.
  """
  if split not in SPLIT_INDEX:
    raise ValueError(f'split {split!r} is not one of {SPLITS}')
  return np.random.default_rng([seed, SPLIT_INDEX[split], step])


# -- objectives shared by tasks --------------------------------------------------
def softmax_cross_entropy(logits, labels) -> 'tf.Tensor':
  """The mean softmax cross entropy of logits [..., classes] against integer
  labels [...], a scalar: a classifier's loss."""
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(labels, tf.int32), logits=logits))


def accuracy(logits, labels) -> 'tf.Tensor':
  """The fraction of predictions (rows, or positions for logits [B, T,
  classes]) whose largest logit is at the label, a float32 scalar: a
  classifier's metric."""
  predicted = tf.argmax(logits, axis=-1, output_type=tf.int32)
  return tf.reduce_mean(tf.cast(tf.equal(predicted, tf.cast(labels, tf.int32)), tf.float32))


OBJECTIVES = ('classification', 'regression')


# -- TFRecord files of tf.train.Example ------------------------------------------
_DTYPES = ('float32', 'int64')


def _check_feature_spec(features: Mapping[str, Sequence]) -> dict[str, tuple[str, tuple[int, ...]]]:
  checked = {}
  for name, spec in features.items():
    try:
      dtype, shape = spec
      shape = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
      raise ConfigError(f'feature {name!r} is described as {spec!r}',
                        where='tfrecord_task.features',
                        fix="describe each feature as (dtype, shape), e.g. "
                            "{'x': ('float32', [16]), 'label': ('int64', [])}") from None
    if dtype not in _DTYPES:
      raise ConfigError(f'feature {name!r} has dtype {dtype!r}',
                        where='tfrecord_task.features',
                        fix=f'use one of {_DTYPES} (the numeric tf.train.Example kinds)')
    checked[name] = (dtype, shape)
  return checked


def find_split_files(patterns: Mapping[str, str], *, where: str) -> dict[str, list[str]]:
  """Each split's files (sorted glob matches); a ConfigError for a pattern
  that matches nothing."""
  found = {}
  for split, pattern in patterns.items():
    matched = sorted(glob.glob(pattern))
    if not matched:
      raise ConfigError(f'no file matches the {split} pattern {pattern!r}',
                        where=f'{where}.{split}_files',
                        fix='check the path (globs such as train-*.tfrecord work), '
                            'or write the files first')
    found[split] = matched
  return found


class _BlockSource:
  """A RecordStream as a StreamReader source: blocks of parsed records."""

  def __init__(self, stream: streams.RecordStream, finish):
    self.stream, self.finish = stream, finish

  @property
  def position(self) -> tuple[int, int]:
    return self.stream.position

  def block(self, rows: int) -> dict[str, np.ndarray]:
    return self.finish(self.stream.take(rows), self.stream.spec.files)


class TFRecordTask(Task):
  """Classification or regression on `tf.train.Example`s (see module doc).

  Streamed (`layout_core.tasks.streams`): each split's files are dealt to
  `num_streams` streams read with tf.data and shuffled within windows of
  `shuffle_window` records, so host memory does not grow with the data; a
  client reads only the streams its devices' rows come from. The first
  record of every file of a split is checked against `features` when the
  run's plan checks that split (`check_data`).

  Args:
    train_files: Glob pattern of the train split's TFRecord files (all sorted
      matches; it must match at least one file).
    eval_files: Glob pattern of the eval split's TFRecord files (all sorted
      matches; it must match at least one file).
    features: The Example features to parse, {name: (dtype, shape)}: dtype
      'float32' or 'int64', a fixed shape ([] for a scalar), e.g. {'x':
      ('float32', [16]), 'label': ('int64', [])}.
    inputs: Names of the features given to the model, in order (keys of
      features).
    label: Name of the target feature (a key of features).
    objective: 'classification' (softmax cross entropy, accuracy metric) or
      'regression' (mean squared error, mean_absolute_error metric).
    num_classes: Number of classes for classification (>= 2; labels must be in
      0..num_classes-1); unused for regression.
    seed: Seeds each stream's file order per epoch and its shuffle within
      windows (each split drawn from its own seed derived from it).
    num_streams: Streams each split's files are dealt to (rows of a batch split
      evenly among them); must divide the batch size and be at most the number
      of files or a multiple of it. 0 chooses: the largest divisor of the batch
      size not above the number of files, or a multiple of it up to 8.
    shuffle_window: Consecutive records of a stream shuffled together (a window
      permuted at a time); 1 or less means no shuffling within a file.
  """

  settings_name = 'tfrecord_task'

  def __init__(self, *, train_files: str, eval_files: str,
               features: Mapping[str, Sequence], inputs: Sequence[str], label: str,
               objective: str = 'classification', num_classes: int = 0,
               seed: int = 1234, num_streams: int = 0, shuffle_window: int = 1024):
    self.features_spec = _check_feature_spec(features)
    for name in list(inputs) + [label]:
      if name not in self.features_spec:
        raise ConfigError(f'{name!r} is not a feature (features: '
                          f'{", ".join(self.features_spec)})',
                          where='tfrecord_task.inputs / tfrecord_task.label',
                          fix='name a key of tfrecord_task.features')
    if objective not in OBJECTIVES:
      raise ConfigError(f'tfrecord_task.objective is {objective!r}',
                        fix=f'use one of {OBJECTIVES}')
    if objective == 'classification' and num_classes < 2:
      raise ConfigError(f'tfrecord_task.num_classes is {num_classes}',
                        fix='set the number of classes (>= 2) for a classification task')
    self.inputs, self.label = tuple(inputs), label
    self.patterns = {'train': train_files, 'eval': eval_files}
    self.checked: dict[str, str] = {}  # split: what check_data found, for describe
    self.objective, self.num_classes, self.seed = objective, num_classes, seed
    self.num_streams, self.shuffle_window = num_streams, shuffle_window

  def check_data(self, splits=SPLITS):
    used = {name: self.features_spec[name] for name in self.inputs + (self.label,)}
    for split in splits:
      files = self.split_files(split)
      record_files.check_first_records(files, used,
                                  where=f'tfrecord_task.{split}_files / tfrecord_task.features')
      self.checked[split] = f'{len(files)} file(s) '

  def split_files(self, split: str) -> list[str]:
    """The files of `split`: its pattern's matches, sorted (a ConfigError if none)."""
    return find_split_files({split: self.patterns[split]}, where=self.settings_name)[split]

  def _parse(self, serialized):
    spec = {name: tf.io.FixedLenFeature(self.features_spec[name][1],
                                        tf.as_dtype(self.features_spec[name][0]))
            for name in self.inputs + (self.label,)}
    return tf.io.parse_example(serialized, spec)

  def reader(self, *, split, batch_size, start_step=0, rows=None, state=None):
    def source(stream, position):
      del position  # a record stream's position is all of it
      return _BlockSource(stream, self._finish)

    return reading.open_stream_reader(
        files=self.split_files(split), split=split, batch_size=batch_size,
        num_streams=self.num_streams, rows=rows, state=state, start_step=start_step,
        where=self.settings_name, parse=self._parse, seed=2 * self.seed + SPLIT_INDEX[split],
        window=self.shuffle_window, position_length=2, source=source,
        # A checkpoint without a data state: the position follows from the step.
        unsaved=lambda stream, spec, records: reading.position_after(spec, records=records))

  def _finish(self, block: dict[str, np.ndarray], files: Sequence[str] = ()
              ) -> dict[str, np.ndarray]:
    if self.objective == 'classification':
      labels = block[self.label]
      bad = labels[(labels < 0) | (labels >= self.num_classes)]
      if bad.size:
        raise ConfigError(f'label {self.label!r} is {int(bad[0])} in a record of '
                          f'{", ".join(files) or "the data"}, outside the '
                          f'{self.num_classes} classes 0..{self.num_classes - 1}',
                          where='tfrecord_task.num_classes',
                          fix=f'set tfrecord_task.num_classes above the largest label '
                              f'(at least {int(bad.max()) + 1}), or fix the labels')
      block[self.label] = labels.astype(np.int32)
    return block

  def features(self, *, split, step, batch_size):
    return next(self.reader(split=split, batch_size=batch_size, start_step=step))

  def model_inputs(self, batch):
    return tuple(batch[name] for name in self.inputs)

  def loss_and_metrics(self, outputs, batch):
    labels = batch[self.label]
    if self.objective == 'classification':
      return softmax_cross_entropy(outputs, labels), {'accuracy': accuracy(outputs, labels)}
    error = outputs - tf.reshape(tf.cast(labels, outputs.dtype), tf.shape(outputs))
    return tf.reduce_mean(tf.square(error)), {'mean_absolute_error':
                                                  tf.reduce_mean(tf.abs(error))}

  def input_specs(self, batch_size):
    return tuple(((batch_size,) + self.features_spec[name][1], self.features_spec[name][0])
                 for name in self.inputs)

  def describe(self) -> str:
    counts = ', '.join(f'{split} {self.checked.get(split, "")}{pattern}'
                       for split, pattern in self.patterns.items())
    kind = (f'{self.num_classes}-class classification' if self.objective == 'classification'
            else 'regression')
    text = f'TFRecord {kind} of {self.label!r} from {", ".join(self.inputs)}: {counts}'
    if self.objective == 'classification':
      text += f' (uniform-guess loss {math.log(self.num_classes):.3f})'
    return text
