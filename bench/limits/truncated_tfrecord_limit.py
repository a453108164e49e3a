"""Limit check: what TF 2.21's TFRecordDataset does with a truncated file.

Writes 1,000 records, cuts the file inside record 500, or inside its 12-byte
header (length and its checksum), and (as a control)
flips bytes inside record 500 of an intact copy), and reads each back with
the default and a 1 MiB read buffer, eagerly and through `batch`: how many
records come back, and which error, if any, is raised.

    python bench/limits/truncated_tfrecord_limit.py [--out bench/results/truncated_tfrecord.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# The repository root (this file is bench/limits/<name>.py): bench.common, layout_core.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from bench.common import RESULTS, write_json  # noqa: E402
import tensorflow as tf  # noqa: E402


def read_back(path: str, *, buffer_size: int | None, batched: bool) -> dict:
  dataset = tf.data.TFRecordDataset(path, buffer_size=buffer_size)
  if batched:
    dataset = dataset.batch(64)
  count = 0
  try:
    for item in dataset:
      count += int(tf.size(item)) if batched else 1
  except tf.errors.OpError as e:
    return {'records': count, 'error': f'{type(e).__name__}: {str(e).splitlines()[0]}'}
  return {'records': count, 'error': None}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--out', default=os.path.join(RESULTS, 'truncated_tfrecord.json'))
  args = parser.parse_args()
  results = {}
  with tempfile.TemporaryDirectory() as root:
    intact = os.path.join(root, 'intact.tfrecord')
    with tf.io.TFRecordWriter(intact) as writer:
      for i in range(1000):
        writer.write(b'%06d' % i * 20)
    data = open(intact, 'rb').read()
    record = len(data) // 1000
    cut, flipped = os.path.join(root, 'cut.tfrecord'), os.path.join(root, 'flipped.tfrecord')
    header_cut = os.path.join(root, 'header_cut.tfrecord')
    with open(cut, 'wb') as f:
      f.write(data[:500 * record + record // 2])
    with open(header_cut, 'wb') as f:  # 5 of the 12 bytes of record 500's header
      f.write(data[:500 * record + 5])
    damaged = bytearray(data)
    damaged[500 * record + record // 2:500 * record + record // 2 + 4] = b'\xff' * 4
    with open(flipped, 'wb') as f:
      f.write(bytes(damaged))
    for name, path in (('truncated inside record 500', cut),
                       ('truncated inside record 500\'s header', header_cut),
                       ('bytes flipped in record 500', flipped)):
      for buffer_size in (None, 1 << 20):
        for batched in (False, True):
          key = f'{name}, buffer {buffer_size or "default"}, {"batched" if batched else "one by one"}'
          results[key] = read_back(path, buffer_size=buffer_size, batched=batched)
          print(f"{key:70s} {results[key]['records']:5d} records, error: {results[key]['error']}")
  write_json(results, args.out)


if __name__ == '__main__':
  main()
