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
from layout_core.train.optimizer import OptimizerConfig
from layout_core.layout.rules import LayoutRules
from layout_core.tasks import TFRecordTask, read_tfrecords, write_tfrecords
from layout_core.train.config import TrainConfig
from layout_core.train.factory import make_trainer
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
      make_task(str(tmp_path), **overrides)


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


def test_resume_from_a_checkpoint_reads_exactly_the_same_batches(tmp_path, mesh_2x4):
  # 48 training rows, batch 16: 3 steps per epoch, so the resumed half is a new epoch.
  write_blobs(str(tmp_path / 'data'), num_train=48, num_eval=16, num_shards=2)
  straight = classifier_trainer(mesh_2x4, str(tmp_path / 'data'), num_steps=6)
  straight.train()

  first = classifier_trainer(mesh_2x4, str(tmp_path / 'data'), num_steps=3)
  first.train()
  Checkpointer(directory=str(tmp_path / 'ckpt'), state=first.state(),
               config=CheckpointConfig()).save(3, reason='final')
  resumed = classifier_trainer(mesh_2x4, str(tmp_path / 'data'), num_steps=6)  # files re-read
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
