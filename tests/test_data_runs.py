"""Real `launch.train` runs on streamed data: a stopped run resumes onto the
uninterrupted loss curve (same mesh: bit-identical; another mesh or two
clients: within 1e-5), clients read only their own files, host memory does
not follow the corpus size, and data faults are named.

Runs are shared through module fixtures: one uninterrupted run, one stopped
by SIGTERM whose checkpoint seeds the other resumes.
"""

import json
import os
import shutil
import signal

import numpy as np
import pytest

from layout_core.tasks import write_tfrecords
from layout_core.tasks.corpus import write_documents
from tests.conftest import (TWO_DEVICES, Launched, killed_if_left, read_events, run_module,
                            run_modules)
from tests.numerics import assert_close

NUM_STEPS = 30
VOCAB = 64


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """Documents with a learnable rule (each token follows from the previous)
  over 8 train files: 8 streams, one file each."""
  root = tmp_path_factory.mktemp('corpus')
  rng = np.random.default_rng(0)
  documents = []
  for i in range(400):
    start = rng.integers(3, VOCAB)
    documents.append([3 + (start + 5 * t) % (VOCAB - 3) for t in range(rng.integers(4, 40))])
  write_documents(str(root / 'train-{shard}.tfrecord'), documents, num_shards=8)
  write_documents(str(root / 'eval-{shard}.tfrecord'), documents[:16])
  return root


def corpus_args(root, *more):
  return ['--gin_file=configs/experiments/lm_corpus.gin',
          f"--gin_bindings=lm_corpus.train_files = '{root}/train-*'",
          f"--gin_bindings=lm_corpus.eval_files = '{root}/eval-*'",
          f'--gin_bindings=lm_corpus.vocab_size = {VOCAB}',
          f'--gin_bindings=transformer_lm.vocab_size = {VOCAB}',
          '--gin_bindings=lm_corpus.seq_len = 16', '--gin_bindings=transformer_lm.max_len = 16',
          '--gin_bindings=lm_corpus.shuffle_window = 16',
          '--gin_bindings=transformer_lm.model_dim = 32', '--gin_bindings=transformer_lm.num_layers = 1',
          '--gin_bindings=transformer_lm.ffn_dim = 64',
          '--gin_bindings=train.batch_size = 8', '--gin_bindings=train.eval_batches = 1',
          '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.log_every = 1',
          "--gin_bindings=optimizer.decay = 'constant'", '--gin_bindings=optimizer.warmup_steps = 0',
          '--gin_bindings=checkpoint.every_steps = 100', '--gin_bindings=checkpoint.keep = 5',
          f'--gin_bindings=train.num_steps = {NUM_STEPS}', TWO_DEVICES, *more]


def losses(model_dir):
  return {step: value for step, value in read_events(model_dir)['scalars']['train/loss']}


@pytest.fixture(scope='module')
def runs(corpus, tmp_path_factory):
  """The module's two shared runs, trained at the same time: the uninterrupted
  curve ({step: loss}) and a run stopped by SIGTERM a few steps in
  ((model_dir, the step it saved at))."""
  straight_dir = str(tmp_path_factory.mktemp('uninterrupted'))
  straight = Launched('launch.train', *corpus_args(corpus), f'--model_dir={straight_dir}',
                      label='uninterrupted run')
  model_dir = str(tmp_path_factory.mktemp('stopped'))
  # The stopped run is told to train far longer (the learning rate is constant,
  # so its steps are the same): it cannot end before the SIGTERM reaches it,
  # however busy the machine.
  run = Launched('launch.train', *corpus_args(corpus, '--gin_bindings=train.num_steps = 100000'),
                 f'--model_dir={model_dir}', label='stopped run')
  with killed_if_left(straight, run):
    run.wait_for(r'step 5/', timeout=300)
    # A run that seems stuck says where: SIGUSR2 prints every thread's Python
    # stack (the training loop's among them) and the run trains on.
    run.process.send_signal(signal.SIGUSR2)
    stacks = run.wait_for(r'Current thread 0x[0-9a-f]+ \(most recent call first\):\n'
                          r'(?:  File .*\n)+', timeout=60).group(0)
    assert os.path.join('plugins', 'training.py') in stacks, stacks
    output = run.stop_after(r'step 5/', timeout=300)
    straight_output = straight.finish(timeout=300)
  assert straight.process.returncode == 0, straight_output[-3000:]
  curve = losses(straight_dir)
  assert sorted(curve) == list(range(1, NUM_STEPS + 1))
  assert run.process.returncode == 0, output[-3000:]
  step = int(next(n for n in os.listdir(os.path.join(model_dir, 'checkpoints'))
                  if n.startswith('ckpt-')).split('-')[1])
  assert 5 <= step < NUM_STEPS, output[-2000:]
  with open(os.path.join(model_dir, 'checkpoints', f'ckpt-{step}', 'data_state.json')) as f:
    state = json.load(f)['train']
  assert sorted((k for k in state if k != 'files'), key=int) == [str(k) for k in range(8)]
  assert [name for name, _ in state['files']] == [f'train-{k}.tfrecord' for k in range(8)]
  return curve, (model_dir, step)


