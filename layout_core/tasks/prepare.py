"""Preparing an LM corpus: text files -> a tokenizer -> TFRecords of ids.

Tokenization happens once, here, offline and on the host, so training reads
ready-made token ids. The corpus can be made from text already on the machine
(the sources and docs of the Python standard library, say): nothing is
downloaded.

    summary = prepare_corpus(text_roots=['/usr/lib/python3.11'], output_dir='/data/corpus',
                             max_bytes=4_000_000, vocab_size=1024, num_shards=8)
    summary['train']['files']   # ['train-00000-of-00008.tfrecord', ...] in /data/corpus

Each source file is one document. Every k-th document (k = 1 / eval_fraction,
by index) goes to eval, the rest to train; the SentencePiece model is trained
on the train documents only. `output_dir` then holds:

  * `spm.model`: the tokenizer; ids 0 = pad, 1 = eos, 2 = unk, no bos; or,
    with `tokenizer=` a Hugging Face or run directory, a copy of its
    `tokenizer.json` (`layout_core.tasks.corpus_tokenizer`: each document
    as the tokenizer encodes it, then its eos id);
  * `train-KKKKK-of-NNNNN.tfrecord`, `eval-...`: one `tf.train.Example` per
    document, a single int64 VarLen feature `tokens` ending in eos (1),
    documents dealt round-robin over `num_shards` files, or over one file per
    document when a split has fewer documents (a small eval split): no file
    is empty, so every stream a trainer deals a file to has a record;
  * `corpus.json`: counts, vocab size, the tokenizer (its file, sha256, vocab
    size and eos id, which a training run checks against its model's), the
    source files and the record files (these relative to output_dir).

Publishing is atomic as a whole (`layout_core.tasks.corpus_versions`):
`output_dir` is a link to a complete version, switched in one rename, so a
reader sees the old corpus or the new one, never a mix. An `output_dir` that
is a directory holding files (written by hand, or by prepare_data before
versions) is refused rather than moved.

The SentencePiece model keeps text as it is (no Unicode normalization, whitespace and
newlines kept, indentation as whitespace pieces), and every printable ASCII
character is in its vocabulary, so source code decodes back exactly; other
characters rarer than the coverage become unk. Everything is deterministic:
the same inputs give byte-identical files.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import string
from typing import Iterable, Iterator, Sequence

from absl import logging
import sentencepiece

from layout_core.errors import ConfigError
from layout_core.durable import write_atomically
from layout_core.tasks import corpus_versions as versions
from layout_core.tasks.corpus import FEATURE as TOKENS_FEATURE, write_documents
from layout_core.tasks.corpus_tokenizer import (HF_TOKENIZER_FILE, SENTENCEPIECE,
                                                HuggingFaceCorpusTokenizer, file_sha256)

DEFAULT_SUFFIXES = ('.py', '.md', '.rst', '.txt')
MIN_FILE_BYTES = 200      # smaller files are mostly boilerplate (empty __init__.py)
MAX_FILE_BYTES = 200_000  # larger ones are mostly data tables, not prose or code

PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
SPLITS = ('train', 'eval')
SPM_MODEL_NAME = 'spm.model'
SUMMARY_NAME = 'corpus.json'
RECORD_PATTERN = '{split}-{{shard:05d}}-of-{{num_shards:05d}}.tfrecord'

# Always in the vocabulary, however rare: code needs '$', '~', 'Q' to round-trip.
_REQUIRED_CHARS = ''.join(c for c in string.printable if c not in ' \n\r\x0b\x0c')


def collect_text_files(*, roots: Sequence[str], suffixes: Sequence[str] = DEFAULT_SUFFIXES,
                       max_bytes: int) -> list[str]:
  """Text files under `roots`, walked in sorted order (so always the same list):
  files ending in one of `suffixes` of MIN_FILE_BYTES..MAX_FILE_BYTES bytes,
  until their total reaches `max_bytes` (the file that reaches it is kept)."""
  if max_bytes < 1:
    raise ConfigError(f'max_bytes = {max_bytes} must be at least 1', where='max_bytes',
                      fix='give the number of bytes of text to collect, e.g. 4000000')
  paths, total = [], 0
  for root in roots:
    if not os.path.exists(root):
      raise ConfigError(f'text root {root!r} does not exist', where='text_roots',
                        fix='give an existing directory of text files')
    for path in _walk_sorted(root):
      if not path.endswith(tuple(suffixes)) or os.path.islink(path):
        continue  # a link would repeat a file already collected
      size = os.path.getsize(path)
      if MIN_FILE_BYTES <= size <= MAX_FILE_BYTES:
        paths.append(path)
        total += size
        if total >= max_bytes:
          return paths
  return paths


def _walk_sorted(root: str) -> Iterator[str]:
  if os.path.isfile(root):
    yield root
    return
  for directory, subdirectories, names in os.walk(root):
    subdirectories.sort()  # in place: os.walk descends in this order
    for name in sorted(names):
      yield os.path.join(directory, name)


def read_documents(paths: Iterable[str]) -> Iterator[str]:
  """One document per file, decoded as UTF-8 (bad bytes become U+FFFD);
  files holding only whitespace are skipped."""
  for path in paths:
    with open(path, 'rb') as f:
      text = f.read().decode('utf-8', errors='replace')
    if text.strip():
      yield text


def training_sentences(documents: Iterable[str], *, max_sentence_length: int,
                       max_sentences: int) -> Iterator[str]:
  """The documents' non-blank lines, at most `max_sentences` of them, without
  lines longer than `max_sentence_length` bytes (minified data, not text)."""
  count = 0
  for document in documents:
    for line in document.split('\n'):
      if not line.strip() or len(line.encode('utf-8')) > max_sentence_length:
        continue
      if count >= max_sentences:
        return
      count += 1
      yield line


def train_sentencepiece(*, documents: Iterable[str], model_prefix: str, vocab_size: int,
                        model_type: str = 'bpe', max_sentence_length: int = 4192,
                        max_sentences: int = 2_000_000, character_coverage: float = 0.9995,
                        num_threads: int = 2) -> str:
  """Trains a SentencePiece model on the lines of `documents`; returns the path
  of the model it writes, `model_prefix + '.model'`.

  BPE by default: on source code it trains ~25x faster than 'unigram'
  (0.5 s against 14 s for 4 MB, vocab 1024) and packs as many characters per
  token. The model is a function of the inputs and these arguments alone (no
  sampling; `num_threads` is fixed, not taken from the machine, as unigram's
  sums depend on it). Raises ConfigError when the text cannot support
  `vocab_size` pieces.
  """
  if model_type not in ('unigram', 'bpe'):
    raise ConfigError(f"model_type = {model_type!r} is not 'unigram' or 'bpe'",
                      where='model_type', fix="use 'unigram' or 'bpe'")
  model = io.BytesIO()
  try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=training_sentences(documents, max_sentence_length=max_sentence_length,
                                             max_sentences=max_sentences),
        model_writer=model, vocab_size=vocab_size, model_type=model_type,
        pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
        # Keep text as it is: code needs its newlines, indentation and exact characters.
        normalization_rule_name='identity', remove_extra_whitespaces=False,
        add_dummy_prefix=False,  # a line's first word looks the same in training and in a document
        allow_whitespace_only_pieces=True,  # indentation becomes a few pieces
        user_defined_symbols='\n',  # training sees lines, documents have newlines
        required_chars=_REQUIRED_CHARS, character_coverage=character_coverage,
        split_digits=True, max_sentence_length=max_sentence_length,
        shuffle_input_sentence=False, num_threads=num_threads, minloglevel=2)
  except RuntimeError as error:
    raise _vocab_error(error, vocab_size) from error
  path = model_prefix + '.model'
  write_atomically(path, model.getvalue())
  return path


def _vocab_error(error: RuntimeError, vocab_size: int) -> ConfigError:
  """SentencePiece's refusal, said in terms of the settings."""
  message = str(error).split('] ')[-1].strip()
  most = re.search(r'<= (\d+)', message)
  if most:
    return ConfigError(
        f'vocab_size = {vocab_size} is too large for this text: it supports at most '
        f'{most.group(1)} pieces', where='vocab_size',
        fix=f'set vocab_size to at most {most.group(1)}, or give more text (max_bytes)')
  return ConfigError(f'SentencePiece cannot train vocab_size = {vocab_size} on this text: '
                     f'{message}', where='vocab_size',
                     fix='change vocab_size or give more text (max_bytes)')


