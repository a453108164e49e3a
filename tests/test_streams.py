"""Streamed data and packed documents, in one process: every record once per
epoch, positions that resume exactly, clients that read only their rows, and
packing whose attention and loss never cross a document boundary."""

import os
import subprocess
import sys

import numpy as np
import pytest

from layout_core.errors import ConfigError
from layout_core.layout.rules import LayoutRules
from layout_core.layout.variables import to_numpy
from layout_core.lazy import tf
from layout_core.model.lm import transformer_lm_params
from layout_core.step_context import SequenceInputs, StepContext, entered
from layout_core.tasks import TFRecordTask, streams, write_tfrecords
from layout_core.tasks.corpus import LMCorpusTask, target_mask, write_documents
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.optim import OptimizerConfig
from tests.numerics import assert_close
from tests.conftest import REPO_ROOT

VOCAB = 64


def document(i: int, length: int) -> list[int]:
  """Document i: ids no other document has at the same offset."""
  return [3 + (i * 7 + t) % (VOCAB - 3) for t in range(length)]


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp('corpus')
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 40, 300)
  documents = [document(i, n) for i, n in enumerate(lengths)]
  write_documents(str(root / 'train-{shard}.tfrecord'), documents, num_shards=4)
  write_documents(str(root / 'eval-{shard}.tfrecord'), documents[:20], num_shards=1)
  return root, documents


def corpus_task(root, **kwargs):
  return LMCorpusTask(train_files=str(root / 'train-*'), eval_files=str(root / 'eval-*'),
                      vocab_size=VOCAB, seq_len=16, **kwargs)


@pytest.fixture(scope='module')
def records(tmp_path_factory):
  """A classifier's files: row i has x = [i, i] and label i % 4 (ids to check)."""
  root = tmp_path_factory.mktemp('records')
  ids = np.arange(90)
  write_tfrecords(str(root / 'train-{shard}.tfrecord'),
                  {'x': np.stack([ids, ids], 1).astype(np.float32), 'label': ids % 4},
                  num_shards=3)
  write_tfrecords(str(root / 'eval-{shard}.tfrecord'),
                  {'x': np.zeros((8, 2), np.float32), 'label': np.zeros(8, np.int64)})
  return root


def record_task(root, **kwargs):
  return TFRecordTask(train_files=str(root / 'train-*'), eval_files=str(root / 'eval-*'),
                      features={'x': ('float32', [2]), 'label': ('int64', [])},
                      inputs=['x'], label='label', num_classes=4, **kwargs)


def test_streams_are_dealt_by_files_or_by_records():
  files = [f'f{i}' for i in range(6)]
  assert [s.files for s in streams.deal_streams(files=files, num_streams=3)] == [
      ('f0', 'f3'), ('f1', 'f4'), ('f2', 'f5')]
  by_record = streams.deal_streams(files=files[:2], num_streams=4)
  assert [(s.files, s.every, s.offset) for s in by_record] == [
      (('f0',), 2, 0), (('f1',), 2, 0), (('f0',), 2, 1), (('f1',), 2, 1)]
  with pytest.raises(ConfigError, match='cannot share 4 files evenly'):
    streams.deal_streams(files=files[:4], num_streams=6)
  assert streams.default_num_streams(num_files=3, batch_size=32) == 2
  assert streams.default_num_streams(num_files=1, batch_size=32) == 8
  assert streams.default_num_streams(num_files=100, batch_size=32) == 32


def test_every_record_once_per_epoch_shuffled_and_resumable_anywhere(records):
  task = record_task(records, num_streams=3, shuffle_window=8)
  reader = task.reader(split='train', batch_size=6)
  seen, states = [], []
  for _ in range(30):  # 2 epochs of 90 records
    seen.append(next(reader)['x'][:, 0].astype(int))
    states.append(reader.state())
  first, second = np.concatenate(seen[:15]), np.concatenate(seen[15:])
  assert sorted(first) == list(range(90)) == sorted(second)
  assert list(first) != sorted(first) and list(first) != list(second)  # shuffled per epoch
  for step in (1, 7, 14, 15, 22):  # inside windows, at the epoch's end, in the next
    resumed = task.reader(split='train', batch_size=6, start_step=step, state=states[step - 1])
    for later in range(step, min(step + 4, 30)):
      np.testing.assert_array_equal(next(resumed)['x'][:, 0], seen[later])
    # Without a saved state the position follows from the step (older checkpoints).
    derived = task.reader(split='train', batch_size=6, start_step=step)
    np.testing.assert_array_equal(next(derived)['x'][:, 0], seen[step])


