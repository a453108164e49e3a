"""Tokenizers: text to token ids and back, one interface for every kind.

    tokenizer = HuggingFaceTokenizer('runs/llama/tokenizer/tokenizer.json')
    ids = tokenizer.encode('def main():')    # [..] ids
    tokenizer.decode(ids)                    # 'def main():'

SentencePiece models (`launch.prepare_data`'s corpora, Llama 2's
`tokenizer.model`), Hugging Face `tokenizer.json` files, UTF-8 bytes, and
the Markov task's plain ids. Which one a run uses is decided in
`layout_core.infer.tokens` (`tokenizer_for`); tasks that tokenize text
themselves (`layout_core.tasks.instruct`) build them here. Importing this
module does not import TensorFlow.
"""

from __future__ import annotations

from typing import Sequence

from layout_core.errors import ConfigError

RUN_TOKENIZER_DIR = 'tokenizer'  # <model_dir>/tokenizer/: the model's own tokenizer files


class Tokenizer:
  """Text <-> ids: `encode`, `decode`, and `vocab_size` (None: any ids).

  `of_model`: the tokenizer came with the model (an imported run's), not
  with its training data, so its vocabulary need only fit the model's."""
  vocab_size: int | None = None
  has_text = True
  of_model = False

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def encode_piece(self, text: str) -> list[int]:
    """The ids of `text` as one piece of a longer text: what `encode` gives,
    without the special tokens a tokenizer adds around a whole text (a
    chat's pieces, tokenized one by one: `layout_core.tasks.instruct`)."""
    return self.encode(text)

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError

  def describe(self) -> str:
    raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file (an `lm_corpus` run's `spm.model`)."""

  def __init__(self, model_file: str, *, of_model: bool = False):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self.model_file, self.of_model = model_file, of_model
    try:
      self._processor = sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as e:
      raise ConfigError(f'{model_file} is not a SentencePiece model ({e})',
                        where='the tokenizer (--spm_model)',
                        fix='give the spm.model that launch.prepare_data wrote') from None
    self.vocab_size = self._processor.vocab_size()

  def encode(self, text: str) -> list[int]:
    return list(self._processor.encode(text))

  def decode(self, ids: Sequence[int]) -> str:
    # Ids past the tokenizer's vocabulary (a model with a larger one) have no text.
    return self._processor.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

  def describe(self) -> str:
    return f'SentencePiece {self.model_file} ({self.vocab_size} pieces)'


class HuggingFaceTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` (the `tokenizers` library), as
  `AutoTokenizer` uses it: `encode` adds the special tokens its
  post-processor adds (Llama 3's <|begin_of_text|>), `decode` shows them."""
  of_model = True

  def __init__(self, path: str):
    from tokenizers import Tokenizer as Loaded  # pylint: disable=g-import-not-at-top
    self.path = path
    try:
      self._tokenizer = Loaded.from_file(path)
    except Exception as e:  # pylint: disable=broad-except  # tokenizers raises its own types
      raise ConfigError(f'{path} is not a Hugging Face tokenizer ({e})',
                        where='the run\'s tokenizer/ directory',
                        fix='copy the model\'s tokenizer.json there again (launch.import_hf '
                            'copies it from --hf_dir)') from None
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return list(self._tokenizer.encode(text).ids)

  def encode_piece(self, text: str) -> list[int]:
    return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids if 0 <= i < self.vocab_size],
                                  skip_special_tokens=False)

  def describe(self) -> str:
    return f'Hugging Face {self.path} ({self.vocab_size} tokens)'


class ByteTokenizer(Tokenizer):
  """Bytes as tokens (a `data.text_file` run): UTF-8 in, UTF-8 out (invalid
  sequences shown as U+FFFD)."""
  vocab_size = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= i < 256).decode('utf-8', errors='replace')

  def describe(self) -> str:
    return 'UTF-8 bytes'


class IdTokenizer(Tokenizer):
  """No text: ids are shown as numbers; encoding text is a ConfigError saying `why`."""
  has_text = False

  def __init__(self, why: str, *, fix: str):
    self.why, self.fix = why, fix

  def encode(self, text: str) -> list[int]:
    raise ConfigError(f'the prompt {text!r} is text, but {self.why}', where='--prompt',
                      fix=self.fix)

  def decode(self, ids: Sequence[int]) -> str:
    return ' '.join(str(int(i)) for i in ids)

  def describe(self) -> str:
    return f'token ids ({self.why})'