def write_token_records(*, documents: Iterable[str], model_path: str, output_pattern: str,
                        num_shards: int, add_eos: bool = True) -> dict:
  """Tokenizes each document with the SentencePiece model at `model_path` and
  writes it as one `tf.train.Example` (int64 feature `tokens`, then eos when
  `add_eos`), documents dealt round-robin over `num_shards` files named
  `output_pattern.format(shard=k, num_shards=num_shards)`
  (`corpus.write_documents`: no partial file under a final name). Documents
  with no tokens are skipped.

  Returns {'documents': n, 'tokens': ids written (eos included),
  'unknown_tokens': ids that are unk, 'files': the paths}.
  """
  processor = sentencepiece.SentencePieceProcessor(model_file=model_path)
  encoded = (ids + [EOS_ID] * add_eos for ids in map(processor.encode, documents) if ids)
  return write_id_records(encoded, output_pattern=output_pattern, num_shards=num_shards,
                          unk_id=UNK_ID)


def write_id_records(documents: Iterable[list[int]], *, output_pattern: str, num_shards: int,
                     unk_id: int | None) -> dict:
  """`write_token_records` for documents already tokenized (their ids, eos
  included); `unk_id` (None: none) is counted."""
  counts = {'documents': 0, 'tokens': 0, 'unknown_tokens': 0}

  def token_ids():
    for ids in documents:
      if unk_id is not None:
        counts['unknown_tokens'] += ids.count(unk_id)
      counts['documents'] += 1
      counts['tokens'] += len(ids)
      yield ids

  paths = write_documents(output_pattern, token_ids(), num_shards=num_shards)
  return {**counts, 'files': paths}