def test_a_client_reads_only_the_streams_of_its_rows(records):
  task = record_task(records, num_streams=3)
  full = task.reader(split='train', batch_size=6)
  part = task.reader(split='train', batch_size=6, rows=np.array([2, 3]))
  assert sorted(part.sources) == [1]  # rows 2, 3 are stream 1's block
  for _ in range(5):
    a, b = next(full), next(part)
    np.testing.assert_array_equal(a['x'][2:4], b['x'][2:4])
    assert not b['x'][:2].any() and not b['x'][4:].any()
  assert part.sources[1].stream.spec.files == (str(records / 'train-1.tfrecord'),)


def test_packing_keeps_documents_whole_in_order_with_positions(corpus):
  root, documents = corpus
  task = corpus_task(root, num_streams=1)
  reader = task.reader(split='train', batch_size=4)
  stream = reader.sources[0].stream
  order = [documents[i] for i in _stream_order(stream, len(documents))]
  expected = np.concatenate([np.asarray(d) for d in order])
  placed = []
  for _ in range(8):
    batch = next(reader)
    for row in range(4):
      segments = batch['segments'][row]
      for segment in range(1, segments.max() + 1):
        where = np.flatnonzero(segments == segment)
        assert np.array_equal(where, np.arange(where[0], where[-1] + 1))  # contiguous
        np.testing.assert_array_equal(batch['positions'][row, where], np.arange(len(where)))
        placed.append(batch['tokens'][row, where])
      assert not batch['tokens'][row, segments == 0].any()
      assert (segments[segments > 0] > 0).all() and (np.flatnonzero(segments == 0)
                                                       >= np.flatnonzero(segments).max()).all()
  placed = np.concatenate(placed)
  np.testing.assert_array_equal(placed, expected[:len(placed)])  # nothing lost or reordered


def _stream_order(stream, count):
  """The document order of a one-stream reader's first epoch, recomputed from
  the documented rule: files in the epoch's order, windows permuted."""
  fresh = streams.RecordStream(stream.spec, parse=stream.parse, seed=stream.seed,
                               stream_id=stream.stream_id, window=10**6)
  files = fresh.epoch_files(0)
  del fresh
  shard_of = {f'train-{k}.tfrecord': k for k in range(4)}
  in_file_order = [i for f in files for i in range(shard_of[f.rsplit('/', 1)[1]], count, 4)]
  window = stream.window
  order = []
  for w, start in enumerate(range(0, count, window)):
    chunk = in_file_order[start:start + window]
    permutation = np.random.default_rng([stream.seed, stream.stream_id, 0, w + 1]).permutation(
        len(chunk))
    order += [chunk[i] for i in permutation]
  return order


def test_packed_reader_resumes_mid_document_on_any_rows(corpus):
  root, _ = corpus
  task = corpus_task(root)
  reader = task.reader(split='train', batch_size=8)
  batches, states = [], []
  for _ in range(12):
    batches.append(next(reader))
    states.append(reader.state())
  assert any(position[2] for state in states for key, position in state.items()
             if key != streams.FILES_KEY)  # mid-document
  resumed = task.reader(split='train', batch_size=8, start_step=5, state=states[4],
                        rows=np.arange(4, 8))
  for step in range(5, 12):
    batch = next(resumed)
    for name in ('tokens', 'segments', 'positions'):
      np.testing.assert_array_equal(batch[name][4:], batches[step][name][4:])
  with pytest.raises(ConfigError, match='data position'):
    task.reader(split='train', batch_size=8, start_step=5)


def test_a_split_smaller_than_its_streams_reads_its_files_around(tmp_path):
  """6 documents in 2 files, batch 8: 4 streams per file, so the streams
  starting at record 3 of a 3-record file read record 3 mod 3 = 0; the
  others read what they read before (every 4th record from their start)."""
  documents = [document(i, 3 + i) for i in range(6)]
  write_documents(str(tmp_path / 'eval-{shard}.tfrecord'), documents, num_shards=2)
  write_documents(str(tmp_path / 'train-{shard}.tfrecord'), documents, num_shards=2)
  task = LMCorpusTask(train_files=str(tmp_path / 'train-*'), eval_files=str(tmp_path / 'eval-*'),
                      vocab_size=VOCAB, seq_len=16, pack=False, shuffle_window=1)
  reader = task.reader(split='eval', batch_size=8)
  in_file = {0: documents[0::2], 1: documents[1::2]}  # round-robin: file k, row r
  for _ in range(3):  # epochs: one record per stream each
    batch = next(reader)
    for stream in range(8):
      file, start = stream % 2, stream // 2
      expected = in_file[file][start % 3]  # start 3 wraps around to record 0
      row = batch['tokens'][stream]
      np.testing.assert_array_equal(row[:len(expected)], expected)
      assert not row[len(expected):].any()
  # The same rows on a client holding only streams 6 and 7 (the wrapped ones).
  part = next(task.reader(split='eval', batch_size=8, rows=np.array([6, 7])))
  np.testing.assert_array_equal(part['tokens'][6:], batch['tokens'][6:])
  # A stream whose file holds no record has nothing to wrap: named.
  write_documents(str(tmp_path / 'none-{shard}.tfrecord'), [], num_shards=1)
  empty = LMCorpusTask(train_files=str(tmp_path / 'none-*'), eval_files=str(tmp_path / 'eval-*'),
                       vocab_size=VOCAB, seq_len=16)
  with pytest.raises(ConfigError, match=r'stream 0 holds no records: its files .*none-0'):
    next(empty.reader(split='train', batch_size=8))


