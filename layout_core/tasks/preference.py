"""Preference tuning: pairs of answers to one prompt, a chosen and a rejected
one, trained with a DPO-family objective (`layout_core.tasks.dpo`).

    task = PreferenceTask(train_files='/data/prefs/train-*.jsonl',
                          eval_files='/data/prefs/eval-*.jsonl',
                          tokenizer='runs/sft', vocab_size=32000, seq_len=512)
    batch = task.features(split='train', step=0, batch_size=8)
    # rows 0, 2, 4, 6: the chosen answers of pairs 0..3; rows 1, 3, 5, 7: the rejected ones

Each line of the JSON-lines files is one pair, either

    {"prompt": "Add 2 and 3.", "chosen": "5", "rejected": "6"}
    {"chosen": [{"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": "5"}],
     "rejected": [{"role": "user", "content": "Add 2 and 3."},
                  {"role": "assistant", "content": "6"}]}

In the first form the prompt is a string (one user turn) or a list of
messages, and each answer a string (one assistant turn) or a list of
messages; in the second the messages both sides share from the start are
the prompt and the rest of each side is its answer (TRL's two forms). A
line is refused with a ConfigError naming `file:line` when it is not such a
pair, when an answer is empty or holds no assistant turn, when the chosen
and the rejected answer are the same, or when the two conversations share
no prefix.

Each side, prompt and answer, is rendered with the run's chat template and
tokenized exactly as the instruction task renders a conversation
(`layout_core.tasks.chat`); its loss mask is exactly the answer's tokens
(each of its assistant turns' content and end of turn; the prompt's own
assistant turns are not counted). A pair fills two rows, padded: the chosen
answer in an even row, the rejected one in the next, so every split of a
batch into an even number of rows keeps its pairs whole. A side longer than
a row is cut to its first seq_len + 1 tokens (`too_long='cut'`), or the
pair left out ('drop'), and counted as the instruction task counts them.
Reading is streamed and resumable as the instruction task's is.

The reference model (the policy before tuning) is the model with its LoRA
adapters off, computed in the same step: the engine runs the model once
more without adapters and without gradients, and hands each row's summed
answer log-probability to the loss as `reference_logps`
(`Task.needs_reference`, `layout_core.train.engine.ModelProgram`).
"""

from __future__ import annotations

import json

import numpy as np
from absl import logging

from layout_core.errors import ConfigError
from layout_core.fields import at_least
from layout_core.tasks import chat
from layout_core.tasks.corpus import Packer
from layout_core.tasks.dpo import DPOConfig, answer_logps, answer_tokens, preference_loss
from layout_core.tasks.instruct import RECORD, TOO_LONG, InstructionTask
from layout_core.tasks.instruct_files import Messages, check_messages, file_lines

SIDES = ('chosen', 'rejected')
_FEATURES = ('tokens', 'segments', 'positions', 'loss_mask')


class Pair:
  """A parsed line: the shared prompt and each side's answer (messages)."""

  def __init__(self, prompt: Messages, chosen: Messages, rejected: Messages):
    self.prompt, self.answers = prompt, {'chosen': chosen, 'rejected': rejected}


