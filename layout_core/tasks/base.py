"""Tasks: what a model learns from, as a small interface the trainer drives.

A task answers four questions, and the trainer needs nothing else from it:

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

Exact resume: the trainer checkpoints the data position (the next step) and
asks for `features(step=position)` after a restart. Every task here makes a
batch a pure function of (seed, split, step, batch_size), so the resumed run
sees exactly the batches it would have seen. A task that cannot promise that
(a live stream) sets `deterministic = False`; resume then continues from
wherever its `iterate` starts, and the loss curve is no longer bit-identical.

The language-model tasks (`MarkovTask`, `TextFileTask` in `layout_core.tasks.lm`)
are implementations of this interface; `TFRecordTask` reads
`tf.train.Example`s with a feature spec and trains classifiers or regressors.
"""

from __future__ import annotations

import glob
import itertools
import math
import os
from typing import Iterator, Mapping, Sequence

import numpy as np

from layout_core.errors import ConfigError
from layout_core.lazy import tf

SPLITS = ('train', 'eval')
_SPLIT_INDEX = {'train': 0, 'eval': 1}

Batch = Mapping[str, np.ndarray]


class Task:
  """The interface (see the module docstring). Subclasses override the four
  questions and `describe`; `iterate` serves consecutive steps from `features`."""

  deterministic: bool = True   # features() is a pure function of (seed, split, step)
  tokens_per_example: int = 1  # for the train/tokens_per_sec scalar

  def features(self, *, split: str, step: int, batch_size: int) -> dict[str, np.ndarray]:
    raise NotImplementedError

  def model_inputs(self, batch: Mapping[str, 'tf.Tensor']) -> tuple['tf.Tensor', ...]:
    raise NotImplementedError

  def loss_and_metrics(self, outputs: 'tf.Tensor', batch: Mapping[str, 'tf.Tensor']
                       ) -> tuple['tf.Tensor', dict[str, 'tf.Tensor']]:
    raise NotImplementedError

  def input_specs(self, batch_size: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype) of each model input, in `model_inputs` order."""
    raise NotImplementedError

  def describe(self) -> str:
    return type(self).__name__

  def iterate(self, *, start_step: int, batch_size: int,
              split: str = 'train') -> Iterator[dict[str, np.ndarray]]:
    """Batches for steps start_step, start_step + 1, ..."""
    for step in itertools.count(start_step):
      yield self.features(split=split, step=step, batch_size=batch_size)


def split_rng(seed: int, split: str, step: int) -> np.random.Generator:
  """The generator for one (seed, split, step): independent streams per split."""
  if split not in _SPLIT_INDEX:
    raise ValueError(f'split {split!r} is not one of {SPLITS}')
  return np.random.default_rng([seed, _SPLIT_INDEX[split], step])


# -- objectives shared by tasks --------------------------------------------------
def softmax_cross_entropy(logits, labels) -> 'tf.Tensor':
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(labels, tf.int32), logits=logits))


def accuracy(logits, labels) -> 'tf.Tensor':
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


def write_tfrecords(pattern: str, arrays: Mapping[str, np.ndarray], *,
                    num_shards: int = 1) -> list[str]:
  """Writes row i of every array as one `tf.train.Example`, over `num_shards`
  files named by `pattern.format(shard=k, num_shards=n)`; returns the paths."""
  num_rows = {len(a) for a in arrays.values()}
  if len(num_rows) != 1:
    raise ValueError(f'arrays have different numbers of rows: {num_rows}')
  (rows,) = num_rows
  paths = []
  for shard in range(num_shards):
    path = pattern.format(shard=shard, num_shards=num_shards)
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    with tf.io.TFRecordWriter(path) as writer:
      for i in range(shard, rows, num_shards):
        feature = {}
        for name, array in arrays.items():
          values = np.asarray(array[i]).reshape(-1)
          if np.issubdtype(values.dtype, np.floating):
            feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
          else:
            feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        example = tf.train.Example(features=tf.train.Features(feature=feature))
        writer.write(example.SerializeToString())
    paths.append(path)
  return paths


def read_tfrecords(files: Sequence[str], features: Mapping[str, tuple[str, tuple[int, ...]]]
                   ) -> dict[str, np.ndarray]:
  """Every Example of `files` (in the given order) parsed into numpy arrays."""
  spec = {name: tf.io.FixedLenFeature(shape, tf.as_dtype(dtype))
          for name, (dtype, shape) in features.items()}
  dataset = tf.data.TFRecordDataset(list(files)).batch(4096).map(
      lambda records: tf.io.parse_example(records, spec))
  parts: dict[str, list[np.ndarray]] = {name: [] for name in features}
  for chunk in dataset.as_numpy_iterator():
    for name in features:
      parts[name].append(chunk[name])
  return {name: (np.concatenate(chunks) if chunks else
                 np.zeros((0,) + features[name][1], features[name][0]))
          for name, chunks in parts.items()}


class TFRecordTask(Task):
  """Classification or regression on `tf.train.Example`s (see module doc).

  Each split is read into host memory once, on first use; the batch for
  (split, step) is rows `step * batch_size ...` of an epoch-wise permutation
  drawn from (seed, split, epoch), so it is a pure function of the step and
  resume is exact. Data larger than host memory needs a streaming task.
  """

  def __init__(self, *, train_files: str, eval_files: str,
               features: Mapping[str, Sequence], inputs: Sequence[str], label: str,
               objective: str = 'classification', num_classes: int = 0,
               seed: int = 1234):
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
    self.patterns = {'train': train_files, 'eval': eval_files}
    self.files = {}
    for split, pattern in self.patterns.items():
      matched = sorted(glob.glob(pattern))
      if not matched:
        raise ConfigError(f'no file matches the {split} pattern {pattern!r}',
                          where=f'tfrecord_task.{split}_files',
                          fix='check the path (globs such as train-*.tfrecord work), '
                              'or write the files first')
      self.files[split] = matched
    self.inputs, self.label = tuple(inputs), label
    self.objective, self.num_classes, self.seed = objective, num_classes, seed
    self._data: dict[str, dict[str, np.ndarray]] = {}

  def split_data(self, split: str) -> dict[str, np.ndarray]:
    if split not in self._data:
      data = read_tfrecords(self.files[split], self.features_spec)
      if not len(data[self.label]):
        raise ConfigError(f'the {split} files {self.patterns[split]!r} hold no examples',
                          where=f'tfrecord_task.{split}_files')
      self._data[split] = data
    return self._data[split]

  def features(self, *, split, step, batch_size):
    data = self.split_data(split)
    num_rows = len(data[self.label])
    positions = step * batch_size + np.arange(batch_size)
    epochs, offsets = positions // num_rows, positions % num_rows
    rows = np.empty(batch_size, np.int64)
    for epoch in np.unique(epochs):
      order = split_rng(self.seed, split, int(epoch)).permutation(num_rows)
      rows[epochs == epoch] = order[offsets[epochs == epoch]]
    batch = {name: data[name][rows] for name in self.inputs + (self.label,)}
    if self.objective == 'classification':
      batch[self.label] = batch[self.label].astype(np.int32)
    return batch

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
    counts = ', '.join(f'{split} {len(files)} file(s) {self.patterns[split]}'
                       for split, files in self.files.items())
    kind = (f'{self.num_classes}-class classification' if self.objective == 'classification'
            else 'regression')
    text = f'TFRecord {kind} of {self.label!r} from {", ".join(self.inputs)}: {counts}'
    if self.objective == 'classification':
      text += f' (uniform-guess loss {math.log(self.num_classes):.3f})'
    return text
