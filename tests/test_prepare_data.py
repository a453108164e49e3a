"""Corpus preparation on real text (the standard library's sources), read back
with TensorFlow's own parser and checked against the source files."""

from __future__ import annotations

import json
import os

import pytest
import sentencepiece
import tensorflow as tf

from layout_core.errors import ConfigError
from layout_core.tasks import prepare
from tests.conftest import run_module

STDLIB = os.path.dirname(os.__file__)
SETTINGS = {'max_bytes': 400_000, 'vocab_size': 256, 'num_shards': 4}
FLAGS = [f'--text_root={STDLIB}', '--max_bytes=400000', '--vocab_size=256', '--num_shards=4']
SPEC = {'tokens': tf.io.VarLenFeature(tf.int64)}


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  output_dir = str(tmp_path_factory.mktemp('corpus'))
  summary = prepare.prepare_corpus(output_dir=output_dir, text_roots=[STDLIB], **SETTINGS)
  return output_dir, summary


def read_split(output_dir: str, split: str, num_shards: int) -> list[list[int]]:
  """The split's documents in the order they were dealt: shard i % n, row i // n."""
  shards = []
  for k in range(num_shards):
    path = os.path.join(output_dir, f'{split}-{k:05d}-of-{num_shards:05d}.tfrecord')
    shards.append([tf.sparse.to_dense(tf.io.parse_single_example(record, SPEC)['tokens'])
                   .numpy().tolist() for record in tf.data.TFRecordDataset(path)])
  assert all(len(a) >= len(b) for a, b in zip(shards, shards[1:])), 'not round-robin'
  return [shards[i % num_shards][i // num_shards]
          for i in range(sum(map(len, shards)))]


def test_records_decode_back_to_the_source_files(corpus):
  output_dir, summary = corpus
  with open(os.path.join(output_dir, 'corpus.json')) as f:
    assert json.load(f) == summary
  # The source texts, read here without the library, in the order it collected them.
  texts = []
  for path in summary['sources']['paths']:
    assert path.startswith(STDLIB) and 200 <= os.path.getsize(path) <= 200_000
    with open(path, 'rb') as f:
      texts.append(f.read().decode('utf-8', errors='replace'))
  texts = [text for text in texts if text.strip()]
  assert summary['sources']['bytes'] >= SETTINGS['max_bytes']
  every = round(1 / 0.05)
  expected = {'train': [t for i, t in enumerate(texts) if i % every],
              'eval': texts[::every]}
  processor = sentencepiece.SentencePieceProcessor(
      model_file=os.path.join(output_dir, 'spm.model'))
  assert processor.vocab_size() == summary['vocab_size'] == SETTINGS['vocab_size']

  exact = 0
  for split in ('train', 'eval'):
    documents = read_split(output_dir, split, SETTINGS['num_shards'])
    assert len(documents) == len(expected[split]) == summary[split]['documents'] > 0
    assert sum(map(len, documents)) == summary[split]['tokens']
    for ids, text in zip(documents, expected[split]):
      assert ids[-1] == 1 and 1 not in ids[:-1] and 0 not in ids  # eos once, no pad
      assert all(0 <= i < SETTINGS['vocab_size'] for i in ids)
      if 2 in ids[:-1]:  # unk: only for characters outside printable ASCII
        assert any(not c.isascii() for c in text)
        continue
      assert processor.decode(ids[:-1]) == text  # newlines and indentation kept
      exact += 1
  assert exact >= 0.8 * len(texts)
  assert (summary['train']['documents'] + summary['eval']['documents']
          == summary['sources']['documents'] == len(texts))


def test_launcher_is_deterministic_and_rejects_a_missing_file(corpus, tmp_path):
  output_dir, _ = corpus
  again = str(tmp_path / 'again')
  result = run_module('launch.prepare_data', f'--output_dir={again}', *FLAGS)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'train:' in result.stdout and 'vocab 256' in result.stdout
  names = sorted(os.listdir(output_dir))
  assert sorted(os.listdir(again)) == names
  for name in names:  # another process, the same bytes (corpus.json included)
    with open(os.path.join(output_dir, name), 'rb') as a, open(os.path.join(again, name),
                                                                 'rb') as b:
      assert a.read() == b.read(), name

  missing = str(tmp_path / 'no_such_file.txt')
  rejected = str(tmp_path / 'rejected')
  result = run_module('launch.prepare_data', f'--output_dir={rejected}',
                      f'--text_file={missing}')
  assert result.returncode == 2, result.stderr[-3000:]
  assert missing in result.stderr and 'Configuration error' in result.stderr
  assert not os.path.exists(rejected)  # nothing written


def test_a_vocab_too_large_for_the_text_names_the_setting(tmp_path):
  text = tmp_path / 'small.txt'
  text.write_text('def add(a, b):\n  return a + b\n' * 20)
  with pytest.raises(ConfigError, match=r'vocab_size = 5000 is too large .* at most \d+'):
    prepare.prepare_corpus(output_dir=str(tmp_path / 'out'), text_files=[str(text)],
                           vocab_size=5000, num_shards=1, eval_fraction=0)


def test_an_interrupted_write_leaves_no_file(corpus, tmp_path):
  output_dir, _ = corpus

  def documents():
    yield 'import os\n'
    raise KeyboardInterrupt  # as a stop signal would, mid-way

  with pytest.raises(KeyboardInterrupt):
    prepare.write_token_records(documents=documents(),
                                model_path=os.path.join(output_dir, 'spm.model'),
                                output_pattern=str(tmp_path / 'part-{shard}.tfrecord'),
                                num_shards=2)
  assert os.listdir(tmp_path) == []