def prepare_corpus(*, output_dir: str, text_roots: Sequence[str] = (),
                   text_files: Sequence[str] = (), max_bytes: int = 4_000_000,
                   vocab_size: int | None = None, num_shards: int = 8,
                   eval_fraction: float = 0.05, spm_model: str | None = None,
                   model_type: str = 'bpe', tokenizer: str | None = None,
                   eos_token: str | None = None) -> dict:
  """Collects the text, splits it, trains (or copies) the tokenizer and writes
  the TFRecords and corpus.json into `output_dir` (see the module docstring).

  `text_files` are used whole; `text_roots` are walked by `collect_text_files`
  up to `max_bytes`. With `spm_model`, that model is copied to
  output_dir/spm.model instead of training one (`vocab_size`, if given, must
  match it). With `tokenizer` (a Hugging Face or run directory) its
  tokenizer.json tokenizes, `eos_token` (default: the one its files name)
  ending each document. Returns the summary written to corpus.json.
  """
  if num_shards < 1:
    raise ConfigError(f'num_shards = {num_shards} must be at least 1', where='num_shards',
                      fix='give the number of files to write per split, e.g. 8')
  if not 0 <= eval_fraction <= 0.5:
    raise ConfigError(f'eval_fraction = {eval_fraction} is not between 0 and 0.5',
                      where='eval_fraction', fix='hold out a small part, e.g. 0.05')
  hf = None
  if tokenizer is not None:
    if spm_model is not None:
      raise ConfigError('both tokenizer and spm_model are given', where='tokenizer / spm_model',
                        fix='give one: the tokenizer to make the corpus with')
    hf = HuggingFaceCorpusTokenizer.find(tokenizer, eos_token=eos_token)
    if vocab_size is not None and vocab_size != hf.vocab_size:
      raise ConfigError(f'{hf.path} has {hf.vocab_size} ids, but vocab_size = {vocab_size}',
                        where='vocab_size', fix=f'set vocab_size to {hf.vocab_size} or leave '
                        'it out')
  elif spm_model is None and vocab_size is None:
    raise ConfigError('vocab_size is needed to train a SentencePiece model', where='vocab_size',
                      fix='give vocab_size (e.g. 1024) or an existing spm_model')
  for path in text_files:
    if not os.path.isfile(path):
      raise ConfigError(f'text file {path!r} does not exist', where='text_files',
                        fix='give the paths of readable text files')
  if spm_model is not None:
    _check_spm_model(spm_model, vocab_size=vocab_size)

  versions.check_output_dir(output_dir)
  paths = list(text_files)
  if text_roots:
    paths += collect_text_files(roots=text_roots, max_bytes=max_bytes)
  documents = list(read_documents(paths))
  if not documents:
    raise ConfigError(
        f'no text found: {len(paths)} files, none with text (roots {list(text_roots)}, '
        f'suffixes {DEFAULT_SUFFIXES}, {MIN_FILE_BYTES}..{MAX_FILE_BYTES} bytes each; '
        f'text files {list(text_files)})', where='text_roots',
        fix='give a directory holding such files, or text_files')
  splits = split_documents(documents, eval_fraction=eval_fraction)
  logging.info('%d files, %d documents: %d train, %d eval', len(paths), len(documents),
               len(splits['train']), len(splits['eval']))

  version = versions.start_version(output_dir)
  try:
    summary = _write_corpus(version, splits=splits, paths=paths, text_roots=text_roots,
                            text_files=text_files, vocab_size=vocab_size, num_shards=num_shards,
                            spm_model=spm_model, model_type=model_type,
                            document_count=len(documents), hf=hf)
  except BaseException:  # also a stop signal: the old corpus stays as it was
    shutil.rmtree(version, ignore_errors=True)
    raise
  versions.publish(output_dir, version)
  return summary


