"""Benchmark: the streamed input pipeline against bare tf.data, and the share
of a training step spent waiting for input.

Side by side in one run, in turns (best of `--rounds`):
  * examples/s of `TFRecordTask`'s reader (streams, window shuffle, per-step
    blocks) against a bare `tf.data` read + parse of the same files
    (`TFRecordDataset -> batch -> parse_example -> prefetch`, no shuffle):
    the price of streams and exact positions (target: ratio >= 0.8);
  * on the lm_small model (3.3M parameters) over a packed token corpus, the
    time each step spends in `next(reader)` against the whole step (target:
    <= 5%): the loop reads the next batch on the training thread.

    python bench/input.py [--rows 65536 --rounds 3 --out bench/results/input.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from layout_core.layout.mesh import MeshSpec, build_mesh  # noqa: E402

MESH = build_mesh(MeshSpec(shape={'data': 8}))

import numpy as np  # noqa: E402

from bench.common import RESULTS, write_json  # noqa: E402
from layout_core.layout.rules import LayoutRules  # noqa: E402
from layout_core.layout.variables import to_numpy  # noqa: E402
from layout_core.lazy import tf  # noqa: E402
from layout_core.model.lm import transformer_lm_params  # noqa: E402
from layout_core.tasks import TFRecordTask, write_tfrecords  # noqa: E402
from layout_core.tasks.corpus import LMCorpusTask, write_documents  # noqa: E402
from layout_core.train.config import TrainConfig  # noqa: E402
from layout_core.run import make_trainer  # noqa: E402
from layout_core.optim import OptimizerConfig  # noqa: E402

WIDTH, BATCH = 256, 256


def write_classifier_files(root: str, rows: int) -> list[str]:
  rng = np.random.default_rng(0)
  write_tfrecords(os.path.join(root, 'eval-{shard}.tfrecord'),
                  {'x': np.zeros((BATCH, WIDTH), np.float32), 'label': np.zeros(BATCH, np.int64)})
  return write_tfrecords(os.path.join(root, 'train-{shard}.tfrecord'),
                         {'x': rng.normal(size=(rows, WIDTH)).astype(np.float32),
                          'label': rng.integers(0, 4, rows)}, num_shards=8)


def meshgin_examples_per_sec(root: str, steps: int) -> float:
  task = TFRecordTask(train_files=os.path.join(root, 'train-*'),
                      eval_files=os.path.join(root, 'eval-*'),
                      features={'x': ('float32', [WIDTH]), 'label': ('int64', [])},
                      inputs=['x'], label='label', num_classes=4)
  reader = task.reader(split='train', batch_size=BATCH)
  next(reader)  # the first windows: opening and filling buffers
  start = time.perf_counter()
  for _ in range(steps):
    next(reader)
  return steps * BATCH / (time.perf_counter() - start)


def bare_examples_per_sec(files: list[str], steps: int) -> float:
  spec = {'x': tf.io.FixedLenFeature([WIDTH], tf.float32),
          'label': tf.io.FixedLenFeature([], tf.int64)}
  dataset = (tf.data.TFRecordDataset(files).repeat().batch(BATCH)
             .map(lambda r: tf.io.parse_example(r, spec), num_parallel_calls=tf.data.AUTOTUNE)
             .prefetch(2))
  batches = dataset.as_numpy_iterator()
  next(batches)
  start = time.perf_counter()
  for _ in range(steps):
    next(batches)
  return steps * BATCH / (time.perf_counter() - start)


def input_share_of_step(root: str, steps: int) -> dict:
  """lm_small on packed documents: seconds in next(reader) and per step."""
  rng = np.random.default_rng(1)
  documents = [rng.integers(3, 1024, rng.integers(20, 400)) for _ in range(4000)]
  write_documents(os.path.join(root, 'docs-train-{shard}.tfrecord'), documents, num_shards=8)
  write_documents(os.path.join(root, 'docs-eval-{shard}.tfrecord'), documents[:64])
  task = LMCorpusTask(train_files=os.path.join(root, 'docs-train-*'),
                      eval_files=os.path.join(root, 'docs-eval-*'), vocab_size=1024, seq_len=64)
  lm = transformer_lm_params(vocab_size=1024, model_dim=256, num_heads=8, ffn_dim=1024,
                             num_layers=4, max_len=64)
  trainer = make_trainer(model=lm, mesh=MESH, rules=LayoutRules([]), task=task,
                         optimizer=OptimizerConfig(), config=TrainConfig(batch_size=32))
  reader = task.reader(split='train', batch_size=32)
  for _ in range(3):  # compile
    to_numpy(trainer.train_step(next(reader))[0])
  waiting = total = 0.0
  for _ in range(steps):
    start = time.perf_counter()
    batch = next(reader)
    read = time.perf_counter()
    loss = trainer.train_step(batch)[0]
    to_numpy(loss)  # the loop syncs only at log steps; syncing here makes steps whole
    waiting += read - start
    total += time.perf_counter() - start
  return {'input_seconds_per_step': waiting / steps, 'step_seconds': total / steps,
          'input_fraction': waiting / total}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--rows', type=int, default=65536)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--out', default=os.path.join(RESULTS, 'input.json'))
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as root:
    files = write_classifier_files(root, args.rows)
    reads = args.rows // BATCH
    rates = {'meshgin': [], 'bare_tf_data': []}
    for _ in range(args.rounds):  # in turns
      rates['meshgin'].append(meshgin_examples_per_sec(root, reads))
      rates['bare_tf_data'].append(bare_examples_per_sec(files, reads))
    best = {name: max(values) for name, values in rates.items()}
    share = input_share_of_step(root, args.steps)
  results = {'examples_per_sec': best, 'ratio': best['meshgin'] / best['bare_tf_data'],
             'rounds': rates, 'rows': args.rows, 'batch': BATCH, 'width': WIDTH,
             'lm_small_input': share}
  print(f"input pipeline alone: meshgin {best['meshgin']:,.0f} examples/s, bare tf.data "
        f"{best['bare_tf_data']:,.0f} examples/s: ratio {results['ratio']:.2f} (target >= 0.8)")
  print(f"lm_small, batch 32x64 packed: input {1e3 * share['input_seconds_per_step']:.2f} ms of "
        f"a {1e3 * share['step_seconds']:.0f} ms step = {100 * share['input_fraction']:.1f}% "
        '(target <= 5%)')
  write_json(results, args.out)


if __name__ == '__main__':
  main()