@pytest.fixture(scope='module')
def uninterrupted(runs):
  return runs[0]


@pytest.fixture(scope='module')
def stopped(runs):
  return runs[1]


def resumed_copy(stopped, target):
  model_dir, step = stopped
  source = os.path.join(model_dir, 'checkpoints', f'ckpt-{step}')
  shutil.copytree(source, os.path.join(target, 'checkpoints', f'ckpt-{step}'))
  return step


def test_a_stopped_run_resumes_bit_identically_on_the_same_mesh(corpus, stopped, uninterrupted,
                                                                tmp_path):
  target = str(tmp_path / 'same')
  step = resumed_copy(stopped, target)
  result = run_module('launch.train', *corpus_args(corpus), f'--model_dir={target}')
  assert result.returncode == 0, result.stderr[-3000:]
  curve = losses(target)
  assert sorted(curve) == list(range(step + 1, NUM_STEPS + 1))
  for s, value in curve.items():
    assert value == uninterrupted[s], (s, value, uninterrupted[s])
  before = losses(stopped[0])  # and the stopped run's own steps were the same
  assert all(before[s] == uninterrupted[s] for s in range(1, step + 1))


def test_resumed_on_another_mesh_shape_follows_the_same_curve(corpus, stopped, uninterrupted,
                                                             tmp_path):
  target = str(tmp_path / 'data4')
  step = resumed_copy(stopped, target)
  result = run_module('launch.train', *corpus_args(corpus),
                      "--gin_bindings=mesh.shape = {'data': 4}",  # the rows split 4 ways, not 2
                      f'--model_dir={target}')
  assert result.returncode == 0, result.stderr[-3000:]
  curve = losses(target)
  assert sorted(curve) == list(range(step + 1, NUM_STEPS + 1))
  # measured, data=2 resumed on data=4: 1.3e-07 / 1.3e-07 / 1.3e-07 (default / no oneDNN /
  # 1 thread)
  assert_close([curve[s] for s in sorted(curve)], [uninterrupted[s] for s in sorted(curve)],
               rel=2e-06, what='losses')


def test_two_clients_resume_reading_only_their_own_files(corpus, stopped, uninterrupted,
                                                         tmp_path):
  target = str(tmp_path / 'two_clients')
  step = resumed_copy(stopped, target)
  result = run_module('launch.local_cluster', '--num_clients=2', '--devices_per_client=1', '--',
                      *corpus_args(corpus), f'--model_dir={target}', timeout=400)
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  output = result.stdout + result.stderr
  for client, shards in ((0, range(0, 4)), (1, range(4, 8))):
    line = next(l for l in output.splitlines()
                if f'[client {client}]' in l and 'Training data: streams' in l)
    named = sorted(int(p.rsplit('-', 1)[1].split('.')[0])
                   for p in line.split('file(s): ')[1].split(', '))
    assert named == list(shards), line
  curve = losses(target)
  assert sorted(curve) == list(range(step + 1, NUM_STEPS + 1))
  # measured: 0 / 0 / 0 (default / no oneDNN / 1 thread)
  assert_close([curve[s] for s in sorted(curve)], [uninterrupted[s] for s in sorted(curve)],
               rel=1e-05, what='losses')


def test_decode_export_and_eval_of_a_run_whose_training_data_is_gone(corpus, stopped, tmp_path):
  """Decode, export and eval plan a run without reading (or needing) its
  training data: the stopped run with lm_corpus.train_files pointed where no
  file is. Control: training's plan (launch.inspect) refuses that pattern."""
  model_dir, _ = stopped
  gone = f"--gin_bindings=lm_corpus.train_files = '{tmp_path}/moved-away/train-*'"
  output = tmp_path / 'decoded.jsonl'
  decoded, exported, evaluated, inspected = run_modules([
      ('launch.decode', f'--model_dir={model_dir}', gone, '--prompt_ids=3,8,13',
       '--max_new_tokens=4', f'--output={output}'),
      ('launch.export', f'--model_dir={model_dir}', gone, f'--export_dir={tmp_path}/export',
       '--max_new_tokens=8'),
      ('launch.eval', f'--model_dir={model_dir}', gone, f'--output_dir={tmp_path}/eval'),
      ('launch.inspect', *corpus_args(corpus, gone))])
  for result in (decoded, exported, evaluated):
    assert result.returncode == 0, result.stderr[-3000:]
  assert len(json.loads(output.read_text())['continuation']) == 4
  assert os.path.isfile(tmp_path / 'export' / 'saved_model.pb')
  assert os.path.isfile(tmp_path / 'eval' / 'eval_heldout' / 'metrics.json')
  assert inspected.returncode == 2, inspected.stderr[-2000:]
  assert "no file matches the train pattern '" + f"{tmp_path}/moved-away/train-*'" in (
      inspected.stderr)