def parse_pair(text: str, *, path: str, line: int) -> Pair:
  """The pair on one line of a JSON-lines file (module doc); a ConfigError
  naming `path:line` when the line is not a pair."""
  where = f'{path}:{line}'
  expected = ('one JSON object per line: {"prompt": "...", "chosen": "...", "rejected": '
              '"..."} or {"chosen": [messages], "rejected": [messages]} sharing their '
              'first messages')

  def bad(what: str, fix: str = f'write {expected}') -> ConfigError:
    return ConfigError(f'{where} {what}', where=where, fix=fix)

  if not text.strip():
    raise bad('is empty')
  try:
    example = json.loads(text)
  except ValueError as e:
    raise bad(f'is not JSON ({e})') from None
  if not isinstance(example, dict) or not all(side in example for side in SIDES):
    keys = sorted(example) if isinstance(example, dict) else type(example).__name__
    raise bad(f'needs "chosen" and "rejected" (it has {keys})')

  def turns(value, name: str, role: str) -> Messages:
    if isinstance(value, str):
      return [{'role': role, 'content': value}]
    if not isinstance(value, list) or not value:
      raise bad(f'has a "{name}" that is neither a string nor a non-empty list of messages')
    return check_messages(value, lambda what: bad(f'"{name}": {what}'))

  if 'prompt' in example:
    prompt = turns(example['prompt'], 'prompt', 'user')
    answers = {side: turns(example[side], side, 'assistant') for side in SIDES}
  else:
    chosen, rejected = (turns(example[side], side, 'assistant') for side in SIDES)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
      shared += 1
    if not shared:
      raise bad('has "chosen" and "rejected" conversations that share no prefix, so there '
                'is no prompt they answer',
                fix='start both with the same prompt messages, or give "prompt" apart')
    prompt = chosen[:shared]
    answers = {'chosen': chosen[shared:], 'rejected': rejected[shared:]}
  for side, answer in answers.items():
    if not any(m['role'] == 'assistant' and m['content'].strip() for m in answer):
      raise bad(f'has an empty {side} answer (no assistant turn with content after the '
                'prompt)', fix=f'give the {side} answer some text, or leave the pair out')
  if answers['chosen'] == answers['rejected']:
    raise bad('has the same chosen and rejected answer: the pair prefers nothing',
              fix='leave the pair out, or correct one of its answers')
  return Pair(prompt, answers['chosen'], answers['rejected'])


def pair_arrays(sides, length: int) -> dict[str, np.ndarray]:
  """A pair's two sides as a pair-row: each feature [2, length], padded."""
  out = {name: np.zeros((len(SIDES), length), np.int32) for name in _FEATURES}
  for side, (ids, mask) in enumerate(sides):
    n = len(ids)
    out['tokens'][side, :n] = ids
    out['segments'][side, :n] = 1
    out['positions'][side, :n] = np.arange(n)
    out['loss_mask'][side, :n] = mask
  return out


