"""Deterministic language-modelling tasks: a learnable synthetic chain and bytes.

Every batch is a pure function of (seed, split, step), so a resumed run sees
exactly the batches it would have seen, and the data position to checkpoint is
just the step number.

    task = MarkovTask(vocab_size=64, seq_len=64, branching=4, seed=1)
    task.batch(step=0, batch_size=8).shape    # (8, 65): inputs + next-token labels
    task.entropy_floor()                       # best achievable loss, in nats

Both are `layout_core.tasks.Task`s: a batch is `{'tokens': [B, T + 1]}`, the
model is called on `tokens[:, :-1]` and the loss is the cross entropy of its
logits against `tokens[:, 1:]` (plus next-token accuracy as a metric).

`MarkovTask` samples from a fixed random Markov chain in which each token has
only `branching` possible successors, so a model can drive the loss from
ln(vocab_size) down to the chain's entropy rate. `TextFileTask` serves random
byte windows of a file (last 10% held out for evaluation).
"""

from __future__ import annotations

import math
import os
from typing import Iterator

import numpy as np

from layout_core.errors import ConfigError
from layout_core.lazy import tf
from layout_core.fields import at_least, check_arguments
from layout_core.tasks import Task, accuracy, softmax_cross_entropy, split_rng
from layout_core.tasks.base import SPLITS
from layout_core.tasks.streams import DataIterator, without_autotune


class LMTask(Task):
  """Next-token prediction on token windows: the Task interface for LMs."""

  vocab_size: int
  seq_len: int

  @property
  def tokens_per_example(self) -> int:  # type: ignore[override]
    return self.seq_len

  def features(self, *, split, step, batch_size):
    return {'tokens': self.batch(step=step, batch_size=batch_size, split=split)}

  def model_inputs(self, batch):
    return (batch['tokens'][:, :-1],)

  def loss_and_metrics(self, outputs, batch):
    labels = batch['tokens'][:, 1:]
    return softmax_cross_entropy(outputs, labels), {'accuracy': accuracy(outputs, labels)}

  def input_specs(self, batch_size):
    return (((batch_size, self.seq_len), 'int32'),)

  def batch(self, *, step: int, batch_size: int, split: str = 'train') -> np.ndarray:
    """int32 [batch_size, seq_len + 1] token ids."""
    raise NotImplementedError

  def dataset(self, *, start_step: int, batch_size: int,
              split: str = 'train') -> tf.data.Dataset:
    """Batches for steps start_step, start_step + 1, ... (prefetched)."""
    def make(step):
      return self.batch(step=int(step), batch_size=batch_size, split=split)
    ds = tf.data.Dataset.range(start_step, 2**62)
    ds = ds.map(lambda s: tf.numpy_function(make, [s], tf.int32),
                num_parallel_calls=1, deterministic=True)
    return without_autotune(ds.prefetch(2))

  def iterate(self, *, start_step: int, batch_size: int,
              split: str = 'train') -> Iterator[dict[str, np.ndarray]]:
    """`features` for consecutive steps, made ahead on a tf.data thread."""
    for value in DataIterator(self.dataset(start_step=start_step, batch_size=batch_size,
                                           split=split).as_numpy_iterator()):
      yield {'tokens': value}

  def _rng(self, seed: int, split: str, step: int) -> np.random.Generator:
    return split_rng(seed, split, step)


class MarkovTask(LMTask):
  """Sequences from a sparse random Markov chain (see module docstring).

  Args:
    vocab_size: Number of token ids of the chain (tokens are 0..vocab_size-1);
      the uniform loss is ln(vocab_size).
    seq_len: Model input length in tokens; each row holds seq_len + 1 tokens
      (inputs plus next-token labels).
    branching: Possible successors of each token, in [1, vocab_size]; fewer
      make the chain more predictable (a lower entropy floor).
    seed: Seeds the chain (successors and their probabilities) and every batch,
      a pure function of (seed, split, step).
  """

  def __init__(self, *, vocab_size: int = 64, seq_len: int = 64,
               branching: int = 4, seed: int = 1234):
    if not 1 <= branching <= vocab_size:
      raise ConfigError(f'data.branching={branching} must be in [1, vocab_size={vocab_size}]',
                        where='data.branching', fix=f'use 1..{vocab_size}')
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    chain = np.random.default_rng([seed, 7])
    self.successors = np.stack([chain.choice(vocab_size, branching, replace=False)
                                for _ in range(vocab_size)]).astype(np.int32)
    probs = chain.dirichlet(np.ones(branching), size=vocab_size)
    self.probs = probs
    self.cumulative = np.cumsum(probs, axis=1)
    self.cumulative[:, -1] = 1.0

  def batch(self, *, step, batch_size, split='train'):
    rng = self._rng(self.seed, split, step)
    tokens = np.empty((batch_size, self.seq_len + 1), np.int32)
    tokens[:, 0] = rng.integers(0, self.vocab_size, batch_size)
    draws = rng.random((batch_size, self.seq_len))
    for t in range(self.seq_len):
      current = tokens[:, t]
      choice = (draws[:, t, None] > self.cumulative[current]).sum(axis=1)
      tokens[:, t + 1] = self.successors[current, choice]
    return tokens

  def entropy_floor(self) -> float:
    """Entropy rate of the chain (nats/token): the best achievable eval loss."""
    # Power iteration on the sparse chain (each token has `branching`
    # successors): a dense vocab x vocab matrix took 8 GB and minutes at a
    # published model's 32k vocabulary (launch.import_hf's run).
    successors = self.successors.ravel()
    stationary = np.full(self.vocab_size, 1.0 / self.vocab_size)
    for _ in range(1000):
      stationary = np.bincount(successors, weights=(stationary[:, None] * self.probs).ravel(),
                               minlength=self.vocab_size)
    row_entropy = -(self.probs * np.log(np.maximum(self.probs, 1e-30))).sum(axis=1)
    return float(stationary @ row_entropy)

  def describe(self) -> str:
    return (f'Markov chain, vocab {self.vocab_size}, branching '
            f'{self.successors.shape[1]}: uniform loss {math.log(self.vocab_size):.3f}, '
            f'best possible {self.entropy_floor():.3f} nats/token')


