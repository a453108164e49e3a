"""Instruction and chat fine-tuning: the loss on the responses only.

    task = InstructionTask(train_files='/data/sft/train-*.jsonl',
                           eval_files='/data/sft/eval-*.jsonl',
                           tokenizer='runs/llama', vocab_size=32000, seq_len=512)
    batch = task.features(split='train', step=0, batch_size=8)
    # {'tokens', 'segments', 'positions', 'loss_mask'}: each [8, 513]

Each line of the JSON-lines files is one example, either

    {"prompt": "Add 2 and 3.", "response": "5"}
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Add 2 and 3."},
                  {"role": "assistant", "content": "5"}]}

(a prompt/response pair is the conversation [user: prompt, assistant:
response]). Every line of a split is read and checked when the run's plan
checks that split (`check_data`: training both, `launch.eval` the eval split,
decode and export none, so a tuned run decodes without its data): a line
that is not such an object (bad JSON, a missing key, a role other than
system, user or assistant, an empty line, no assistant turn) is a
ConfigError naming the file and line.

The text of a conversation comes from a chat template:

  * the tokenizer directory's `tokenizer_config.json` has a `chat_template`
    (Jinja, as Hugging Face models ship it): it is rendered with `messages`,
    `add_generation_prompt`, `bos_token` and `eos_token`;
  * else the default template, each turn as

        <|system|>\\n{content}<|end|>\\n      (and <|user|> alike)
        <|assistant|>\\n{content}<|end|>\\n

    whose markers are plain text to the tokenizer.

Only the assistant's tokens are trained: `loss_mask` is 1 on the tokens of
each assistant turn's content and the end of its turn (`{content}<|end|>`
above, or what the Jinja template renders after the generation prompt), 0 on
everything else. The boundary is exact because the text is tokenized in
pieces, each piece on its own (no special tokens added between them), and
the ids concatenated: with a Jinja template, for each assistant turn i the
conversation is rendered up to it with the generation prompt (the prefix the
model answers from at inference) and up to and including it; the turn's
trained text is the difference. A template whose renders are not prefixes of
one another (it rewrites earlier turns) is a ConfigError. Tokenizing in
pieces gives, at the boundary, the ids a model sees when it is prompted with
the generation prompt and answers.

Examples are packed as `lm_corpus` packs documents
(`layout_core.tasks.corpus.Packer`): whole examples per row of seq_len + 1
tokens while they fit, `segments` numbered from 1 (0: padding), `positions`
from 0 in each; `pack=False` gives each example a row. An example longer than
a row is cut to its first seq_len + 1 tokens (`too_long='cut'`) or left out
('drop'); each stream logs how many at the end of each epoch, and
`example_counts(reader)` gives them. The loss is the mean cross entropy over
targets in the same example as their input whose token is a response token;
`tokens_trained` counts those targets.

Reading is streamed and resumable as `lm_corpus` is (`layout_core.tasks.
reading`): the files are dealt to streams, read a window of lines at a time
with tf.data and shuffled within it, and the position saved with each
checkpoint continues exactly. The tokenizer is a run directory (its
`tokenizer/`), a directory holding `tokenizer.json` or a SentencePiece
`tokenizer.model` (or such a file), or 'bytes' (UTF-8 bytes, vocabulary 256).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.fields import at_least
from layout_core.tasks import tokenizer as tokens_lib
from layout_core.lazy import tf
from layout_core.tasks import streams
from layout_core.tasks.instruct_files import (Messages, check_example_files, count_lines,
                                             numbered_lines, parse_example)
from layout_core.tasks.base import SPLITS
from layout_core.tasks.corpus import LMCorpusTask, Packer, next_token_loss, target_mask

TOO_LONG = ('cut', 'drop')
END = '<|end|>'  # the default template's end of a turn
RECORD = 'record'  # a stream's record: 'path\nline number\nline text'


# -- chat templates --------------------------------------------------------------
Piece = tuple[str, bool]  # (text, trained)


class DefaultTemplate:
  """The default chat template (module doc), as pieces of text."""

  def describe(self) -> str:
    return 'default template'

  def pieces(self, messages: Messages, *, where: str) -> list[Piece]:
    del where  # this template renders every conversation
    out: list[Piece] = []
    for message in messages:
      if message['role'] == 'assistant':
        out += [('<|assistant|>\n', False), (message['content'] + END, True), ('\n', False)]
      else:
        out.append((f'<|{message["role"]}|>\n{message["content"]}{END}\n', False))
    return out


def _special(value: Any) -> str:
  """A special token of tokenizer_config.json: a string or {'content': ...}."""
  if isinstance(value, dict):
    return str(value.get('content') or '')
  return str(value or '')


class JinjaTemplate:
  """A tokenizer_config.json's `chat_template`, rendered as Hugging Face
  renders it; `pieces` splits its text at each assistant turn (module doc)."""

  def __init__(self, config_path: str, config: Mapping[str, Any]):
    import jinja2  # pylint: disable=g-import-not-at-top
    from jinja2 import sandbox  # pylint: disable=g-import-not-at-top
    self.config_path = config_path
    source = config['chat_template']
    if isinstance(source, list):  # [{'name': 'default', 'template': ...}, ...]
      named = {entry.get('name'): entry.get('template') for entry in source
               if isinstance(entry, dict)}
      source = named.get('default')
    if not isinstance(source, str):
      raise ConfigError(f'the chat_template of {config_path} is not a template string',
                        where=config_path, fix='give a Jinja template string, or remove it '
                                               'to use the default template')

    def raise_exception(message):
      raise jinja2.TemplateError(message)

    environment = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals['raise_exception'] = raise_exception
    self._errors = (jinja2.TemplateError,)
    try:
      self.template = environment.from_string(source)
    except jinja2.TemplateError as e:
      raise ConfigError(f'the chat_template of {config_path} is not valid Jinja ({e})',
                        where=config_path, fix='correct the template') from None
    self.context = {'bos_token': _special(config.get('bos_token')),
                    'eos_token': _special(config.get('eos_token'))}

  def describe(self) -> str:
    return f'chat_template of {self.config_path}'

  def render(self, messages: Messages, *, generation_prompt: bool, where: str) -> str:
    try:
      return self.template.render(messages=messages, add_generation_prompt=generation_prompt,
                                  **self.context)
    except self._errors as e:
      raise ConfigError(f'the chat_template of {self.config_path} fails on the example at '
                        f'{where} ({e})', where=where,
                        fix='correct the example or the template') from None

  def pieces(self, messages: Messages, *, where: str) -> list[Piece]:
    out: list[Piece] = []
    done = ''  # the text the pieces so far spell

    def extend(text: str, trained: bool, rendered: str) -> str:
      if not text.startswith(done):
        raise ConfigError(
            f'the chat_template of {self.config_path} renders the example at {where} '
            f'differently up to {rendered} than before it (it rewrites earlier turns), so '
            'the assistant tokens cannot be told apart', where=self.config_path,
            fix='use a template whose renders of a conversation\'s first turns are '
                'prefixes of the whole, or remove chat_template to use the default')
      out.append((text[len(done):], trained))
      return text

    for i, message in enumerate(messages):
      if message['role'] == 'assistant':
        done = extend(self.render(messages[:i], generation_prompt=True, where=where), False,
                      f'the generation prompt of message {i}')
        done = extend(self.render(messages[:i + 1], generation_prompt=False, where=where),
                      True, f'message {i}')
    extend(self.render(messages, generation_prompt=False, where=where), False, 'the end')
    return out


def find_tokenizer(tokenizer: str) -> tuple[tokens_lib.Tokenizer, str | None]:
  """(the tokenizer, its directory) for the task's `tokenizer` setting
  (module doc); the directory is None for 'bytes'."""
  if tokenizer == 'bytes':
    return tokens_lib.ByteTokenizer(), None
  if os.path.isfile(tokenizer):
    directory = os.path.dirname(tokenizer) or '.'
    if tokenizer.endswith('.json'):
      return tokens_lib.HuggingFaceTokenizer(tokenizer), directory
    return tokens_lib.SentencePieceTokenizer(tokenizer, of_model=True), directory
  for directory in (tokenizer, os.path.join(tokenizer, tokens_lib.RUN_TOKENIZER_DIR)):
    if os.path.isfile(os.path.join(directory, 'tokenizer.json')):
      return tokens_lib.HuggingFaceTokenizer(os.path.join(directory, 'tokenizer.json')), directory
    if os.path.isfile(os.path.join(directory, 'tokenizer.model')):
      return (tokens_lib.SentencePieceTokenizer(os.path.join(directory, 'tokenizer.model'),
                                                of_model=True), directory)
  raise ConfigError(f'instruct.tokenizer {tokenizer!r} holds no tokenizer.json or '
                    'tokenizer.model (nor does its tokenizer/ directory)',
                    where='instruct.tokenizer',
                    fix="give a run directory, a directory with tokenizer.json or "
                        "tokenizer.model, such a file, or 'bytes'")


def find_template(directory: str | None) -> DefaultTemplate | JinjaTemplate:
  """The chat_template of `directory/tokenizer_config.json`, else the default."""
  path = os.path.join(directory, 'tokenizer_config.json') if directory else None
  if not path or not os.path.isfile(path):
    return DefaultTemplate()
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except ValueError as e:
    raise ConfigError(f'{path} is not JSON ({e})', where=path,
                      fix='restore the tokenizer\'s tokenizer_config.json') from None
  if not isinstance(config, dict) or not config.get('chat_template'):
    return DefaultTemplate()
  return JinjaTemplate(path, config)


def chat_prompt(text: str, *, template: DefaultTemplate | JinjaTemplate,
                tokenizer: tokens_lib.Tokenizer) -> list[int]:
  """The ids a model tuned with `template` answers `text` from: `text` as a
  user turn, up to where the assistant's answer starts (its generation
  prompt), tokenized as training tokenized it."""
  pieces = template.pieces([{'role': 'user', 'content': text},
                            {'role': 'assistant', 'content': ''}], where='the prompt')
  last = max(i for i, (_, trained) in enumerate(pieces) if trained)
  return [int(i) for i in tokenize(pieces[:last], tokenizer)[0]]


def tokenize(pieces: Sequence[Piece], tokenizer: tokens_lib.Tokenizer
             ) -> tuple[np.ndarray, np.ndarray]:
  """(token ids, loss mask) of the pieces, each tokenized on its own."""
  ids: list[int] = []
  mask: list[int] = []
  for text, trained in pieces:
    piece = tokenizer.encode_piece(text) if text else []
    ids += piece
    mask += [int(trained)] * len(piece)
  return np.asarray(ids, np.int64), np.asarray(mask, np.int32)


# -- packing -----------------------------------------------------------------------
class ExamplePacker(Packer):
  """Packs tokenized examples with their `loss_mask` (module doc)."""

  extra_features = ('loss_mask',)

  def __init__(self, stream, *, length, pack, vocab_size, used, too_long, tokenizer,
               template):
    self.tokenizer, self.template, self.examples = tokenizer, template, 0
    self.longest = 0  # tokens of the longest example read
    self._epoch = stream.position[0]
    super().__init__(stream, length=length, pack=pack, vocab_size=vocab_size, used=used,
                     too_long=too_long)

  def read_document(self) -> dict[str, np.ndarray]:
    record = self.stream.take(1)[RECORD][0]
    path, line, text = record.decode('utf-8').split('\n', 2)
    where = f'{path}:{line}'
    if self.stream.position[0] != self._epoch:
      self.log_counts()
      self._epoch = self.stream.position[0]
    messages = parse_example(text, path=path, line=int(line))
    ids, mask = tokenize(self.template.pieces(messages, where=where), self.tokenizer)
    if not mask.any():
      raise ConfigError(f'the example at {where} has no assistant tokens once formatted '
                        f'({self.template.describe()})', where=where,
                        fix='give the assistant turns some content')
    if ids.max() >= self.vocab_size:
      raise ConfigError(f'the example at {where} has token id {int(ids.max())}, outside the '
                        f'vocabulary 0..{self.vocab_size - 1} ({self.tokenizer.describe()})',
                        where='instruct.vocab_size',
                        fix=f'set instruct.vocab_size to the model\'s vocabulary (at least '
                            f'{self.tokenizer.vocab_size or int(ids.max()) + 1})')
    self.examples += 1
    self.longest = max(self.longest, len(ids))
    return {'tokens': ids.astype(np.int32), 'loss_mask': mask}

  def log_counts(self) -> None:
    logging.info('instruct: stream %d, epoch %d: %d example(s) read since the reader '
                 'opened, %d longer than a row (%d tokens) cut, %d dropped',
                 self.stream.stream_id, self._epoch, self.examples, self.length, self.cut,
                 self.dropped)


def example_counts(reader: streams.StreamReader) -> dict[str, int]:
  """{'examples', 'cut', 'dropped'}: summed over `reader`'s streams, since it
  opened (an example may be counted as read while it waits for the next row)."""
  return {name: sum(getattr(s, name) for s in reader.sources.values())
          for name in ('examples', 'cut', 'dropped')}


def _parse(serialized):
  return {RECORD: serialized}


class InstructionTask(LMCorpusTask):
  """Next-token prediction on the responses of instructions and chats (see
  module doc).

  Args:
    train_files: Glob pattern of the train split's JSON-lines files (one
      example per line, module doc); it must match at least one file.
    eval_files: Glob pattern of the eval split's files, in the same format.
    tokenizer: 'bytes' (UTF-8 bytes), or the path of a run directory (its
      tokenizer/), a directory holding tokenizer.json or tokenizer.model, or
      such a file; a tokenizer_config.json beside it with a chat_template
      formats the conversations (else the default template).
    vocab_size: Number of token ids (>= 2), the model's vocabulary; a token id
      outside 0..vocab_size-1 is an error.
    seq_len: Model input length in tokens (>= 1); each row holds seq_len + 1
      tokens (inputs plus next-token labels).
    pack: True packs whole examples into each row (segment-aware attention);
      False gives each example a row of its own, padded.
    too_long: What becomes of an example longer than seq_len + 1 tokens: 'cut'
      keeps its first seq_len + 1 tokens, 'drop' leaves it out.
    seed: As lm_corpus.seed (the same stream reader).
    num_streams: As lm_corpus.num_streams (the same stream reader).
    shuffle_window: As lm_corpus.shuffle_window, counting examples.
  """

  settings_name = 'instruct'

  def __init__(self, *, train_files: str, eval_files: str, tokenizer: str, vocab_size: int,
               seq_len: int = 128, pack: bool = True, too_long: str = 'cut',
               seed: int = 1234, num_streams: int = 0, shuffle_window: int = 256):
    at_least(dict(vocab_size=vocab_size, seq_len=seq_len), 'instruct', vocab_size=2,
             seq_len=1)
    if too_long not in TOO_LONG:
      raise ConfigError(f'instruct.too_long is {too_long!r}', where='instruct.too_long',
                        fix=f'use one of {TOO_LONG}')
    self.patterns = {'train': train_files, 'eval': eval_files}
    self.checked: dict[str, str] = {}  # split: what check_data found, for describe
    self.tokenizer, directory = find_tokenizer(tokenizer)
    self.template = find_template(directory)
    self.vocab_size, self.seq_len, self.pack, self.seed = vocab_size, seq_len, pack, seed
    self.too_long, self.num_streams, self.shuffle_window = too_long, num_streams, shuffle_window

  _parse = staticmethod(_parse)

  def check_data(self, splits=SPLITS):
    """Reads and checks every line of the splits' files (module doc)."""
    for split in splits:
      files = self.split_files(split)
      examples = sum(check_example_files(files).values())
      if not examples:
        raise ConfigError(f'the {split} files {files} hold no examples',
                          where=f'instruct.{split}_files', fix='write examples into them')
      self.checked[split] = f'{len(files)} file(s) ({examples} examples) '

  def _packer(self, stream, *, used):
    return ExamplePacker(stream, length=self.seq_len + 1, pack=self.pack,
                         vocab_size=self.vocab_size, used=used, too_long=self.too_long,
                         tokenizer=self.tokenizer, template=self.template)

  def _record_format(self):
    return {'records': numbered_lines, 'count': count_lines}

  def loss_and_metrics(self, outputs, batch):
    mask = tf.logical_and(target_mask(batch['segments']), batch['loss_mask'][:, 1:] > 0)
    loss, accuracy = next_token_loss(outputs, batch['tokens'], mask)
    return loss, {'accuracy': accuracy, 'tokens_trained': tf.reduce_sum(tf.cast(mask, tf.float32))}

  def trained_targets(self, batch):
    """Targets in their input's example whose loss mask is on: the mask of
    `loss_and_metrics`, on a host batch."""
    segments = np.asarray(batch['segments'])
    same = (segments[:, :-1] == segments[:, 1:]) & (segments[:, 1:] > 0)
    return int(np.count_nonzero(same & (np.asarray(batch['loss_mask'])[:, 1:] > 0)))

  def untrained_reason(self, reader):
    counts = example_counts(reader)
    longest = max((source.longest for source in reader.sources.values()), default=0)
    setting = f'{self.settings_name}.seq_len'
    why = (f'{counts["cut"]} of the {counts["examples"]} example(s) read so far were longer '
           f'than a row ({setting} = {self.seq_len}: {self.seq_len + 1} tokens) and cut there, '
           f'losing what of their answers lay beyond ({counts["dropped"]} dropped)')
    fix = (f'set {setting} >= {max(longest - 1, self.seq_len + 1)} (the longest example read '
           f'is {longest} tokens), or shorten the prompts')
    return why, setting, fix

  def describe(self) -> str:
    counts = ', '.join(f'{split} {self.checked.get(split, "")}{pattern}'
                       for split, pattern in self.patterns.items())
    packing = 'packed' if self.pack else 'one example per row'
    return (f'instructions, {self.template.describe()}, {self.tokenizer.describe()}, vocab '
            f'{self.vocab_size}, seq_len {self.seq_len}, {packing}, too long: '
            f'{self.too_long}: {counts}')
