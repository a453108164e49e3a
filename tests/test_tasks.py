"""Tasks: TFRecord files of tf.train.Example round trip, deterministic batches,
exact resume from a checkpoint, and the classifier example end to end."""

import os

import numpy as np
import pytest

from examples.classifier.write_data import write_blobs
from layout_core.checkpoint import manager as checkpoint_lib
from layout_core.checkpoint.manager import CheckpointConfig, Checkpointer
from layout_core.errors import ConfigError
from layout_core.model.base import Sequential
from layout_core.model.layers import FeedForward, Softmax
from layout_core.optim import OptimizerConfig
from layout_core.layout.rules import LayoutRules
from layout_core.tasks import TFRecordTask, read_tfrecords, write_tfrecords
from layout_core.train.config import TrainConfig
from layout_core.run import make_trainer
from layout_core.layout.variables import to_numpy
from tests.conftest import read_events, run_module

FEATURES = {'x': ('float32', [3]), 'label': ('int64', [])}


def make_task(directory, **overrides):
  kwargs = dict(train_files=os.path.join(directory, 'train-*.tfrecord'),
                eval_files=os.path.join(directory, 'eval-*.tfrecord'),
                features={'x': ('float32', [16]), 'label': ('int64', [])},
                inputs=['x'], label='label', num_classes=4, seed=3)
  kwargs.update(overrides)
  return TFRecordTask(**kwargs)


def test_examples_round_trip_through_tfrecord_files(tmp_path):
  rows = {'x': np.arange(30, dtype=np.float32).reshape(10, 3),
          'label': np.arange(10, dtype=np.int64) * 7}
  paths = write_tfrecords(str(tmp_path / 'part-{shard}.tfrecord'), rows, num_shards=3)
  assert len(paths) == 3
  back = read_tfrecords(paths, FEATURES)
  order = np.argsort(back['label'])
  np.testing.assert_array_equal(back['label'][order], rows['label'])
  np.testing.assert_array_equal(back['x'][order], rows['x'])


def test_batches_are_pure_functions_of_the_step_and_cover_each_epoch(tmp_path):
  write_blobs(str(tmp_path), num_train=64, num_eval=16, num_shards=2)
  task, again = make_task(str(tmp_path)), make_task(str(tmp_path))
  first = task.features(split='train', step=5, batch_size=16)
  np.testing.assert_array_equal(first['x'], again.features(split='train', step=5,
                                                           batch_size=16)['x'])
  assert first['x'].shape == (16, 16) and first['label'].dtype == np.int32
  epoch = np.concatenate([task.features(split='train', step=s, batch_size=16)['x']
                          for s in range(4)])           # 4 x 16 = the 64 rows
  assert len(np.unique(epoch, axis=0)) == 64
  next_epoch = task.features(split='train', step=4, batch_size=16)['x']
  assert not np.array_equal(next_epoch, epoch[:16])     # reshuffled per epoch
  assert task.features(split='eval', step=0, batch_size=16)['x'].shape == (16, 16)


def test_bad_task_config_is_a_config_error(tmp_path):
  write_blobs(str(tmp_path), num_train=8, num_eval=8, num_shards=1)
  cases = [(dict(train_files=str(tmp_path / 'nope-*.tfrecord')), 'no file matches'),
           (dict(features={'x': ('float16', [16]), 'label': ('int64', [])}), "dtype 'float16'"),
           (dict(features={'x': 'float32'}), "described as 'float32'"),
           (dict(label='y'), "'y' is not a feature"),
           (dict(num_classes=0), 'num_classes is 0'),
           (dict(objective='ranking'), "objective is 'ranking'")]
  for overrides, message in cases:
    with pytest.raises(ConfigError, match=message):
      make_task(str(tmp_path), **overrides).check_data()  # the files: when a plan checks them


def classifier_trainer(mesh, directory, num_steps):
  mlp = Sequential.Params().Set(name='mlp', sub=[
      FeedForward.Params().Set(input_dim=16, hidden_dim=32, init_stddev=0.2),
      Softmax.Params().Set(input_dim=16, num_classes=4)])
  rules = LayoutRules([(r'.*/ffn/w_in', ('unsharded', 'model')),
                       (r'.*/ffn/w_out', ('model', 'unsharded'))])
  return make_trainer(model=mlp, mesh=mesh, rules=rules, task=make_task(directory),
                 optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=2),
                 config=TrainConfig(num_steps=num_steps, batch_size=16, eval_every=0,
                                    eval_batches=1, log_every=1))


def test_resume_from_a_checkpoint_reads_exactly_the_same_batches(tmp_path, mesh_2x2):
  # 48 training rows, batch 16: 3 steps per epoch, so the resumed half is a new epoch.
  # About the batches, not the mesh's size: 'data' and 'model' split, on 4 devices.
  write_blobs(str(tmp_path / 'data'), num_train=48, num_eval=16, num_shards=2)
  straight = classifier_trainer(mesh_2x2, str(tmp_path / 'data'), num_steps=6)
  straight.train()

  first = classifier_trainer(mesh_2x2, str(tmp_path / 'data'), num_steps=3)
  first.train()
  Checkpointer(directory=str(tmp_path / 'ckpt'), state=first.state(),
               config=CheckpointConfig()).save(3, reason='final')
  resumed = classifier_trainer(mesh_2x2, str(tmp_path / 'data'), num_steps=6)  # files re-read
  assert Checkpointer(directory=str(tmp_path / 'ckpt'), state=resumed.state(),
                      config=CheckpointConfig()).restore_latest() == 3
  resumed.train()
  expected = checkpoint_lib.checkpoint_keys(straight.state())
  actual = checkpoint_lib.checkpoint_keys(resumed.state())
  assert expected.keys() == actual.keys()
  for key in expected:
    np.testing.assert_array_equal(to_numpy(actual[key]), to_numpy(expected[key]), err_msg=key)
  assert resumed.current_step == 6
  # ... and the weights really moved over the second half.
  assert not np.array_equal(to_numpy(first.engine.variables['mlp/ffn/w_in']),
                            to_numpy(resumed.engine.variables['mlp/ffn/w_in']))


