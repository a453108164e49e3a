"""Greedy continuations of held-out prompts while training (`train.sample_every`).

    check_text_samples(config=train, params=params, task=task, pipelined=False)  # config time
    samples = text_samples_for(config=train, params=params, task=task)           # None when off
    markdown = samples(engine.variables)   # every sample_every steps: TensorBoard's samples/text

The prompts are the first `train.sample_prompts` rows of the task's eval
split at step 0, cut to their first half (seq_len // 2 tokens), the same
every time, so the Text tab shows one prompt's continuation change as the
model trains. Each gets `train.sample_tokens` new tokens, greedy, with the
cached decoder (`layout_core.infer.decode`) over the training variables
themselves, on the training mesh: nothing is copied. Text is decoded with the
task's tokenizer (`layout_core.infer.tokens`); a Markov run shows ids.

It runs with the plain engine only (the model as one program on the whole
mesh): a pipelined model's variables are stages or stacked cells, which
`check_text_samples` refuses at config time, as it does a Keras model and a
task that is not an LM's. Importing this module does not import TensorFlow.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from layout_core.errors import ConfigError
from layout_core.infer.decode import CachedLM, check_fits, lm_layers
from layout_core.infer.tokens import Tokenizer, tokenizer_for
from layout_core.layout.variables import to_numpy
from layout_core.train.config import TrainConfig

TAG = 'samples/text'


def prompt_length(task) -> int:
  """Tokens of each held-out prompt: the first half of a row."""
  return max(task.seq_len // 2, 1)


def check_text_samples(*, config: TrainConfig, params, task, pipelined: bool) -> None:
  """ConfigError naming train.sample_every when the run cannot write text
  samples (module doc); nothing when it is 0 (off)."""
  if not config.sample_every:
    return
  where = 'train.sample_every'
  off = 'or set train.sample_every = 0'
  if pipelined:
    raise ConfigError('train.sample_every decodes with the model as one program on the whole '
                      'mesh; a pipelined model runs as a schedule of stages', where=where,
                      fix=f'sample from a checkpoint with launch.decode instead, {off}')
  try:
    layers = lm_layers(params)
  except ConfigError as e:
    raise ConfigError(f'train.sample_every needs a Transformer LM: {str(e).split(" Where:")[0]}',
                      where=where, fix=f'use model.params = @transformer_lm(), {off}') from None
  if not hasattr(task, 'seq_len') or not hasattr(task, 'vocab_size'):
    raise ConfigError(f'train.sample_every needs an LM task (token rows); the task is '
                      f'{task.describe()}', where=where, fix=f'train on an LM task, {off}')
  try:
    check_fits(prompt_length=prompt_length(task), max_new_tokens=config.sample_tokens,
               max_len=layers.max_len, where='train.sample_tokens')
  except ConfigError as e:
    raise ConfigError(f'train.sample_tokens: held-out prompts of seq_len // 2 = '
                      f'{prompt_length(task)} tokens: {str(e).split(" Where:")[0]}',
                      where='train.sample_tokens',
                      fix=f'set train.sample_tokens to at most '
                          f'{max(layers.max_len - prompt_length(task) + 1, 1)}') from None


def text_samples_for(*, config: TrainConfig, params, task) -> 'TextSamples | None':
  """The run's `TextSamples` (None when train.sample_every is 0)."""
  if not config.sample_every:
    return None
  return TextSamples(params=params, task=task, num_prompts=config.sample_prompts,
                     max_new_tokens=config.sample_tokens, batch_axis=config.batch_axis)


class TextSamples:
  """Greedy continuations as markdown, called with the model's variables
  (path -> variable); the decoder is built at the first call and reads the
  variables' current values at every call."""

  def __init__(self, *, params, task, num_prompts: int, max_new_tokens: int,
               batch_axis: str, tokenizer: Tokenizer | None = None):
    self.params, self.task = params, task
    self.num_prompts, self.max_new_tokens, self.batch_axis = (num_prompts, max_new_tokens,
                                                              batch_axis)
    self._tokenizer = tokenizer
    self._lm: CachedLM | None = None
    self._prompts: np.ndarray | None = None

  def prompts(self) -> np.ndarray:
    """int32 [num_prompts, prompt length]: the held-out prompts (module doc)."""
    if self._prompts is None:
      rows = self.task.features(split='eval', step=0, batch_size=self.num_prompts)['tokens']
      self._prompts = np.asarray(rows)[:, :prompt_length(self.task)].astype(np.int32)
    return self._prompts

  def __call__(self, variables: Mapping[str, object]) -> str:
    if self._lm is None:
      self._lm = CachedLM(self.params, variables, batch_axis=self.batch_axis)
      if self._tokenizer is None:
        self._tokenizer = tokenizer_for(self.task)
    prompts = self.prompts()
    lengths = np.full([len(prompts)], prompts.shape[1], np.int32)
    new = to_numpy(self._lm.generate(prompts, lengths, max_new_tokens=self.max_new_tokens))
    return samples_markdown(prompts, new, self._tokenizer)


def samples_markdown(prompts: np.ndarray, continuations: np.ndarray,
                     tokenizer: Tokenizer) -> str:
  """A markdown table: each prompt and its continuation, as text."""
  lines = ['| # | prompt | continuation |', '|---|---|---|']
  for index, (prompt, new) in enumerate(zip(prompts, continuations)):
    new = [int(t) for t in new if t >= 0]
    lines.append(f'| {index} | {_cell(tokenizer.decode(prompt))} | '
                 f'{_cell(tokenizer.decode(new))} |')
  return '\n'.join(lines)


def _cell(text: str) -> str:
  """`text` inside one table cell: pipes escaped, line breaks shown as ⏎."""
  return (text.replace('\\', '\\\\').replace('|', '\\|').replace('\r', '')
          .replace('\n', ' ⏎ ') or ' ')