def _write_corpus(directory: str, *, splits: dict[str, list[str]], paths: list[str],
                  text_roots: Sequence[str], text_files: Sequence[str],
                  vocab_size: int | None, num_shards: int, spm_model: str | None,
                  model_type: str, document_count: int,
                  hf: HuggingFaceCorpusTokenizer | None = None) -> dict:
  """The tokenizer, the records and corpus.json, written into `directory`."""
  model_path = os.path.join(directory, SPM_MODEL_NAME)
  if hf is not None:
    with open(hf.path, 'rb') as f:
      write_atomically(os.path.join(directory, HF_TOKENIZER_FILE), f.read())
  elif spm_model is None:
    logging.info('Training a %d-piece SentencePiece model on the train documents', vocab_size)
    train_sentencepiece(documents=splits['train'], model_prefix=model_path[:-len('.model')],
                        vocab_size=vocab_size, model_type=model_type)
  else:
    with open(spm_model, 'rb') as f:
      write_atomically(model_path, f.read())
  if hf is not None:
    record = hf.record(HF_TOKENIZER_FILE)
    ids = {'pad_id': None, 'eos_id': hf.eos_id, 'unk_id': hf.unk_id}  # rows pad with 0, masked
  else:
    record = {'kind': SENTENCEPIECE, 'file': SPM_MODEL_NAME, 'source': spm_model,
              'sha256': file_sha256(model_path), 'eos_id': EOS_ID, 'vocab_size':
              sentencepiece.SentencePieceProcessor(model_file=model_path).vocab_size()}
    ids = {'pad_id': PAD_ID, 'eos_id': EOS_ID, 'unk_id': UNK_ID}

  summary = {
      'spm_model': None if hf else SPM_MODEL_NAME,
      'tokenizer': record,
      'vocab_size': record['vocab_size'],
      **ids,
      'feature': TOKENS_FEATURE,
      'sources': {'files': len(paths), 'bytes': sum(os.path.getsize(p) for p in paths),
                  'documents': document_count, 'text_roots': list(text_roots),
                  'text_files': list(text_files), 'spm_model': spm_model,
                  'tokenizer': hf and os.path.dirname(hf.path),
                  'paths': paths},  # what the corpus was made of, in document order
  }
  escaped_dir = directory.replace('{', '{{').replace('}', '}}')
  for split in SPLITS:
    # An empty file would leave the streams dealt to it nothing to read.
    shards = min(num_shards, len(splits[split]))
    if shards < num_shards:
      logging.info('%s: %d document(s), fewer than num_shards = %d: %d file(s), one per '
                   'document', split, len(splits[split]), num_shards, shards)
    counts = {'documents': 0, 'tokens': 0, 'unknown_tokens': 0, 'files': []}
    if shards:
      pattern = os.path.join(escaped_dir, RECORD_PATTERN.format(split=split))
      if hf is not None:
        counts = write_id_records(hf.encode_documents(splits[split]), output_pattern=pattern,
                                  num_shards=shards, unk_id=hf.unk_id)
      else:
        counts = write_token_records(documents=splits[split], model_path=model_path,
                                     output_pattern=pattern, num_shards=shards)
    logging.info('%s: %d documents, %d tokens in %d files', split, counts['documents'],
                 counts['tokens'], shards)
    counts['files'] = [os.path.basename(path) for path in counts['files']]
    summary[split] = counts
  write_atomically(os.path.join(directory, SUMMARY_NAME),
                    (json.dumps(summary, indent=2) + '\n').encode('utf-8'))
  return summary


