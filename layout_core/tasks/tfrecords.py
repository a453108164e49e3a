"""Numpy arrays to and from TFRecord files of `tf.train.Example`s, one row each.

    paths = write_tfrecords('/data/blobs/train-{shard}.tfrecord',
                            {'x': np.zeros([64, 16], np.float32), 'label': labels},
                            num_shards=4)
    arrays = read_tfrecords(paths, {'x': ('float32', (16,)), 'label': ('int64', ())})

What `layout_core.tasks.TFRecordTask` reads; examples and tests write their
data with it.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np

from layout_core.lazy import tf


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
