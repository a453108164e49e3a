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
from layout_core.tasks.corpus import LMCorpusTask, write_documents
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
  assert sorted(n for n in os.listdir(output_dir) if n.startswith(split)) == [
      f'{split}-{k:05d}-of-{num_shards:05d}.tfrecord' for k in range(num_shards)]
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
    # As many files as asked, or one per document for a smaller split (eval).
    num_shards = min(SETTINGS['num_shards'], len(expected[split]))
    assert len(summary[split]['files']) == num_shards
    documents = read_split(output_dir, split, num_shards)
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


def test_an_interrupted_document_write_leaves_no_file(tmp_path):
  def documents():
    yield [5, 6, 1]
    yield [7, 1]
    raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    write_documents(str(tmp_path / 'docs-{shard}.tfrecord'), documents(), num_shards=2)
  assert os.listdir(tmp_path) == []


def test_a_small_corpus_has_no_empty_file_and_every_split_reads(corpus):
  """400 kB in 4 shards: 2 eval documents go to 2 files (not 4, two of them
  empty), and a batch of 8 (4 streams per eval file) reads on both splits."""
  output_dir, summary = corpus
  assert summary['eval']['documents'] == 2 and len(summary['eval']['files']) == 2
  for split in ('train', 'eval'):
    for name in summary[split]['files']:
      assert os.path.getsize(os.path.join(output_dir, name)) > 0, name
  task = LMCorpusTask(train_files=os.path.join(output_dir, 'train-*.tfrecord'),
                      eval_files=os.path.join(output_dir, 'eval-*.tfrecord'),
                      vocab_size=summary['vocab_size'], seq_len=32)
  for split in ('train', 'eval'):
    batch = next(task.reader(split=split, batch_size=8))
    assert (batch['segments'] > 0).any(axis=1).all(), split  # every row holds a document


class Killed(BaseException):
  """Stands for a kill: not an Exception, so no `except Exception` handles it."""


def snapshot(directory: str) -> dict[str, bytes]:
  out = {}
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), 'rb') as f:
      out[name] = f.read()
  return out


def test_a_run_stopped_at_any_rename_leaves_the_old_corpus_whole(tmp_path, monkeypatch):
  """Re-preparing over a corpus, stopped at every rename in turn (each shard's,
  the tokenizer's, corpus.json's, the version's): the old corpus reads as it
  was, every file the one its corpus.json names. Only the last rename, the
  link's, publishes the new corpus."""
  output_dir = str(tmp_path / 'corpus')
  settings = dict(text_roots=[STDLIB], max_bytes=60_000, num_shards=2, eval_fraction=0.2)
  prepare.prepare_corpus(output_dir=output_dir, vocab_size=256, **settings)
  old = snapshot(output_dir)
  assert json.loads(old['corpus.json'])['vocab_size'] == 256

  renames = []
  real_replace, real_rename = os.replace, os.rename

  def counted(real):
    def rename(source, target, *args, **kwargs):
      renames.append(target)
      if len(renames) == stop_at:
        raise Killed(f'stopped before renaming {source} to {target}')
      return real(source, target, *args, **kwargs)
    return rename

  monkeypatch.setattr(os, 'replace', counted(real_replace))
  monkeypatch.setattr(os, 'rename', counted(real_rename))
  stop_at = 0  # count a whole run's renames first, into another directory
  prepare.prepare_corpus(output_dir=str(tmp_path / 'count'), vocab_size=200, **settings)
  total, renames[:] = len(renames), []
  assert total >= 6  # tokenizer, 2 + 2 shards, corpus.json (then the version, the link)
  for stop_at in range(1, total):
    renames.clear()
    with pytest.raises(Killed):
      prepare.prepare_corpus(output_dir=output_dir, vocab_size=200, **settings)
    assert snapshot(output_dir) == old, f'stopped at rename {stop_at} of {total}'
  renames.clear()
  stop_at = 0
  summary = prepare.prepare_corpus(output_dir=output_dir, vocab_size=200, **settings)
  new = snapshot(output_dir)
  assert new != old and json.loads(new['corpus.json']) == summary
  assert sorted(new) == sorted(summary['train']['files'] + summary['eval']['files']
                               + ['corpus.json', 'spm.model'])
  # The replaced version stays (a training may read it); the partial ones are gone.
  published = os.path.basename(os.readlink(output_dir))
  assert sorted(os.listdir(output_dir + '.versions')) == ['00001', published] != ['00001'] * 2


