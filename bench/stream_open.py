"""What opening a reader of streamed record files costs: one traced pipeline
per stream, or one shared by every stream of the task.

A stream reads its files with a tf.data pipeline (`layout_core.tasks.streams`):
the epoch's file order and how far ahead it may run (Python steps), the
records a window at a time, the parse. Building such a pipeline traces its
tf.data functions, most of what opening a stream cost; a run opens a reader
per split, and a reader its K streams. The contenders, each a fresh process
reading the same corpus (LMCorpusTask, 8 train files, 8 streams, batches of 8):

* `traced per stream`: each stream traces its own pipeline (what every
  stream did before 2026-12-02, and what a parse that cannot be hashed
  still gets: `_pipeline_factory.__wrapped__`);
* `shared` (meshgin): one tf.function per (records, parse, window) builds
  every stream's pipeline from its token, epoch, window and shard.

Per process: the CPU seconds of the first reader's opening and first batch
(which traces), the best of the next three readers' (each opens anew), and
a digest of every batch read, which must be the same for both. The
contenders run in turns, round after round; each figure is the best round's.

    python bench/stream_open.py [--rounds 3]

Results go to bench/results/stream_open.json.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, children_in_turns, write_json  # noqa: E402

CONTENDERS = ('traced per stream', 'shared')
KEYS = ('first_open_cpu', 'open_cpu', 'digest')

CHILD = r'''
import hashlib, json, os, resource, sys, tempfile
import numpy as np
from layout_core.lazy import tf
from layout_core.tasks import streams
from layout_core.tasks.corpus import LMCorpusTask, write_documents
if sys.argv[1] == 'traced per stream':
  streams._pipeline_factory = streams._pipeline_factory.__wrapped__
root = tempfile.mkdtemp()
rng = np.random.default_rng(0)
documents = [[3 + (start + 5 * t) % 61 for t in range(rng.integers(8, 80))]
             for start in rng.integers(3, 64, 600)]
write_documents(os.path.join(root, 'train-{shard}.tfrecord'), documents, num_shards=8)
write_documents(os.path.join(root, 'eval-{shard}.tfrecord'), documents[:40])
task = LMCorpusTask(train_files=root + '/train-*', eval_files=root + '/eval-*', vocab_size=64,
                    seq_len=32, pack=False)
tf.constant(0)  # TensorFlow's runtime started before the clock does
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
digest, opens = hashlib.sha256(), []
for _ in range(4):
  start = cpu()
  reader = task.reader(split='train', batch_size=8, start_step=0)
  batch = next(reader)
  opens.append(cpu() - start)
  for _ in range(20):
    digest.update(np.ascontiguousarray(batch['tokens']).tobytes())
    batch = next(reader)
print('RESULT ' + json.dumps({'first_open_cpu': opens[0], 'open_cpu': min(opens[1:]),
                              'digest': digest.hexdigest()[:16]}))
'''


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  args = parser.parse_args()
  rounds, best = children_in_turns(
      CHILD, {name: [name] for name in CONTENDERS}, rounds=args.rounds, keys=KEYS,
      describe=lambda r: (f'first reader {r["first_open_cpu"]:.2f} CPU-s, then '
                          f'{r["open_cpu"]:.2f} a reader (8 streams), batches {r["digest"]}'))
  per_stream, shared = best['traced per stream'], best['shared']
  assert per_stream['digest'] == shared['digest'], 'the two read different batches'
  ratios = {'open_per_stream_over_shared': per_stream['open_cpu'] / shared['open_cpu'],
            'first_open_per_stream_over_shared':
                per_stream['first_open_cpu'] / shared['first_open_cpu']}
  print(f'opening a reader of 8 streams: {per_stream["open_cpu"]:.2f} CPU-s traced per '
        f'stream, {shared["open_cpu"]:.2f} shared ({ratios["open_per_stream_over_shared"]:.2f}x); '
        f'the first: {per_stream["first_open_cpu"]:.2f} against {shared["first_open_cpu"]:.2f}; '
        f'the same batches')
  write_json({'best': best, 'ratios': ratios, 'rounds': rounds},
             os.path.join(RESULTS, 'stream_open.json'))


if __name__ == '__main__':
  main()