def test_a_resume_over_added_files_exits_2_naming_them(corpus, stopped, tmp_path):
  """The train pattern matched 8 files when the checkpoint was taken and 10
  now: the saved positions belong to another dealing of files to streams."""
  grown = tmp_path / 'grown'
  shutil.copytree(corpus, grown)
  for k in (8, 9):
    shutil.copy(grown / 'train-0.tfrecord', grown / f'train-{k}.tfrecord')
  target = str(tmp_path / 'resumed')
  resumed_copy(stopped, target)
  result = run_module('launch.train', *corpus_args(grown), f'--model_dir={target}')
  assert result.returncode == 2, result.stderr[-3000:]
  message = result.stderr.split('Configuration error:')[1]
  assert 'taken over 8 file(s)' in message and 'now matches 10' in message, message
  assert 'added train-8.tfrecord, train-9.tfrecord' in message, message
  assert 'lm_corpus.train_files' in message and 'init_from' in message, message
  assert 'Traceback' not in result.stderr


def test_packed_documents_on_a_pipeline_engine_exit_2_saying_what_works(corpus, tmp_path):
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.train', '--gin_file=configs/experiments/lm_pipeline.gin',
                      '--gin_bindings=data.task = @lm_corpus()',
                      *[a for a in corpus_args(corpus)[1:] if a != TWO_DEVICES and (
                          'transformer_lm.' not in a or 'vocab_size' in a)],
                      f'--model_dir={model_dir}')
  assert result.returncode == 2, result.stderr[-3000:]
  message = result.stderr.split('Configuration error:')[1]
  assert 'a pipeline engine' in message and 'lm_corpus.pack = False' in message, message
  assert not os.path.exists(model_dir)


# -- host memory does not follow the corpus --------------------------------------
WIDTH = 256


def write_rows(root, rows):
  """`rows` examples of 256 floats (1000 distinct ones, repeated: writing fast)."""
  rng = np.random.default_rng(0)
  distinct = 1000
  paths = write_tfrecords(str(root / 'seed-{shard}.tfrecord'),
                          {'x': rng.normal(size=(distinct, WIDTH)).astype(np.float32),
                           'label': rng.integers(0, 4, distinct)})
  from layout_core.lazy import tf  # pylint: disable=import-outside-toplevel
  records = [r.numpy() for r in tf.data.TFRecordDataset(paths)]
  os.remove(paths[0])
  for shard in range(4):
    with tf.io.TFRecordWriter(str(root / f'train-{shard}.tfrecord')) as writer:
      for i in range(rows // 4):
        writer.write(records[i % distinct])
  with tf.io.TFRecordWriter(str(root / 'eval-0.tfrecord')) as writer:
    for record in records[:256]:
      writer.write(record)


# The classifier's runs below are about data, not devices: its Megatron split
# on 2 devices instead of 8 (tests/conftest.TWO_DEVICES says what that saves).
CLASSIFIER_ON_2 = "--gin_bindings=mesh.shape = {'data': 1, 'model': 2}"


def classifier_args(root, *more):
  return ['--gin_file=configs/experiments/classifier_tfrecord.gin', CLASSIFIER_ON_2,
          f"--gin_bindings=tfrecord_task.train_files = '{root}/train-*'",
          f"--gin_bindings=tfrecord_task.eval_files = '{root}/eval-*'",
          f"--gin_bindings=tfrecord_task.features = {{'x': ('float32', [{WIDTH}]), "
          "'label': ('int64', [])}",
          f'--gin_bindings=feed_forward.input_dim = {WIDTH}',
          f'--gin_bindings=softmax.input_dim = {WIDTH}',
          '--gin_bindings=train.num_steps = 30', '--gin_bindings=train.log_every = 10',
          '--gin_bindings=train.eval_every = 0', *more]


def test_host_memory_does_not_grow_with_the_corpus(tmp_path):
  peaks = {}
  for rows in (20_000, 200_000):  # 20 MB and 205 MB of features
    root = tmp_path / f'rows{rows}'
    root.mkdir()
    write_rows(root, rows)
    model_dir = str(tmp_path / f'run{rows}')
    result = run_module('launch.train', *classifier_args(root), f'--model_dir={model_dir}')
    assert result.returncode == 0, result.stderr[-3000:]
    peaks[rows] = read_events(model_dir)['scalars']['usage/host_peak_bytes'][-1][1]
  growth = (peaks[200_000] - peaks[20_000]) / 2**20
  assert growth < 64, f'peak host memory grew {growth:.0f} MiB with 10x the data: {peaks}'


# -- data faults -------------------------------------------------------------------
@pytest.fixture(scope='module')
def blobs(tmp_path_factory):
  root = tmp_path_factory.mktemp('blobs')
  rng = np.random.default_rng(1)
  write_tfrecords(str(root / 'train-{shard}.tfrecord'),
                  {'x': rng.normal(size=(2000, 16)).astype(np.float32),
                   'label': rng.integers(0, 4, 2000)}, num_shards=1)
  write_tfrecords(str(root / 'eval-{shard}.tfrecord'),
                  {'x': rng.normal(size=(64, 16)).astype(np.float32),
                   'label': rng.integers(0, 4, 64)})
  return root


def blob_args(root, *more):
  return ['--gin_file=configs/experiments/classifier_tfrecord.gin', CLASSIFIER_ON_2,
          f"--gin_bindings=tfrecord_task.train_files = '{root}/train-*'",
          f"--gin_bindings=tfrecord_task.eval_files = '{root}/eval-*'",
          '--gin_bindings=train.eval_every = 0', '--gin_bindings=train.log_every = 5', *more]


def test_a_feature_spec_that_does_not_match_the_files_is_named_and_writes_nothing(blobs, tmp_path):
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.train', *blob_args(
      blobs, "--gin_bindings=tfrecord_task.features = {'x': ('float32', [8]), "
             "'label': ('int64', [])}"), f'--model_dir={model_dir}')
  assert result.returncode == 2, result.stderr[-3000:]
  message = result.stderr.split('Configuration error:')[1]
  assert 'train-0.tfrecord' in message and "'x'" in message, message
  assert '16 values' in message and '[8]' in message, message
  assert 'Traceback' not in result.stderr
  assert not os.path.exists(model_dir)