def test_an_output_dir_holding_other_files_is_refused(tmp_path):
  output_dir = tmp_path / 'corpus'
  output_dir.mkdir()
  (output_dir / 'train-00000-of-00001.tfrecord').write_bytes(b'')
  with pytest.raises(ConfigError, match='is a directory holding files'):
    prepare.prepare_corpus(output_dir=str(output_dir), text_roots=[STDLIB], max_bytes=1000,
                           vocab_size=256, num_shards=1)
  assert os.listdir(tmp_path) == ['corpus']  # nothing written


# -- a model's own tokenizer (continued pre-training) --------------------------------------
DOCUMENTS = ('the quick brown fox jumps over the lazy dog',
             'one two three four five\nsix seven eight nine ten',
             'a small model learns to count and then stops',
             'the dog and the fox: ten, nine, eight!')


@pytest.fixture(scope='module')
def hf_corpus(tmp_path_factory):
  """A corpus made with a tiny Hugging Face tokenizer (tests/hf_fixtures.py)
  found in a run directory's tokenizer/, as launch.import_hf leaves it."""
  from tests.hf_fixtures import write_tokenizer  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp('hf_corpus')
  run_dir = root / 'run'
  (run_dir / 'tokenizer').mkdir(parents=True)
  write_tokenizer(str(run_dir / 'tokenizer'))
  files = []
  for i, text in enumerate(DOCUMENTS):
    files.append(root / f'doc{i}.txt')
    files[-1].write_text(text)
  output_dir = str(root / 'corpus')
  summary = prepare.prepare_corpus(output_dir=output_dir, text_files=[str(f) for f in files],
                                   tokenizer=str(run_dir), num_shards=2, eval_fraction=0.25)
  return run_dir, output_dir, summary


def test_a_models_own_tokenizer_makes_the_corpus(hf_corpus):
  """Each document's ids are what the tokenizers library gives for it, then
  the eos id its tokenizer_config.json names; corpus.json fingerprints the file."""
  import hashlib  # pylint: disable=g-import-not-at-top
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  run_dir, output_dir, summary = hf_corpus
  path = str(run_dir / 'tokenizer' / 'tokenizer.json')
  reference = Tokenizer.from_file(path)
  eos = reference.token_to_id('</s>')
  assert eos is not None and summary['eos_id'] == eos
  expected = {'train': [d for i, d in enumerate(DOCUMENTS) if i % 4], 'eval': [DOCUMENTS[0]]}
  for split, texts in expected.items():
    documents = read_split(output_dir, split, min(2, len(texts)))
    assert documents == [reference.encode(text).ids + [eos] for text in texts], split
    assert all(eos not in ids[:-1] and len(ids) > 2 for ids in documents)
  record = summary['tokenizer']
  with open(path, 'rb') as f:
    assert record['sha256'] == hashlib.sha256(f.read()).hexdigest()
  assert record['vocab_size'] == summary['vocab_size'] == reference.get_vocab_size()
  assert summary['spm_model'] is None and 'spm.model' not in os.listdir(output_dir)
  with open(os.path.join(output_dir, 'tokenizer.json'), 'rb') as a, open(path, 'rb') as b:
    assert a.read() == b.read()
  # Decoding a run trained on it uses that tokenizer (it is beside the corpus).
  from layout_core.infer import tokens  # pylint: disable=g-import-not-at-top
  task = LMCorpusTask(train_files=os.path.join(output_dir, 'train-*.tfrecord'),
                      eval_files=os.path.join(output_dir, 'eval-*.tfrecord'),
                      vocab_size=summary['vocab_size'], seq_len=8)
  tokenizer = tokens.tokenizer_for(task)
  assert isinstance(tokenizer, tokens.HuggingFaceTokenizer)
  assert tokenizer.encode(DOCUMENTS[1]) == reference.encode(DOCUMENTS[1]).ids


