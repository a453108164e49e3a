"""Which tokenizer a corpus was made with, and whether a run's model speaks it.

A corpus of token ids means nothing without the tokenizer that made them:
ids from Qwen2's `tokenizer.json` fed to a model that learned another
vocabulary (or a byte corpus fed to an imported Llama) train without an
error and teach the model nonsense. So `launch.prepare_data` records its
tokenizer in `corpus.json`, and a training run compares it with its model's:

    hf = HuggingFaceCorpusTokenizer.find('runs/qwen')   # runs/qwen/tokenizer/tokenizer.json
    hf.encode_documents(['def f():', 'x = 1'])          # [[...ids, eos], [...ids, eos]]
    hf.record('tokenizer.json')   # {'kind': 'hugging_face', 'sha256': ..., 'vocab_size': ...}

    check_run_tokenizer(task, run_dirs=['runs/cpt', 'runs/qwen'])  # ConfigError naming both

A tokenizer is identified by the sha256 of its file (`tokenizer.json`, or a
SentencePiece `spm.model` / `tokenizer.model`) and its vocabulary size. A
run's own tokenizer is the one in `<run>/tokenizer/` (`launch.import_hf`
copies it there), of the run itself or of the run its `checkpoint.init_from`
names. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable, Sequence

from layout_core.errors import ConfigError
from layout_core.tasks.tokenizer import (RUN_TOKENIZER_DIR, HuggingFaceTokenizer,
                                         SentencePieceTokenizer)

HF_TOKENIZER_FILE = 'tokenizer.json'
SPM_TOKENIZER_FILE = 'tokenizer.model'     # a run's SentencePiece tokenizer (Llama 2)
CORPUS_SUMMARY = 'corpus.json'            # as layout_core.tasks.prepare writes it
HUGGING_FACE, SENTENCEPIECE = 'hugging_face', 'sentencepiece'
_BATCH = 256  # documents encoded together (the tokenizers library uses its threads)


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(1 << 20):
      digest.update(chunk)
  return digest.hexdigest()


def find_tokenizer_json(directory: str, *, where: str) -> str:
  """`directory/tokenizer.json` (a Hugging Face model's directory), else
  `directory/tokenizer/tokenizer.json` (a meshgin run's), else a ConfigError."""
  for candidate in (directory, os.path.join(directory, RUN_TOKENIZER_DIR)):
    path = os.path.join(candidate, HF_TOKENIZER_FILE)
    if os.path.isfile(path):
      return path
  has_spm = any(os.path.isfile(os.path.join(d, SPM_TOKENIZER_FILE))
                for d in (directory, os.path.join(directory, RUN_TOKENIZER_DIR)))
  raise ConfigError(
      f'{where} {directory!r} holds no {HF_TOKENIZER_FILE} (nor does its '
      f'{RUN_TOKENIZER_DIR}/ directory)' + (
          f'; it has a SentencePiece {SPM_TOKENIZER_FILE}, which prepare_data does not read '
          '(its special ids are not the corpus\'s)' if has_spm else ''), where=where,
      fix='give a Hugging Face model directory or a run directory made by launch.import_hf '
          'that has tokenizer.json (the model\'s "fast" tokenizer)')


@dataclasses.dataclass
class HuggingFaceCorpusTokenizer:
  """A Hugging Face `tokenizer.json` that tokenizes a corpus: each document
  as `Tokenizer.encode(text)` gives it (with the special tokens its
  post-processor adds, as the model saw text in pre-training), then `eos_id`."""
  path: str
  eos_id: int
  eos_token: str

  @classmethod
  def find(cls, directory: str, *, eos_token: str | None = None,
           where: str = '--tokenizer') -> 'HuggingFaceCorpusTokenizer':
    """The tokenizer of a Hugging Face directory or a run directory, its
    end-of-document token `eos_token`, else the one its files name
    (`tokenizer_config.json`'s eos_token, else the eos_token_id of
    `generation_config.json` or `config.json`)."""
    if not os.path.isdir(directory):
      raise ConfigError(f'{where} {directory!r} is not a directory', where=where,
                        fix='give a Hugging Face model directory or a meshgin run directory')
    path = find_tokenizer_json(directory, where=where)
    tokenizer = _load(path, where=where)
    if eos_token is None:
      eos_token = _named_eos(os.path.dirname(path), tokenizer, where=where)
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
      raise ConfigError(f'the end-of-document token {eos_token!r} is not a token of {path}',
                        where='--eos_token',
                        fix='give one of its special tokens, e.g. "</s>" or "<|endoftext|>"')
    return cls(path=path, eos_id=eos_id, eos_token=eos_token)

  def __post_init__(self):
    self._tokenizer = _load(self.path, where='--tokenizer')
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    unk = getattr(self._tokenizer.model, 'unk_token', None)
    self.unk_id = self._tokenizer.token_to_id(unk) if unk else None

  def encode_documents(self, documents: Iterable[str]) -> Iterable[list[int]]:
    """Each document's ids, ending in eos (added unless the tokenizer ends it so)."""
    batch = []
    for document in documents:
      batch.append(document)
      if len(batch) == _BATCH:
        yield from self._encoded(batch)
        batch = []
    yield from self._encoded(batch)

  def _encoded(self, batch: Sequence[str]) -> Iterable[list[int]]:
    for encoding in self._tokenizer.encode_batch(list(batch)) if batch else ():
      ids = list(encoding.ids)
      if ids and ids[-1] != self.eos_id:
        ids.append(self.eos_id)
      yield ids

  def record(self, name: str) -> dict:
    """What corpus.json says of it, `name` its copy beside the records."""
    return {'kind': HUGGING_FACE, 'file': name, 'source': os.path.abspath(self.path),
            'sha256': file_sha256(self.path), 'vocab_size': self.vocab_size,
            'eos_id': self.eos_id, 'eos_token': self.eos_token}


def _load(path: str, *, where: str):
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  try:
    return Tokenizer.from_file(path)
  except Exception as e:  # pylint: disable=broad-except  # tokenizers raises its own types
    raise ConfigError(f'{path} is not a Hugging Face tokenizer ({e})', where=where,
                      fix='give the directory of a model\'s tokenizer.json') from None


def _named_eos(directory: str, tokenizer, *, where: str) -> str:
  """The end-of-sequence token the model's files name (`find`)."""
  config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
  token = config.get('eos_token')
  if isinstance(token, dict):
    token = token.get('content')
  if isinstance(token, str) and token:
    return token
  for name in ('generation_config.json', 'config.json'):
    token_id = _read_json(os.path.join(directory, name)).get('eos_token_id')
    if isinstance(token_id, list) and token_id:
      token_id = token_id[0]
    if isinstance(token_id, int) and tokenizer.id_to_token(token_id) is not None:
      return tokenizer.id_to_token(token_id)
  raise ConfigError(f'{where}: no end-of-sequence token is named beside {directory} '
                    '(tokenizer_config.json\'s eos_token, or eos_token_id in '
                    'generation_config.json or config.json)', where='--eos_token',
                    fix='give the token that ends a document with --eos_token, e.g. '
                        '--eos_token="<|endoftext|>"')


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding='utf-8') as f:
      value = json.load(f)
  except (OSError, ValueError):
    return {}
  return value if isinstance(value, dict) else {}


# -- a run against its data ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Identity:
  """A tokenizer as the check compares them: what it is, and its fingerprint
  (None: the data's tokenizer has none, e.g. UTF-8 bytes)."""
  what: str
  sha256: str | None
  vocab_size: int | None


def run_tokenizer_file(run_dir: str) -> str | None:
  """The tokenizer file a run carries in `run_dir/tokenizer/` (`tokenizer.json`,
  else `tokenizer.model`), as `layout_core.infer.tokens.run_tokenizer` reads it."""
  for name in (HF_TOKENIZER_FILE, SPM_TOKENIZER_FILE):
    path = os.path.join(run_dir, RUN_TOKENIZER_DIR, name)
    if os.path.isfile(path):
      return path
  return None


def corpus_record(train_files: str) -> tuple[str, dict] | None:
  """(the corpus directory, its tokenizer record) for the corpus whose train
  files match `train_files`; a corpus.json of a version before records
  (SentencePiece only) gives one built from its spm_model. None without a
  corpus.json (records written by other means)."""
  directory = os.path.dirname(train_files) or '.'
  summary = _read_json(os.path.join(directory, CORPUS_SUMMARY))
  if not summary:
    return None
  record = summary.get('tokenizer')
  if isinstance(record, dict) and record.get('file'):
    return directory, record
  if summary.get('spm_model'):
    return directory, {'kind': SENTENCEPIECE, 'file': summary['spm_model'],
                       'vocab_size': summary.get('vocab_size')}
  return None


def data_identity(task) -> Identity | None:
  """The tokenizer `task`'s token ids come from; None when unknown (no
  corpus.json, a task without text)."""
  from layout_core.tasks.corpus import LMCorpusTask  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.lm import TextFileTask  # pylint: disable=g-import-not-at-top
  if isinstance(task, TextFileTask):
    return Identity(f'UTF-8 bytes (data.text_file {task.path})', None, 256)
  if not isinstance(task, LMCorpusTask):
    return None
  found = corpus_record(task.patterns['train'])
  if found is None:
    return None
  directory, record = found
  path = os.path.join(directory, record['file'])
  sha256 = record.get('sha256') or (file_sha256(path) if os.path.isfile(path) else None)
  return Identity(f'{path} ({record.get("vocab_size")} ids; the corpus\'s, corpus.json)',
                  sha256, record.get('vocab_size'))


def check_run_tokenizer(task, *, run_dirs: Sequence[str]) -> None:
  """ConfigError when the model's own tokenizer (that of the first of
  `run_dirs` that carries one: the run, then its init_from's) is not the one
  the task's ids were made with, naming both; without one, when the corpus's
  tokenizer has more ids than the task's vocab_size."""
  own = next((path for path in map(run_tokenizer_file, filter(None, run_dirs)) if path), None)
  data = data_identity(task)
  if data is None:
    return
  if own is None:
    if data.vocab_size and data.vocab_size > task.vocab_size:
      raise ConfigError(
          f'lm_corpus.vocab_size = {task.vocab_size}, but the corpus was tokenized with '
          f'{data.what}: its ids do not fit', where='lm_corpus.vocab_size',
          fix=f'set lm_corpus.vocab_size (and transformer_lm.vocab_size) to at least '
              f'{data.vocab_size}')
    return
  if data.sha256 == file_sha256(own):
    return
  settings = ('data.text_file' if data.sha256 is None and data.vocab_size == 256
              else 'lm_corpus.train_files')
  model = (HuggingFaceTokenizer(own) if own.endswith('.json')
           else SentencePieceTokenizer(own, of_model=True))
  raise ConfigError(
      f'the model\'s tokenizer is {model.describe()}, but the training data was tokenized '
      f'with {data.what}: the model would learn ids that mean other text', where=settings,
      fix=f'make the corpus with the model\'s tokenizer: python -m launch.prepare_data '
          f'--tokenizer={os.path.dirname(os.path.dirname(own))} --output_dir=... and point '
          'lm_corpus.train_files / eval_files at it')