class PairPacker(Packer):
  """One stream's pairs, each as a pair-row [2, length]: side 0 the chosen
  conversation, side 1 the rejected one, padded (module doc). Its position
  is the stream's (epoch, record) and 0: a pair is never taken in part.
  `references`: with a precomputed reference, {'path:line': [chosen,
  rejected]} (None: not read yet, zeros), given to each pair-row as its
  `reference_logps` [2]; absent (the default): no such feature."""

  def __init__(self, stream, *, length, vocab_size, too_long, tokenizer, template,
               references=False):
    self.tokenizer, self.template, self.references = tokenizer, template, references
    self.examples = self.longest = 0   # pairs read; tokens of the longest side read
    if stream is None:  # encoding lines only (`PreferenceTask.encoded_pairs`)
      self.stream, self.length, self.vocab_size, self.too_long = None, length, vocab_size, too_long
      self.cut = self.dropped = 0
      return
    super().__init__(stream, length=length, pack=False, vocab_size=vocab_size,
                     too_long=too_long)
    self._epoch = stream.position[0]

  def encode(self, pair: Pair, side: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of the prompt and one answer; the mask on the answer only."""
    messages = pair.prompt + pair.answers[side]
    rendered = self.template.render_trained(messages, where=where)
    asked = sum(m['role'] == 'assistant' for m in pair.prompt)  # the prompt's own replies
    ids, mask = chat.tokenize(chat.Rendered(rendered.text, rendered.trained[asked:]),
                              self.tokenizer)
    if not mask.any():
      raise ConfigError(f'the {side} answer at {where} has no tokens once formatted '
                        f'({self.template.describe()})', where=where,
                        fix='give the answer some content')
    if ids.max() >= self.vocab_size:
      raise ConfigError(f'the pair at {where} has token id {int(ids.max())}, outside the '
                        f'vocabulary 0..{self.vocab_size - 1} ({self.tokenizer.describe()})',
                        where='preference.vocab_size',
                        fix='set preference.vocab_size to the model\'s vocabulary (at least '
                            f'{self.tokenizer.vocab_size or int(ids.max()) + 1})')
    return ids.astype(np.int32), mask

  def read_pair(self) -> tuple[str, list[tuple[np.ndarray, np.ndarray]] | None]:
    """('path:line', the next pair's two sides cut to a row, or None when it
    is dropped)."""
    record = self.stream.take(1)[RECORD][0]
    if self.stream.position[0] != self._epoch:
      self.log_counts()
      self._epoch = self.stream.position[0]
    path, line, text = record.decode('utf-8').split('\n', 2)
    return f'{path}:{line}', self.encode_line(text, path=path, line=int(line))

  def encode_line(self, text: str, *, path: str, line: int):
    """A line's two sides, cut to a row; None when the pair is dropped."""
    where = f'{path}:{line}'
    pair = parse_pair(text, path=path, line=line)
    sides = [self.encode(pair, side, where) for side in SIDES]
    self.examples += 1
    longest = max(len(ids) for ids, _ in sides)
    self.longest = max(self.longest, longest)
    if longest > self.length:
      if self.too_long == 'drop':
        self.dropped += 1
        return None
      self.cut += 1
      sides = [(ids[:self.length], mask[:self.length]) for ids, mask in sides]
    return sides

  def block(self, rows: int) -> dict[str, np.ndarray]:
    out = {name: np.zeros((rows, len(SIDES), self.length), np.int32) for name in _FEATURES}
    if self.references is not False:
      out['reference_logps'] = np.zeros((rows, len(SIDES)), np.float32)
    for row in range(rows):
      key, sides = self.read_pair()
      while sides is None:
        key, sides = self.read_pair()
      for name, value in pair_arrays(sides, self.length).items():
        out[name][row] = value
      if self.references:
        if key not in self.references:
          raise ConfigError(f'the pair at {key} has no precomputed reference log-probabilities '
                            '(the file changed since they were computed)', where=key,
                            fix='train on the data the run started with, or start a new '
                                'model_dir')
        out['reference_logps'][row] = self.references[key]
    return out

  def log_counts(self) -> None:
    logging.info('preference: stream %d, epoch %d: %d pair(s) read since the reader opened, '
                 '%d with a side longer than a row (%d tokens) cut, %d dropped',
                 self.stream.stream_id, self._epoch, self.examples, self.cut, self.length,
                 self.dropped)


class PairedReader:
  """A reader of pair-rows seen as rows: each [B / 2, 2, ...] array as
  [B, ...], pair i in rows 2i (chosen) and 2i + 1 (rejected). Its state and
  streams are the pair reader's."""

  def __init__(self, pairs):
    self.pairs = pairs

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return {name: value.reshape((-1,) + value.shape[2:])
            for name, value in next(self.pairs).items()}

  def __getattr__(self, name):  # state(), describe(), sources
    return getattr(self.pairs, name)


class PreferenceTask(InstructionTask):
  """Pairs of a chosen and a rejected answer, trained with a DPO-family
  objective against the model without its adapters (see module doc).

  Args:
    train_files: Glob pattern of the train split's JSON-lines files (one pair
      per line, module doc); it must match at least one file.
    eval_files: Glob pattern of the eval split's files, in the same format.
    tokenizer: As instruct.tokenizer (and its chat template).
    vocab_size: Number of token ids (>= 2), the model's vocabulary.
    seq_len: Model input length in tokens (>= 1); each side of a pair, prompt
      and answer, fills a row of seq_len + 1 tokens.
    too_long: What becomes of a pair with a side longer than seq_len + 1
      tokens: 'cut' keeps the first seq_len + 1 tokens of each side, 'drop'
      leaves the pair out.
    objective: The loss, @dpo() (`layout_core.tasks.dpo.DPOConfig`); None:
      DPO's sigmoid loss with beta 0.1.
    seed: As instruct.seed.
    num_streams: As instruct.num_streams (streams of pairs).
    shuffle_window: As instruct.shuffle_window, counting pairs.
  """

  settings_name = 'preference'
  parse_line = staticmethod(parse_pair)
  line_holds = 'pairs'
  console_metrics = ('rewards/margins', 'rewards/accuracies')

  def __init__(self, *, train_files: str, eval_files: str, tokenizer: str, vocab_size: int,
               seq_len: int = 128, too_long: str = 'cut', objective: DPOConfig | None = None,
               seed: int = 1234, num_streams: int = 0, shuffle_window: int = 256):
    at_least(dict(vocab_size=vocab_size, seq_len=seq_len), 'preference', vocab_size=2,
             seq_len=1)
    if too_long not in TOO_LONG:
      raise ConfigError(f'preference.too_long is {too_long!r}', where='preference.too_long',
                        fix=f'use one of {TOO_LONG}')
    if objective is not None and not isinstance(objective, DPOConfig):
      raise ConfigError(f'preference.objective is {objective!r}', where='preference.objective',
                        fix='bind preference.objective = @dpo()')
    super().__init__(train_files=train_files, eval_files=eval_files, tokenizer=tokenizer,
                     vocab_size=vocab_size, seq_len=seq_len, pack=False, too_long=too_long,
                     seed=seed, num_streams=num_streams, shuffle_window=shuffle_window)
    self.objective = objective or DPOConfig()
    self.references: dict[str, list[float]] | None = None  # precomputed: attach_references

  @property
  def needs_reference(self) -> bool:  # type: ignore[override]
    """The engine runs the reference model, unless it is precomputed."""
    return not self.objective.precompute_reference

  @property
  def reference_pending(self) -> bool:
    """A precomputed reference not attached yet: the rows' reference_logps
    are zeros, fit for checking shapes, not for training."""
    return self.objective.precompute_reference and self.references is None

  def attach_references(self, pairs: dict[str, dict[str, list[float]]]) -> None:
    """The precomputed reference, {split: {'path:line': [chosen, rejected]}}
    (`layout_core.train.reference_logps`), for the readers made from now on."""
    self.references = {key: value for split in pairs.values() for key, value in split.items()}

  def encoded_pairs(self, split: str):
    """('path:line', pair-row arrays [2, seq_len + 1]) of every pair of the
    split's files, in file order, cut as training cuts them (dropped pairs
    left out)."""
    packer = self._packer(None, used=0)
    for path in self.split_files(split):
      for number, text in file_lines(path):
        sides = packer.encode_line(text, path=path, line=number)
        if sides is not None:
          yield f'{path}:{number}', pair_arrays(sides, packer.length)

  def _packer(self, stream, *, used):
    del used  # a pair is never taken in part
    return PairPacker(stream, length=self.seq_len + 1, vocab_size=self.vocab_size,
                      too_long=self.too_long, tokenizer=self.tokenizer, template=self.template,
                      references=self.references if self.objective.precompute_reference
                      else False)

  def reader(self, *, split, batch_size, start_step=0, rows=None, state=None):
    """Batches of `batch_size` rows, `batch_size / 2` pairs (module doc)."""
    if batch_size % 2:
      raise ConfigError(f'a batch of {batch_size} rows splits a pair of answers',
                        where='train.batch_size', fix='use an even train.batch_size')
    pair_rows = None if rows is None else np.unique(np.asarray(rows) // 2)
    return PairedReader(super().reader(split=split, batch_size=batch_size // 2,
                                       start_step=start_step, rows=pair_rows, state=state))

  def reference_features(self, reference_outputs, batch) -> dict:
    """What the loss needs of the reference model's logits: each row's
    summed answer log-probability."""
    return {'reference_logps': answer_logps(reference_outputs, batch)}

  def loss_and_metrics(self, outputs, batch):
    if 'reference_logps' not in batch:
      raise ConfigError('the preference loss has no reference log-probabilities: this '
                        'engine does not run the reference model', where='preference',
                        fix='train with LoRA (lora.rank > 0) on the whole-mesh engine')
    return preference_loss(answer_logps(outputs, batch), batch['reference_logps'],
                           tokens=answer_tokens(batch), objective=self.objective)

  def describe(self) -> str:
    counts = ', '.join(f'{split} {self.checked.get(split, "")}{pattern}'
                       for split, pattern in self.patterns.items())
    objective = self.objective
    loss = f'{objective.loss} loss, beta {objective.beta}' + (
        f', label smoothing {objective.label_smoothing}' if objective.label_smoothing else '')
    return (f'preference pairs ({loss}), {self.template.describe()}, '
            f'{self.tokenizer.describe()}, vocab {self.vocab_size}, seq_len {self.seq_len}, '
            f'too long: {self.too_long}: {counts}')