def test_a_run_whose_tokenizer_is_not_the_corpuss_is_refused(hf_corpus, tmp_path):
  from layout_core.tasks.corpus_tokenizer import check_run_tokenizer  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.lm import TextFileTask  # pylint: disable=g-import-not-at-top
  from tests.hf_fixtures import write_tokenizer  # pylint: disable=g-import-not-at-top
  run_dir, output_dir, summary = hf_corpus
  task = LMCorpusTask(train_files=os.path.join(output_dir, 'train-*.tfrecord'),
                      eval_files=os.path.join(output_dir, 'eval-*.tfrecord'),
                      vocab_size=summary['vocab_size'], seq_len=8)
  check_run_tokenizer(task, run_dirs=[str(tmp_path / 'new'), str(run_dir)])  # its own: fine
  other = tmp_path / 'other'
  (other / 'tokenizer').mkdir(parents=True)
  write_tokenizer(str(other / 'tokenizer'), vocab_size=summary['vocab_size'] - 10)
  with pytest.raises(ConfigError) as refused:
    check_run_tokenizer(task, run_dirs=[str(tmp_path / 'new'), str(other)])
  said = str(refused.value)
  assert str(other / 'tokenizer' / 'tokenizer.json') in said
  assert os.path.join(output_dir, 'tokenizer.json') in said and 'prepare_data' in said
  text = tmp_path / 'text.txt'
  text.write_text(' '.join(DOCUMENTS) * 4)
  with pytest.raises(ConfigError, match=r'UTF-8 bytes \(data.text_file'):
    check_run_tokenizer(TextFileTask(path=str(text), seq_len=8), run_dirs=[str(run_dir)])
  # Without a tokenizer of its own, a run's vocabulary must hold the corpus's ids.
  small = LMCorpusTask(train_files=task.patterns['train'], eval_files=task.patterns['eval'],
                       vocab_size=summary['vocab_size'] - 1, seq_len=8)
  with pytest.raises(ConfigError, match=rf'lm_corpus.vocab_size = {summary["vocab_size"] - 1}'):
    check_run_tokenizer(small, run_dirs=[str(tmp_path / 'new')])


def test_training_from_another_tokenizers_run_exits_2_naming_both(hf_corpus, tmp_path):
  """launch.prepare_data --tokenizer, then launch.train on that corpus with
  checkpoint.init_from naming a run whose tokenizer differs: exit 2 before
  anything is trained, naming both tokenizer files."""
  from tests.hf_fixtures import write_tokenizer  # pylint: disable=g-import-not-at-top
  run_dir, _, summary = hf_corpus
  text = tmp_path / 'notes.txt'
  text.write_text('\n'.join(DOCUMENTS))
  corpus = str(tmp_path / 'corpus')
  made = run_module('launch.prepare_data', f'--output_dir={corpus}', f'--text_file={text}',
                    f'--tokenizer={run_dir}', '--eos_token=<s>', '--num_shards=1',
                    '--eval_fraction=0')
  assert made.returncode == 0, made.stderr[-3000:]
  assert 'tokenizer.json, eos 1' in made.stdout
  other = tmp_path / 'other'
  (other / 'tokenizer').mkdir(parents=True)
  write_tokenizer(str(other / 'tokenizer'), vocab_size=summary['vocab_size'] - 10)
  (other / 'checkpoints').mkdir()
  done = run_module(
      'launch.train', '--gin_file=configs/experiments/lm_corpus.gin',
      f'--model_dir={tmp_path / "cpt"}', f"--gin_bindings=checkpoint.init_from = '{other}'",
      f"--gin_bindings=lm_corpus.train_files = '{corpus}/train-*.tfrecord'",
      f"--gin_bindings=lm_corpus.eval_files = '{corpus}/train-*.tfrecord'",
      '--gin_bindings=lm_corpus.vocab_size = 96', '--gin_bindings=transformer_lm.vocab_size = 96')
  assert done.returncode == 2, done.stderr[-3000:]
  assert 'Traceback' not in done.stderr
  assert str(other / 'tokenizer' / 'tokenizer.json') in done.stderr
  assert os.path.join(corpus, 'tokenizer.json') in done.stderr