class TextFileTask(LMTask):
  """Random byte windows of a text file; vocab 256; last 10% held out.

  Args:
    path: Path of an existing file whose bytes are the tokens: the first 90% is
      the train split, the last 10% the eval split, each at least seq_len + 2
      bytes long.
    seq_len: Model input length in bytes; each row is a window of seq_len + 1
      bytes (inputs plus next-byte labels).
    seed: Seeds the window starts of every batch, a pure function of (seed,
      split, step).
  """

  def __init__(self, *, path: str, seq_len: int = 64, seed: int = 1234):
    self.vocab_size, self.seq_len, self.seed, self.path = 256, seq_len, seed, path
    self._parts: dict[str, np.ndarray] | None = None  # read when first needed

  def check_data(self, splits=SPLITS):
    """Reads the file (training and evaluation do; decode and export never
    need it)."""
    del splits
    self._read()

  @property
  def parts(self) -> dict[str, np.ndarray]:
    """{'train': the first 90% of the file's bytes, 'eval': the rest}."""
    return self._parts if self._parts is not None else self._read()

  def _read(self) -> dict[str, np.ndarray]:
    path, seq_len = self.path, self.seq_len
    if not os.path.isfile(path):
      raise ConfigError(f'data.text_file {path!r} does not exist', where='data.text_file',
                        fix='give the path of a readable text file')
    with open(path, 'rb') as f:
      data = np.frombuffer(f.read(), dtype=np.uint8)
    cut = int(len(data) * 0.9)
    parts = {'train': data[:cut], 'eval': data[cut:]}
    for split, part in parts.items():
      if len(part) < seq_len + 2:
        raise ConfigError(
            f'data.text_file {path!r} has {len(data)} bytes; its {split} part '
            f'({len(part)} bytes) is shorter than seq_len + 2 = {seq_len + 2}',
            fix='use a longer file or a smaller data.seq_len')
    self._parts = parts
    return parts

  def batch(self, *, step, batch_size, split='train'):
    part = self.parts[split]
    starts = self._rng(self.seed, split, step).integers(
        0, len(part) - self.seq_len - 1, batch_size)
    return np.stack([part[s:s + self.seq_len + 1] for s in starts]).astype(np.int32)

  def describe(self) -> str:
    if self._parts is None:  # not read: a plan that reads no data (decode, export)
      return f'bytes of {self.path}'
    return f'bytes of {self.path} ({sum(map(len, self._parts.values())):,} bytes)'


def make_task(*, task: Task | None = None, text_file: str | None = None,
              vocab_size: int = 64, seq_len: int = 64, branching: int = 4,
              seed: int = 1234) -> Task:
  """The run's task: `task` when given (any `Task`, e.g. a TFRecordTask or
  the user's own), else bytes of `text_file`, else the Markov chain.

  Args:
    task: A `Task` to train on, e.g. @lm_corpus(), @tfrecord_task() or the user's
      own; when set, the other data parameters are unused and text_file must not
      be set. None means a built-in LM task.
    text_file: Path of a text file to train on its bytes (vocabulary 256, the
      last 10% held out for evaluation); None or empty means the Markov chain.
    vocab_size: Number of token ids of the Markov chain (>= 2); unused with
      text_file (always 256) or task.
    seq_len: Model input length in tokens (>= 1); each row holds seq_len + 1
      tokens (inputs plus next-token labels); unused with task.
    branching: Possible successors of each token in the Markov chain, in [1,
      vocab_size]; unused with text_file or task.
    seed: Data seed (>= 0): every batch is a pure function of (seed, split,
      step), and it also draws the Markov chain; unused with task.
  """
  if task is not None:
    if text_file:
      raise ConfigError('both data.task and data.text_file are set',
                        fix='keep one: data.task replaces the built-in LM tasks')
    if not isinstance(task, Task):
      raise ConfigError(f'data.task is a {type(task).__name__}, not a layout_core Task',
                        where='data.task',
                        fix='subclass layout_core.tasks.Task (see docs/own-model.md, "A task")')
    return task
  check_arguments(make_task, name='data', values=locals())
  at_least(locals(), 'data', vocab_size=2, seq_len=1, branching=1, seed=0)
  if text_file:
    return TextFileTask(path=text_file, seq_len=seq_len, seed=seed)
  return MarkovTask(vocab_size=vocab_size, seq_len=seq_len, branching=branching,
                    seed=seed)