def test_resuming_over_other_files_is_refused_or_warned(records, tmp_path, caplog):
  """The data state records the files its positions were taken over: files
  added (3 -> 5, the same pattern) refuse the resume naming them; a file of
  another size resumes with a warning naming it; an older state without the
  record resumes as before."""
  root = tmp_path / 'records'
  root.mkdir()
  for name in sorted(os.listdir(records)):
    (root / name).write_bytes((records / name).read_bytes())
  task = record_task(root, num_streams=3)
  reader = task.reader(split='train', batch_size=6)
  for _ in range(4):
    next(reader)
  state = reader.state()
  expected = next(reader)

  def resumed_batch(state):
    return next(record_task(root, num_streams=3).reader(
        split='train', batch_size=6, start_step=4, state=state))

  for k in (3, 4):  # two more files matching the same pattern
    (root / f'train-{k}.tfrecord').write_bytes((root / 'train-0.tfrecord').read_bytes())
  with pytest.raises(ConfigError) as refused:
    resumed_batch(state)
  message = str(refused.value)
  assert 'taken over 3 file(s)' in message and 'now matches 5' in message, message
  assert 'added train-3.tfrecord, train-4.tfrecord' in message, message
  assert 'tfrecord_task.train_files' in message and 'init_from' in message, message
  for k in (3, 4):
    os.remove(root / f'train-{k}.tfrecord')
  np.testing.assert_array_equal(resumed_batch(state)['x'], expected['x'])  # same files
  assert state['files'] == [[f'train-{k}.tfrecord', os.path.getsize(
      root / f'train-{k}.tfrecord')] for k in range(3)]
  # A file replaced by one of another size: the same dealing, a warning.
  write_tfrecords(str(root / 'train-2.tfrecord'),
                  {'x': np.full((40, 2), 7, np.float32), 'label': np.zeros(40, np.int64)})
  with caplog.at_level('WARNING'):
    resumed_batch(state)
  assert any('train-2.tfrecord' in r.getMessage() and 'size changed' in r.getMessage()
             for r in caplog.records), caplog.text
  # A data state from before the record: resumed, unchecked.
  older = {k: v for k, v in state.items() if k != 'files'}
  np.testing.assert_array_equal(resumed_batch(older)['x'][:4], expected['x'][:4])


@pytest.fixture(scope='module')
def packed_lm(corpus, mesh_data8):
  root, _ = corpus
  task = corpus_task(root)
  lm = transformer_lm_params(vocab_size=VOCAB, model_dim=32, num_heads=4, ffn_dim=64,
                             num_layers=2, max_len=16)
  trainer = make_trainer(model=lm, mesh=mesh_data8, rules=LayoutRules([]), task=task,
                         optimizer=OptimizerConfig(), config=TrainConfig(batch_size=8))
  batch = next(task.reader(split='train', batch_size=8))
  return trainer, task, batch


def _logits(trainer, task, batch, *, segments=True):
  model = trainer.engine.program.model

  @tf.function
  def call(packed):
    inputs = task.model_inputs(packed)
    if not segments:
      return model.call(inputs, False)
    segment_ids, positions = task.sequence_inputs(packed)
    with entered(StepContext(sequence=SequenceInputs(segment_ids, positions))):
      return model.call(inputs, False)

  return to_numpy(call(trainer.engine.pack(batch)))