def test_a_model_that_does_not_take_the_data_names_both_shapes(blobs, tmp_path):
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.train', *blob_args(
      blobs, '--gin_bindings=feed_forward.input_dim = 8', '--gin_bindings=softmax.input_dim = 8'),
      f'--model_dir={model_dir}')
  assert result.returncode == 2, result.stderr[-3000:]
  message = result.stderr.split('Configuration error:')[1]
  assert 'width' in message and '= 8' in message and '[64, 16]' in message, message
  assert 'layout' not in message.lower(), message
  assert not os.path.exists(model_dir)


def test_a_label_outside_the_classes_is_named(blobs, tmp_path):
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.train', *blob_args(blobs, '--gin_bindings=tfrecord_task.num_classes = 2',
                                                 '--gin_bindings=softmax.num_classes = 2'),
                      f'--model_dir={model_dir}')
  assert result.returncode == 2, result.stderr[-3000:]
  message = result.stderr.split('Configuration error:')[1]
  assert "label 'label' is" in message and 'outside the 2 classes' in message, message
  assert 'layout' not in message.lower(), message


@pytest.mark.parametrize('fault', ['corrupt', 'truncated'])
def test_a_bad_record_mid_run_exits_5_naming_the_file_and_keeps_the_checkpoints(blobs, tmp_path,
                                                                                fault):
  root = tmp_path / 'data'
  shutil.copytree(blobs, root)
  path = root / 'train-0.tfrecord'
  data = bytearray(path.read_bytes())
  middle = len(data) // 2
  if fault == 'corrupt':
    data[middle:middle + 8] = b'\xff' * 8  # inside a record half-way through the file
  else:  # a copy that stopped inside a record half-way through the file (not in the
    # record's 12-byte header: TF reads that as a shorter file, bench/limits/truncated_tfrecord_limit.py)
    start = 0
    while start < middle:
      start += 12 + int.from_bytes(data[start:start + 8], 'little') + 4
    data = data[:start + 12 + 10]
  path.write_bytes(bytes(data))
  model_dir = str(tmp_path / 'run')
  result = run_module('launch.train', *blob_args(
      root, '--gin_bindings=tfrecord_task.shuffle_window = 4',
      '--gin_bindings=checkpoint.every_steps = 5', '--gin_bindings=train.num_steps = 200'),
      f'--model_dir={model_dir}')
  assert result.returncode == 5, result.stderr[-3000:]
  assert f'data file {path} cannot be read' in result.stderr, result.stderr[-3000:]
  with open(os.path.join(model_dir, 'run_status.json')) as f:
    assert json.load(f)['status'] == 'data_error'
  from layout_core.checkpoint.files import checkpoint_dirs, validate  # pylint: disable=import-outside-toplevel
  saved = checkpoint_dirs(os.path.join(model_dir, 'checkpoints'))
  assert saved, 'no checkpoint was written before the fault'
  for _, checkpoint in saved:
    assert validate(checkpoint) is None
