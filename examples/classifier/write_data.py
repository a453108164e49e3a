r"""Writes a small classification data set as TFRecord files of tf.train.Examples.

  python -m examples.classifier.write_data --out_dir=/tmp/meshgin/blobs
  python -m launch.train --gin_file=configs/experiments/classifier_tfrecord.gin \
      --model_dir=runs/classifier

Each example is a point `x` (float32 [dim]) drawn around one of `num_classes`
random centres, with the centre's index as `label` (int64). The centres
overlap, so the best accuracy is below 100%: a real, if small, learning task.
Files: train-0000k-of-0000n.tfrecord and eval-00000-of-00001.tfrecord.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from layout_core.tasks import write_tfrecords


def gaussian_blobs(*, num_rows: int, dim: int, num_classes: int, seed: int,
                   spread: float = 1.5) -> dict[str, np.ndarray]:
  centres = np.random.default_rng([seed, 0]).normal(size=(num_classes, dim))
  rng = np.random.default_rng([seed, 1, num_rows])
  labels = rng.integers(0, num_classes, num_rows)
  points = centres[labels] + spread * rng.normal(size=(num_rows, dim))
  return {'x': points.astype(np.float32), 'label': labels.astype(np.int64)}


def write_blobs(out_dir: str, *, num_train: int = 4096, num_eval: int = 512, dim: int = 16,
                num_classes: int = 4, num_shards: int = 2, seed: int = 0) -> dict[str, list[str]]:
  """Writes the train and eval splits; returns their file paths."""
  train = gaussian_blobs(num_rows=num_train + num_eval, dim=dim, num_classes=num_classes,
                         seed=seed)
  evaluation = {k: v[num_train:] for k, v in train.items()}
  train = {k: v[:num_train] for k, v in train.items()}
  return {
      'train': write_tfrecords(os.path.join(out_dir, 'train-{shard:05d}-of-{num_shards:05d}.tfrecord'),
                               train, num_shards=num_shards),
      'eval': write_tfrecords(os.path.join(out_dir, 'eval-{shard:05d}-of-{num_shards:05d}.tfrecord'),
                              evaluation, num_shards=1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out_dir', default='/tmp/meshgin/blobs')
  parser.add_argument('--num_train', type=int, default=4096)
  parser.add_argument('--num_eval', type=int, default=512)
  args = parser.parse_args()
  paths = write_blobs(args.out_dir, num_train=args.num_train, num_eval=args.num_eval)
  print(f"wrote {', '.join(p for ps in paths.values() for p in ps)}")


if __name__ == '__main__':
  main()