def test_no_attention_crosses_a_document_boundary(packed_lm):
  trainer, task, batch = packed_lm
  rows = [r for r in range(8) if batch['segments'][r].max() >= 2]
  assert rows, 'no row holds two documents'
  changed = {name: value.copy() for name, value in batch.items()}
  for r in rows:  # every token of each row's first document replaced
    first = batch['segments'][r] == 1
    changed['tokens'][r, first] = (batch['tokens'][r, first] + 5) % (VOCAB - 3) + 3
  before, after = _logits(trainer, task, batch), _logits(trainer, task, changed)
  for r in rows:
    later = batch['segments'][r, :-1] >= 2
    first = batch['segments'][r, :-1] == 1
    # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
    assert_close(after[r, later], before[r, later], rel=1e-06, what='later positions')
    assert np.abs(after[r, first] - before[r, first]).max() > 1e-3
  # Control: without the segments the same change reaches the later documents.
  plain_before = _logits(trainer, task, batch, segments=False)
  plain_after = _logits(trainer, task, changed, segments=False)
  later = np.concatenate([batch['segments'][r, :-1] >= 2 for r in rows])
  assert np.abs(plain_after[rows].reshape(-1, VOCAB)[later]
                - plain_before[rows].reshape(-1, VOCAB)[later]).max() > 1e-3


def test_padding_and_boundaries_add_no_loss_and_no_gradient(packed_lm):
  trainer, task, batch = packed_lm
  assert (batch['segments'] == 0).any(), 'no padding in the batch'
  engine = trainer.engine
  variables = engine.trainable

  @tf.function
  def compute(packed):
    with tf.GradientTape() as tape:
      loss, _ = engine.loss_and_metrics(packed)
    return loss, tape.gradient(loss, variables)

  def loss_and_grads(values):
    loss, grads = compute(engine.pack(values))
    return to_numpy(loss), [to_numpy(g) for g in grads]

  loss, grads = loss_and_grads(batch)
  noisy = {name: value.copy() for name, value in batch.items()}
  padding = batch['segments'] == 0
  noisy['tokens'][padding] = np.random.default_rng(1).integers(3, VOCAB, padding.sum())
  noisy_loss, noisy_grads = loss_and_grads(noisy)
  assert noisy_loss == loss
  for a, b in zip(grads, noisy_grads):
    # measured: - / 0 / 0 (default / no oneDNN / 1 thread)
    assert_close(b, a, rel=1e-07, what='gradients')
  # The loss is the mean cross entropy over same-document targets only.
  logits = _logits(trainer, task, batch).astype(np.float64)
  labels = batch['tokens'][:, 1:]
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  losses = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
  mask = to_numpy(target_mask(tf.constant(batch['segments'])))
  assert 0 < mask.sum() < mask.size
  # measured: - / 1e-07 / 1e-07 (default / no oneDNN / 1 thread)
  assert_close(loss, losses[mask].mean(), rel=2e-06, what='loss')


EXIT_CHECK = r'''
import atexit, sys
def after_close():  # registered first, so it runs after close_data_iterators (LIFO)
  from layout_core.tasks.streams import _OPEN_ITERATORS
  held = list(_OPEN_ITERATORS)  # the LM task's and the stream's, still referenced
  print(len(held), 'closed' if all(i._iterator is None for i in held) else 'open', flush=True)
  print('exhausted' if next(batches, None) is None else 'LM batches go on', flush=True)
atexit.register(after_close)
from layout_core.tasks import TFRecordTask, write_tfrecords
from layout_core.tasks.lm import MarkovTask
batches = MarkovTask(vocab_size=16, seq_len=8).iterate(start_step=0, batch_size=4)
next(batches)  # its tf.data thread runs Python (numpy_function)
import numpy as np
write_tfrecords(sys.argv[1] + '/r.tfrecord', {'x': np.zeros((64, 2), np.float32),
                                               'label': np.zeros(64, np.int64)})
task = TFRecordTask(train_files=sys.argv[1] + '/r.tfrecord', eval_files=sys.argv[1] + '/r.tfrecord',
                    features={'x': ('float32', [2]), 'label': ('int64', [])}, inputs=['x'],
                    label='label', num_classes=2)
records = task.reader(split='train', batch_size=4)
next(records)  # a stream: a py_function in its pipeline
'''


def test_open_data_iterators_are_let_go_before_the_interpreter_finalizes(tmp_path):
  """tf.data iterators running Python, destroyed while Python finalizes, can
  hang the process at exit (tensorflow#21277; a pytest run here printed its
  summary and never exited). At exit they are closed first."""
  done = subprocess.run([sys.executable, '-c', EXIT_CHECK, str(tmp_path)], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=120,
                        env={**os.environ, 'PYTHONPATH': REPO_ROOT})
  assert done.returncode == 0, done.stderr[-2000:]
  count, closed = done.stdout.strip().splitlines()[-2].split()
  assert int(count) >= 2 and closed == 'closed', done.stdout  # the LM task's and the streams'
  assert done.stdout.strip().splitlines()[-1] == 'exhausted', done.stdout
