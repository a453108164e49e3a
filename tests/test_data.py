"""Deterministic data: the same (seed, split, step) always gives the same batch."""

import math

import numpy as np
import pytest

from layout_core.tasks import lm as data
from layout_core.errors import ConfigError


def test_markov_batches_are_deterministic_and_split_disjoint():
  task = data.MarkovTask(vocab_size=32, seq_len=16, branching=3, seed=5)
  a = task.batch(step=7, batch_size=4)
  np.testing.assert_array_equal(a, data.MarkovTask(
      vocab_size=32, seq_len=16, branching=3, seed=5).batch(step=7, batch_size=4))
  assert not np.array_equal(a, task.batch(step=8, batch_size=4))
  assert not np.array_equal(a, task.batch(step=7, batch_size=4, split='eval'))
  assert a.shape == (4, 17) and a.dtype == np.int32


def test_markov_sequences_follow_the_chain():
  task = data.MarkovTask(vocab_size=32, seq_len=50, branching=2, seed=1)
  tokens = task.batch(step=0, batch_size=16)
  for row in tokens:
    for current, following in zip(row[:-1], row[1:]):
      assert following in task.successors[current]
  floor = task.entropy_floor()
  assert 0 < floor <= math.log(2) + 1e-9 < math.log(32)


def test_dataset_resumes_at_any_step():
  task = data.MarkovTask(vocab_size=16, seq_len=8)
  iterator = task.iterate(start_step=0, batch_size=2)
  batches = [next(iterator) for _ in range(5)]
  resumed = next(task.iterate(start_step=3, batch_size=2))
  np.testing.assert_array_equal(batches[3]['tokens'], resumed['tokens'])
  np.testing.assert_array_equal(batches[0]['tokens'], task.batch(step=0, batch_size=2))
  np.testing.assert_array_equal(
      batches[2]['tokens'], task.features(split='train', step=2, batch_size=2)['tokens'])


def test_text_file_task(tmp_path):
  path = tmp_path / 'text.txt'
  path.write_bytes(b'hello meshgin! ' * 200)
  task = data.make_task(text_file=str(path), seq_len=10)
  batch = task.batch(step=0, batch_size=3)
  assert batch.shape == (3, 11) and task.vocab_size == 256
  assert bytes(batch[0].astype(np.uint8)) in b'hello meshgin! ' * 3
  # The file is read when the data is checked (a plan that trains or evaluates):
  with pytest.raises(ConfigError, match='does not exist'):
    data.make_task(text_file=str(tmp_path / 'missing.txt')).check_data()
  (tmp_path / 'short.txt').write_bytes(b'abc')
  with pytest.raises(ConfigError, match='shorter than seq_len'):
    data.make_task(text_file=str(tmp_path / 'short.txt'), seq_len=10).check_data()
