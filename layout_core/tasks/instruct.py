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

The text of a conversation comes from a chat template
(`layout_core.tasks.chat`): the tokenizer directory's chat template
(`chat_template.jinja`, else the `chat_template` of `tokenizer_config.json`,
else `chat_template.json`), rendered as `transformers` renders it, else the
default template, each turn as

    <|system|>\\n{content}<|end|>\\n      (and <|user|> alike)
    <|assistant|>\\n{content}<|end|>\\n

The whole text is tokenized as `apply_chat_template(messages, tokenize=True)`
tokenizes it (special tokens' text as their ids, no BOS added). Only the
assistant's tokens are trained: `loss_mask` is 1 on the tokens of each
assistant turn's content and the end of its turn (`{content}<|end|>` above,
`{content}<|eot_id|>` in Llama 3's template, or what a template's
`{% generation %}` blocks render), 0 on everything else.

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

import os

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.fields import at_least
from layout_core.tasks import tokenizer as tokens_lib
from layout_core.tasks.chat import (DefaultTemplate, JinjaTemplate, chat_prompt,  # noqa: F401
                                    find_template, tokenize)
from layout_core.lazy import tf
from layout_core.tasks import streams
from layout_core.tasks.instruct_files import (Messages, check_example_files,  # noqa: F401
                                             count_lines, numbered_lines, parse_example)
from layout_core.tasks.base import SPLITS
from layout_core.tasks.corpus import LMCorpusTask, Packer, next_token_loss, target_mask
from layout_core.tasks.objective import Total

TOO_LONG = ('cut', 'drop')
RECORD = 'record'  # a stream's record: 'path\nline number\nline text'


# -- chat templates (layout_core.tasks.chat) ---------------------------------------
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
    ids, mask = tokenize(self.template.render_trained(messages, where=where), self.tokenizer)
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
                 self.stream.stream_id, self._epoch, self.examples, self.cut, self.length,
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
      such a file; a chat template beside it (chat_template.jinja, or the
      chat_template of tokenizer_config.json) formats the conversations (else
      the default template).
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
    self.tokenizer, self.tokenizer_dir = find_tokenizer(tokenizer)
    self.template = find_template(self.tokenizer_dir)
    self.vocab_size, self.seq_len, self.pack, self.seed = vocab_size, seq_len, pack, seed
    self.too_long, self.num_streams, self.shuffle_window = too_long, num_streams, shuffle_window

  _parse = staticmethod(_parse)
  # What one line of the files holds: its parser (a ConfigError naming
  # file:line) and its name in messages.
  parse_line = staticmethod(parse_example)
  line_holds = 'examples'

  def check_data(self, splits=SPLITS):
    """Reads and checks every line of the splits' files (module doc)."""
    for split in splits:
      files = self.split_files(split)
      lines = sum(check_example_files(files, parse=self.parse_line).values())
      if not lines:
        raise ConfigError(f'the {split} files {files} hold no {self.line_holds}',
                          where=f'{self.settings_name}.{split}_files',
                          fix=f'write {self.line_holds} into them')
      self.checked[split] = f'{len(files)} file(s) ({lines} {self.line_holds}) '

  def _packer(self, stream, *, used):
    return ExamplePacker(stream, length=self.seq_len + 1, pack=self.pack,
                         vocab_size=self.vocab_size, used=used, too_long=self.too_long,
                         tokenizer=self.tokenizer, template=self.template)

  def _record_format(self):
    return {'records': numbered_lines, 'count': count_lines}

  def loss_and_metrics(self, outputs, batch):
    mask = tf.logical_and(target_mask(batch['segments']), batch['loss_mask'][:, 1:] > 0)
    loss, accuracy = next_token_loss(outputs, batch['tokens'], mask)
    return loss, {'accuracy': accuracy, 'tokens_trained': Total(loss.count)}

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