def test_classifier_example_trains_end_to_end_from_gin(tmp_path):
  data = tmp_path / 'blobs'
  write_blobs(str(data), num_train=1024, num_eval=256)
  model_dir = str(tmp_path / 'run')
  result = run_module(
      'launch.train', '--gin_file=configs/experiments/classifier_tfrecord.gin',
      f"--gin_bindings=tfrecord_task.train_files = '{data}/train-*.tfrecord'",
      f"--gin_bindings=tfrecord_task.eval_files = '{data}/eval-*.tfrecord'",
      '--gin_bindings=train.num_steps = 40', '--gin_bindings=train.eval_every = 20',
      '--gin_bindings=train.log_every = 10', f'--model_dir={model_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  scalars = read_events(model_dir)['scalars']
  losses = [v for _, v in scalars['eval/loss']]
  accuracy = [v for _, v in scalars['eval/accuracy']]
  assert [s for s, _ in scalars['eval/accuracy']] == [0, 20, 40]
  assert losses[-1] < 0.6 * losses[0]
  assert accuracy[-1] > accuracy[0] + 0.3
  assert 'train/accuracy' in scalars
  assert 'mlp/ffn/w_in' in open(os.path.join(model_dir, 'layouts.txt')).read()


def test_a_setting_that_does_not_fit_the_model_is_named_as_the_user_wrote_it(tmp_path):
  """lm_corpus.seq_len = 64 against transformer_lm.max_len = 32: the message
  names lm_corpus.seq_len and the file and line that set it, not the run
  defaults' data.seq_len (configs/runs/train.gin), which this task never reads."""
  from layout_core.tasks.corpus import write_documents  # pylint: disable=g-import-not-at-top
  from plugins import gin_setup, plan as plan_lib  # pylint: disable=g-import-not-at-top
  write_documents(str(tmp_path / 'train-{shard}.tfrecord'), [[5, 6, 7, 1]] * 4)
  write_documents(str(tmp_path / 'eval-{shard}.tfrecord'), [[5, 6, 1]] * 2)
  mine = tmp_path / 'mine.gin'
  mine.write_text(f"lm_corpus.train_files = '{tmp_path}/train-*.tfrecord'\n"
                  f"lm_corpus.eval_files = '{tmp_path}/eval-*.tfrecord'\n"
                  'lm_corpus.seq_len = 64\n'
                  'transformer_lm.max_len = 32\n')
  with pytest.raises(ConfigError) as raised:
    with gin_setup.parsed_config(files=['configs/experiments/lm_corpus.gin', str(mine)],
                                 bindings=[]):
      plan_lib.make_plan()
  message = str(raised.value)
  assert 'lm_corpus.seq_len=64' in message and 'transformer_lm.max_len=32' in message, message
  assert 'lm_corpus.seq_len is set in' in message and 'mine.gin, line 3' in message, message
  assert 'data.seq_len' not in message, message


def test_every_task_declares_whether_it_needs_segments(tmp_path):
  """`needs_segments` is a member of the Task interface: False unless a task
  packs several documents into a row."""
  from layout_core.tasks import Task  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.corpus import LMCorpusTask, write_documents  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.lm import MarkovTask  # pylint: disable=g-import-not-at-top
  assert Task.needs_segments is False
  assert MarkovTask(vocab_size=8, seq_len=4).needs_segments is False
  write_blobs(str(tmp_path), num_train=8, num_eval=8)
  assert make_task(str(tmp_path)).needs_segments is False
  write_documents(str(tmp_path / 'docs-{shard}.tfrecord'), [[5, 6, 1]] * 2)
  for pack in (True, False):
    corpus = LMCorpusTask(train_files=str(tmp_path / 'docs-*'), eval_files=str(tmp_path / 'docs-*'),
                          vocab_size=8, seq_len=4, pack=pack)
    assert corpus.needs_segments is pack


def test_a_text_file_task_reads_its_file_only_when_data_is_checked_or_read(tmp_path):
  """Decode and export plan a run without its training data: the bytes task
  is made without reading the file; checking the data (training, eval) or
  reading a batch names a missing file, and a present one gives its bytes."""
  from layout_core.tasks.lm import TextFileTask  # pylint: disable=g-import-not-at-top
  missing = TextFileTask(path=str(tmp_path / 'gone.txt'), seq_len=4)
  assert 'gone.txt' in missing.describe()
  for read in (missing.check_data, lambda: missing.batch(step=0, batch_size=2)):
    with pytest.raises(ConfigError, match='data.text_file .*gone.txt.* does not exist'):
      read()
  text = tmp_path / 'notes.txt'
  text.write_bytes(bytes(range(100)))
  task = TextFileTask(path=str(text), seq_len=4)
  task.check_data()
  rows = task.batch(step=0, batch_size=3)
  assert rows.shape == (3, 5) and all(np.all(np.diff(row) == 1) for row in rows)
  assert rows.max() < 90  # the train split: the first 90 bytes