def split_documents(documents: Sequence[str], *, eval_fraction: float) -> dict[str, list[str]]:
  """Every k-th document (index % k == 0, k = round(1 / eval_fraction)) to
  eval, the rest to train; no eval with eval_fraction 0."""
  if eval_fraction == 0:
    return {'train': list(documents), 'eval': []}
  every = round(1 / eval_fraction)
  splits = {'train': [d for i, d in enumerate(documents) if i % every],
            'eval': documents[::every]}
  if not splits['train']:
    raise ConfigError(
        f'{len(documents)} document(s) leave none for training after holding out every '
        f'{every}th for eval (eval_fraction = {eval_fraction})', where='eval_fraction',
        fix='give more text, or set eval_fraction to 0')
  return splits


def _check_spm_model(spm_model: str, *, vocab_size: int | None) -> None:
  """An existing model must use the records' special ids (and `vocab_size`, if given)."""
  if not os.path.isfile(spm_model):
    raise ConfigError(f'spm_model {spm_model!r} does not exist', where='spm_model',
                      fix='give the path of a SentencePiece .model file, or leave it out to '
                      'train one')
  try:
    processor = sentencepiece.SentencePieceProcessor(model_file=spm_model)
  except (OSError, RuntimeError) as error:
    raise ConfigError(f'spm_model {spm_model!r} is not a SentencePiece model ({error})',
                      where='spm_model', fix='give a .model file written by SentencePiece'
                      ) from error
  ids = {'pad': processor.pad_id(), 'eos': processor.eos_id(), 'unk': processor.unk_id()}
  if ids != {'pad': PAD_ID, 'eos': EOS_ID, 'unk': UNK_ID}:
    raise ConfigError(f'spm_model {spm_model!r} has special ids {ids}, but the records use '
                      f'pad {PAD_ID}, eos {EOS_ID}, unk {UNK_ID}', where='spm_model',
                      fix='train the model with pad_id=0, eos_id=1, unk_id=2, or leave '
                      'spm_model out to train one')
  if vocab_size is not None and processor.vocab_size() != vocab_size:
    raise ConfigError(f'spm_model {spm_model!r} has {processor.vocab_size()} pieces, but '
                      f'vocab_size = {vocab_size}', where='vocab_size',
                      fix=f'set vocab_size to {processor.vocab_size()} or leave it out')
