"""Text to token ids and back, for the task a model was trained on.

    tokenizer = tokenizer_for(task)          # the run's task (plan.task)
    ids = tokenizer.encode('def main():')    # [..] ids
    tokenizer.decode(ids)                    # 'def main():'

An `lm_corpus` run's text goes through the tokenizer its corpus was
tokenized with, beside the corpus's train files and named in `corpus.json`
(`launch.prepare_data` writes both): `spm.model`, or the `tokenizer.json` of
a corpus made with `--tokenizer`; or the SentencePiece file given. A bytes
run (`data.text_file`) reads text as its UTF-8 bytes. The Markov task has no
text: its tokens are ids, shown as numbers, and encoding text is a
ConfigError that says to give ids.

A run that carries its model's own tokenizer (`<model_dir>/tokenizer/`, where
`launch.import_hf` copies a Hugging Face model's `tokenizer.json` or
SentencePiece `tokenizer.model`) uses it, whatever its task:

    tokenizer_for(task, run_dir='runs/llama')   # HuggingFaceTokenizer(runs/llama/tokenizer/...)

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import glob
import json
import os

from layout_core.errors import ConfigError
from layout_core.tasks.tokenizer import (  # noqa: F401  (this module's names too)
    RUN_TOKENIZER_DIR, ByteTokenizer, HuggingFaceTokenizer, IdTokenizer,
    SentencePieceTokenizer, Tokenizer)


def tokenizer_for(task, *, spm_model: str | None = None,
                  run_dir: str | None = None) -> Tokenizer:
  """The tokenizer of `task` (module doc); `spm_model` names a SentencePiece
  model file instead of the one found beside an `lm_corpus` run's files;
  `run_dir`: the run's directory, whose own tokenizer (`run_tokenizer`)
  comes before the task's."""
  from layout_core.tasks.corpus import LMCorpusTask  # pylint: disable=g-import-not-at-top
  from layout_core.tasks.lm import TextFileTask  # pylint: disable=g-import-not-at-top
  if spm_model:
    if not os.path.isfile(spm_model):
      raise ConfigError(f'--spm_model {spm_model!r} does not exist', where='--spm_model',
                        fix='give the spm.model file of the run\'s corpus')
    return SentencePieceTokenizer(spm_model)
  own = run_tokenizer(run_dir) if run_dir else None
  if own is not None:
    return own
  if isinstance(getattr(task, 'tokenizer', None), Tokenizer):  # it tokenizes text itself
    return task.tokenizer
  if isinstance(task, LMCorpusTask):
    hf = corpus_tokenizer_json(task.patterns['train'])
    if hf is not None:
      return HuggingFaceTokenizer(hf)
    found = corpus_spm_model(task.patterns['train'])
    if found is None:
      return IdTokenizer(
          f'no SentencePiece model was found beside the corpus '
          f'({os.path.dirname(task.patterns["train"]) or "."}/spm.model)',
          fix='give the corpus\'s tokenizer with --spm_model, or the prompt as ids '
              '(--prompt_ids)')
    return SentencePieceTokenizer(found)
  if isinstance(task, TextFileTask):
    return ByteTokenizer()
  return IdTokenizer(f'the run\'s task ({task.describe()}) has no text, only token ids',
                     fix='give the prompt as ids: --prompt_ids=3,1,4')


def run_tokenizer(run_dir: str) -> Tokenizer | None:
  """The tokenizer a run carries in `run_dir/tokenizer/`: `tokenizer.json`
  (Hugging Face), else a SentencePiece `tokenizer.model`; None without one."""
  directory = os.path.join(run_dir, RUN_TOKENIZER_DIR)
  if os.path.isfile(os.path.join(directory, 'tokenizer.json')):
    return HuggingFaceTokenizer(os.path.join(directory, 'tokenizer.json'))
  if os.path.isfile(os.path.join(directory, 'tokenizer.model')):
    return SentencePieceTokenizer(os.path.join(directory, 'tokenizer.model'), of_model=True)
  return None


def corpus_spm_model(train_files: str) -> str | None:
  """The SentencePiece model of the corpus whose train files match
  `train_files`: the `spm_model` corpus.json names, else `spm.model`, in the
  files' directory; None when there is none."""
  directory = os.path.dirname(train_files) or '.'
  if glob.has_magic(directory):
    return None
  name = 'spm.model'
  try:
    with open(os.path.join(directory, 'corpus.json')) as f:
      name = json.load(f).get('spm_model') or name
  except (OSError, ValueError, AttributeError):
    pass
  path = os.path.join(directory, name)
  return path if os.path.isfile(path) else None


def corpus_tokenizer_json(train_files: str) -> str | None:
  """The `tokenizer.json` a corpus was made with (`launch.prepare_data
  --tokenizer`, its corpus.json says so), beside the files matching
  `train_files`; None for any other corpus."""
  from layout_core.tasks import corpus_tokenizer  # pylint: disable=g-import-not-at-top
  if glob.has_magic(os.path.dirname(train_files)):
    return None
  found = corpus_tokenizer.corpus_record(train_files)
  if found is None or found[1].get('kind') != corpus_tokenizer.HUGGING_FACE:
    return None
  path = os.path.join(found[0], found[1]['file'])
  return path if os.path.isfile(path) else None


def check_vocabulary(tokenizer: Tokenizer, *, model_vocab: int, task_vocab: int | None) -> None:
  """ConfigError when `tokenizer` is not the one the model was trained with:
  it has ids the model has no row for, or another vocabulary than the task's."""
  size = tokenizer.vocab_size
  if size is None:
    return
  if tokenizer.of_model:  # the model's own: its ids need rows, not the task's vocabulary
    task_vocab = None
  if size > model_vocab or (task_vocab is not None and size != task_vocab):
    trained = f', and the run\'s data {task_vocab}' if task_vocab is not None else ''
    raise ConfigError(f'the tokenizer ({tokenizer.describe()}) has {size} ids, but the model '
                      f'has {model_vocab}{trained}: it is not the model\'s tokenizer',
                      where='the tokenizer (--spm_model, or the corpus\'s spm.model)',
                      fix='give the SentencePiece model of the corpus the run trained on')
