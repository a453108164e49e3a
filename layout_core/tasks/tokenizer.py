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

A rendered chat (`layout_core.tasks.chat`) is tokenized with
`encode_rendered`, as `transformers`' `apply_chat_template` tokenizes it:
the text of a special token (`<|eot_id|>`, `</s>`) becomes that token's id,
the text between special tokens is tokenized on its own, and nothing is
added around the whole (no BOS: the template writes its own):

    ids, spans = tokenizer.encode_rendered('<s>[INST] hi [/INST]')
    # ids [1, ...]; spans: each token's (start, end) characters in the text
    tokenizer.token_id('</s>')    # 2: the id of a special token's text, else None

A model's SentencePiece `tokenizer.model` without a `tokenizer.json` is read
as `transformers` converts it (Llama's `LlamaTokenizer`): no normalization
beyond spaces written as `▁`, a `▁` put before the text only at the very
start of a text, and `encode` adds BOS when `tokenizer_config.json`'s
`add_bos_token` says so (its default: yes).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

from layout_core.errors import ConfigError

RUN_TOKENIZER_DIR = 'tokenizer'  # <model_dir>/tokenizer/: the model's own tokenizer files
CONFIG_FILE = 'tokenizer_config.json'
# The special tokens tokenizer_config.json may name, each passed to a chat template.
SPECIAL_NAMES = ('bos_token', 'eos_token', 'unk_token', 'sep_token', 'pad_token', 'cls_token',
                 'mask_token')
Spans = list[tuple[int, int]]  # each token's (start, end) characters in the text


def special_text(value: Any) -> str:
  """A special token of tokenizer_config.json: a string or {'content': ...}."""
  if isinstance(value, dict):
    return str(value.get('content') or '')
  return str(value or '')


def read_config(directory: str | None) -> dict[str, Any]:
  """`directory/tokenizer_config.json` as a dict ({} without one)."""
  path = os.path.join(directory, CONFIG_FILE) if directory else None
  if not path or not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except ValueError as e:
    raise ConfigError(f'{path} is not JSON ({e})', where=path,
                      fix='restore the tokenizer\'s tokenizer_config.json') from None
  if not isinstance(config, dict):
    raise ConfigError(f'{path} holds a {type(config).__name__}, not an object', where=path,
                      fix='restore the tokenizer\'s tokenizer_config.json')
  return config


# Where a tokenizer directory keeps its chat template, in the order
# `transformers` takes them: chat_template.jinja (what transformers 5's
# save_pretrained writes) over tokenizer_config.json's `chat_template`; a
# processor's legacy chat_template.json last (AutoProcessor reads it,
# AutoTokenizer does not).
CHAT_TEMPLATE_JINJA = 'chat_template.jinja'
CHAT_TEMPLATE_JSON = 'chat_template.json'


def read_chat_template(directory: str | None, config: dict[str, Any] | None = None
                       ) -> tuple[Any, str] | None:
  """(the chat template, the file it was read from) of a tokenizer
  directory, or None without one: chat_template.jinja, else the
  `chat_template` of tokenizer_config.json (`config`, when already read: a
  string, or a list of named templates), else chat_template.json's."""
  if not directory:
    return None
  jinja_path = os.path.join(directory, CHAT_TEMPLATE_JINJA)
  if os.path.isfile(jinja_path):
    with open(jinja_path, encoding='utf-8') as f:
      source = f.read()
    if source:
      return source, jinja_path
  config = read_config(directory) if config is None else config
  if config.get('chat_template'):
    return config['chat_template'], os.path.join(directory, CONFIG_FILE)
  json_path = os.path.join(directory, CHAT_TEMPLATE_JSON)
  if os.path.isfile(json_path):
    try:
      with open(json_path, encoding='utf-8') as f:
        held = json.load(f)
    except ValueError as e:
      raise ConfigError(f'{json_path} is not JSON ({e})', where=json_path,
                        fix='restore the tokenizer\'s chat_template.json') from None
    if isinstance(held, dict) and held.get('chat_template'):
      return held['chat_template'], json_path
  return None


def config_specials(config: dict[str, Any]) -> dict[str, int | None]:
  """text -> id (None where it does not say) of every special or added token
  tokenizer_config.json names."""
  found: dict[str, int | None] = {}
  names = [config.get(name) for name in SPECIAL_NAMES]
  for value in names + list(config.get('additional_special_tokens') or []):
    if special_text(value):
      found.setdefault(special_text(value), None)
  decoder = config.get('added_tokens_decoder') or {}
  for key, value in (decoder.items() if isinstance(decoder, dict) else ()):
    if special_text(value) and str(key).isdigit():
      found[special_text(value)] = int(key)
  return found


class Tokenizer:
  """Text <-> ids: `encode`, `decode`, and `vocab_size` (None: any ids).

  `of_model`: the tokenizer came with the model (an imported run's), not
  with its training data, so its vocabulary need only fit the model's."""
  vocab_size: int | None = None
  has_text = True
  of_model = False

  def encode(self, text: str) -> list[int]:
    raise NotImplementedError

  def encode_rendered(self, text: str) -> tuple[list[int], Spans]:
    """(ids, each id's character span) of `text` as a rendered chat is
    tokenized (module doc): special tokens' text as their ids, nothing added."""
    raise NotImplementedError

  def token_id(self, text: str) -> int | None:
    """The id of the special (or added) token whose text is `text`, else None."""
    del text
    return None

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError

  def describe(self) -> str:
    raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file: a corpus's `spm.model` (its `encode` is the
  model's own, as `launch.prepare_data` tokenized the corpus), or a model's
  `tokenizer.model` (`of_model`: read as `transformers` reads it, module
  doc, with the `tokenizer_config.json` beside it)."""

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
    config = read_config(os.path.dirname(model_file)) if of_model else {}
    # transformers' LlamaTokenizer adds BOS unless the config says not to.
    self.add_bos = bool(config.get('add_bos_token', True)) if config else False
    self.prefix_space = bool(config.get('add_prefix_space', True))
    # `legacy: true`: Metaspace's 'always' scheme, a ▁ before every piece of
    # text between special tokens ('first' otherwise: the text's start only).
    self.prefix_every_piece = bool(config.get('legacy', False))
    processor = self._processor
    self._specials = {processor.id_to_piece(i): i for i in range(self.vocab_size)
                      if processor.is_control(i) or processor.is_unknown(i)}
    for text, index in config_specials(config).items():
      index = processor.piece_to_id(text) if index is None else index
      if index != processor.unk_id() or text in self._specials:
        self._specials[text] = index
    self._split = _splitter(self._specials)
    self._plain = _verbatim(sentencepiece, model_file)

  def encode(self, text: str) -> list[int]:
    if not self.of_model:
      return list(self._processor.encode(text))
    bos = [self._processor.bos_id()] if self.add_bos and self._processor.bos_id() >= 0 else []
    return bos + self.encode_rendered(text)[0]

  def encode_rendered(self, text: str) -> tuple[list[int], Spans]:
    ids: list[int] = []
    spans: Spans = []
    for start, end, special in self._split(text):
      if special is not None:
        ids.append(special)
        spans.append((start, end))
        continue
      piece = text[start:end]
      if self.of_model:  # as transformers converts it: verbatim, a ▁ added in front
        first_piece = start == 0 or self.prefix_every_piece
        added = int(first_piece and self.prefix_space and not piece.startswith(' '))
        encoder = self._plain
      else:  # a corpus's model: its own normalization, as `encode` (and the corpus)
        added, encoder = 0, self._processor
      written = ' ' * added + piece
      data, tokens = written.encode('utf-8'), list(encoder.encode(written, out_type='proto').pieces)
      chars = _char_of_byte(data)
      for index, token in enumerate(tokens):
        # A byte-fallback token is given its whole character (only the last
        # byte of one has a width in SentencePiece's offsets).
        end = next((t.end for t in tokens[index:] if t.end > token.begin), token.begin + 1)
        first, last = chars[token.begin], chars[min(end, len(data)) - 1] + 1
        ids.append(token.id)
        spans.append((start + max(first - added, 0), start + max(last - added, 0)))
    return ids, spans

  def token_id(self, text: str) -> int | None:
    return self._specials.get(text)

  def decode(self, ids: Sequence[int]) -> str:
    # Ids past the tokenizer's vocabulary (a model with a larger one) have no text.
    return self._processor.decode([int(i) for i in ids if 0 <= i < self.vocab_size])

  def describe(self) -> str:
    return f'SentencePiece {self.model_file} ({self.vocab_size} pieces)'


def _verbatim(sentencepiece, model_file: str):
  """The model with its text taken as it is: no normalization rule, no ▁
  added in front, runs of spaces kept (what `transformers`' conversion of a
  SentencePiece model does; the ▁ at a text's start is added by the caller)."""
  from sentencepiece import sentencepiece_model_pb2  # pylint: disable=g-import-not-at-top
  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_file, 'rb') as f:
    proto.ParseFromString(f.read())
  spec = proto.normalizer_spec
  spec.name, spec.precompiled_charsmap = 'identity', b''
  spec.add_dummy_prefix = spec.remove_extra_whitespaces = False
  return sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _char_of_byte(data: bytes) -> list[int]:
  """For each byte of UTF-8 `data`, the index of the character it belongs to."""
  out, char = [], -1
  for byte in data:
    if byte & 0xC0 != 0x80:  # not a continuation byte: a new character
      char += 1
    out.append(char)
  return out


def _splitter(specials: dict[str, int]):
  """text -> [(start, end, id of the special token there, or None for text
  between them)], the longest special token matched first."""
  pattern = re.compile('|'.join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
                       ) if specials else None

  def split(text: str) -> list[tuple[int, int, int | None]]:
    parts, position = [], 0
    for match in (pattern.finditer(text) if pattern else ()):
      if match.start() > position:
        parts.append((position, match.start(), None))
      parts.append((match.start(), match.end(), specials[match.group()]))
      position = match.end()
    if position < len(text):
      parts.append((position, len(text), None))
    return parts
  return split


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

  def encode_rendered(self, text: str) -> tuple[list[int], Spans]:
    encoding = self._tokenizer.encode(text, add_special_tokens=False)
    return list(encoding.ids), [tuple(span) for span in encoding.offsets]

  def token_id(self, text: str) -> int | None:
    for index, token in self._tokenizer.get_added_tokens_decoder().items():
      if token.content == text:
        return int(index)
    return None

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

  def encode_rendered(self, text: str) -> tuple[list[int], Spans]:
    data = text.encode('utf-8')
    return list(data), [(c, c + 1) for c in _char_of_byte(data)]

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
