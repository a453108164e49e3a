"""A trained model's evaluation: the training loop's own, run once, and its record.

    trainer = ...                       # a Trainer with the checkpoint's values in it
    evaluation = evaluate(trainer)      # train.eval_batches held-out batches
    evaluation.loss, evaluation.metrics['accuracy'], evaluation.perplexity
    path = write_evaluation(f'{model_dir}/eval_heldout', evaluation,
                            about={'step': 300, 'checkpoint': prefix})
    # eval_heldout/metrics.json, and eval/loss, eval/accuracy at step 300 in
    # eval_heldout/events.out.tfevents.*

The numbers are `Trainer.evaluate`'s, the function the training loop runs
every `train.eval_every` steps (`layout_core.train.loop`): the mean over the
first `train.eval_batches` batches of the task's eval split of the engine's
`evaluate` (the task's loss and metrics, no dropout). So a checkpoint
evaluated on any mesh gives the loss the run logged at that step, up to the
float rounding of another reduction order.

How many batches: `train.eval_batches` of the trainer's config (a caller
replaces it to evaluate more). `one_pass_batches` counts the batches in
which a streamed eval split (TFRecord files, a token corpus) reads every
record at least once; a task whose batches are a function of the step (the
Markov and text-file tasks) has no end, and is a ConfigError there.

`write_evaluation` writes into its own directory only: TensorBoard scalars
under the loop's `eval/*` tags at the checkpoint's step (evaluating several
checkpoints into one directory draws a curve), and `metrics.json` written
whole or not at all (`layout_core.durable`), the newest evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Mapping

from layout_core.checkpoint.files import checkpoint_dirs
from layout_core.durable import write_atomically
from layout_core.errors import ConfigError
from layout_core.tasks import Task
from layout_core.tasks.streams import FILES_KEY
from layout_core.train.loop import Trainer
from layout_core.train.summaries import SummaryWriter

METRICS_FILE = 'metrics.json'
# Keys of metrics.json that are not the task's metrics (those are under 'metrics').
RECORD_KEYS = ('loss', 'perplexity', 'metrics', 'eval_batches', 'batch_size', 'examples',
               'tokens', 'target_tokens')


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """One evaluation's numbers."""
  loss: float                  # the task's loss, the mean over the batches
  metrics: dict[str, float]    # the task's other metrics (accuracy, ...), as eval/<name>
  batches: int                 # eval batches of `batch_size` rows
  batch_size: int              # the global batch (train.batch_size)
  tokens_per_example: int      # positions per row (1: not a sequence task)

  @property
  def examples(self) -> int:
    return self.batches * self.batch_size

  @property
  def tokens(self) -> int:
    """Positions evaluated: examples x the task's tokens per example."""
    return self.examples * self.tokens_per_example

  @property
  def perplexity(self) -> float | None:
    """exp(loss) for a language model (the loss is nats per token), else None."""
    if self.tokens_per_example <= 1:
      return None
    return math.exp(self.loss) if self.loss < 700 else math.inf

  def scalars(self) -> dict[str, float]:
    """The training loop's eval tags: eval/loss and eval/<metric>."""
    return {'eval/loss': self.loss, **{f'eval/{n}': v for n, v in self.metrics.items()}}

  def record(self) -> dict[str, Any]:
    """metrics.json's numbers (`RECORD_KEYS`)."""
    record = {'loss': self.loss, 'perplexity': self.perplexity, 'metrics': dict(self.metrics),
              'eval_batches': self.batches, 'batch_size': self.batch_size,
              'examples': self.examples, 'tokens': self.tokens}
    if 'target_fraction' in self.metrics:  # a packed corpus: padding is no target
      record['target_tokens'] = round(self.metrics['target_fraction'] * self.tokens)
    return record


def evaluate(trainer: Trainer) -> Evaluation:
  """The training loop's evaluation (`Trainer.evaluate`) of the trainer's
  current values, over `trainer.config.eval_batches` batches."""
  loss, metrics = trainer.evaluate()
  return Evaluation(loss=loss, metrics=dict(metrics), batches=trainer.config.eval_batches,
                    batch_size=trainer.config.batch_size,
                    tokens_per_example=trainer.task.tokens_per_example)


def one_pass_batches(task: Task, *, batch_size: int, limit: int = 100_000) -> int:
  """The fewest eval batches in which a streamed eval split reads every
  record at least once: until every stream has started its second epoch
  (streams that end sooner fill their rows from their next epoch, so a few
  records count twice). ConfigError for a task with no end (its batches a
  function of the step) or one longer than `limit` batches."""
  reader = task.reader(split='eval', batch_size=batch_size)
  for count in range(1, limit + 1):
    next(reader)
    state = reader.state()
    if state is None:
      raise ConfigError(
          f'the eval split of {task.describe()} has no end: its batches are a function '
          'of the step', where='--eval_batches=all',
          fix='give a number of batches (--eval_batches=N; default train.eval_batches)')
    positions = [position for key, position in state.items() if key != FILES_KEY]
    if all(position[0] >= 1 for position in positions):
      return count
  raise ConfigError(f'the eval split of {task.describe()} takes more than {limit} batches of '
                    f'{batch_size} to read once', where='--eval_batches=all',
                    fix='give a number of batches (--eval_batches=N)')


def write_evaluation(directory: str, evaluation: Evaluation, *,
                     about: Mapping[str, Any]) -> str:
  """Writes `evaluation` into `directory` (created): TensorBoard scalars at
  step `about['step']` under the loop's eval tags, and metrics.json (`about`,
  e.g. step, checkpoint, mesh, then the numbers). Returns metrics.json's path."""
  if 'step' not in about:
    raise ValueError('about needs the step the checkpoint was saved at')
  overlap = sorted(set(about) & set(RECORD_KEYS))
  if overlap:
    raise ValueError(f'about must not set {overlap}: they are the evaluation\'s')
  os.makedirs(directory, exist_ok=True)
  writer = SummaryWriter(directory)
  try:
    writer.scalars(step=int(about['step']), values=evaluation.scalars())
  finally:
    writer.close()
  path = os.path.join(directory, METRICS_FILE)
  document = {**about, **evaluation.record()}
  write_atomically(path, (json.dumps(document, indent=1, allow_nan=True) + '\n').encode())
  return path


def read_record(directory: str) -> dict[str, Any] | None:
  """metrics.json of `directory`, or None when there is none or it is unreadable."""
  try:
    with open(os.path.join(directory, METRICS_FILE)) as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.-]*')


def output_directory(*, name: str, output_dir: str | None, model_dir: str | None,
                     checkpoint: str | None) -> str:
  """`<output_dir>/eval_<name>`: output_dir defaults to model_dir, or to the
  model_dir holding `checkpoint` (`<model_dir>/checkpoints/ckpt-N`).
  ConfigError for a name that is no plain file name, for no directory to
  write to, and for a place inside a checkpoints directory (never written
  by an evaluation)."""
  if not _NAME.fullmatch(name):
    raise ConfigError(f'--name {name!r} is not a plain name', where='--name',
                      fix="use letters, digits, '_', '.' and '-' (e.g. --name=heldout)")
  base = output_dir or model_dir
  if not base and checkpoint and os.path.isdir(os.path.join(checkpoint, 'checkpoints')):
    base = checkpoint  # a model_dir given as the checkpoint
  if not base and checkpoint:
    ckpt_dir = os.path.dirname(os.path.abspath(checkpoint.rstrip('/')))
    if not os.path.basename(ckpt_dir).startswith('ckpt-'):
      ckpt_dir = os.path.abspath(checkpoint.rstrip('/'))  # a ckpt-N directory itself
    if os.path.basename(os.path.dirname(ckpt_dir)) == 'checkpoints':
      base = os.path.dirname(os.path.dirname(ckpt_dir))
  if not base:
    raise ConfigError(f'no directory to write eval_{name} into: the checkpoint '
                      f'{checkpoint!r} is not in a model_dir\'s checkpoints/',
                      where='--output_dir', fix='add --output_dir=<a directory>')
  directory = os.path.abspath(os.path.join(base, f'eval_{name}'))
  own = os.path.abspath(os.path.join(model_dir, 'checkpoints')) if model_dir else None
  path = directory
  while os.path.dirname(path) != path:
    holder = (path == own or checkpoint_dirs(path) or (
        re.fullmatch(r'(tmp-)?ckpt-\d+', os.path.basename(path))
        and os.path.basename(os.path.dirname(path)) == 'checkpoints'))
    if holder:
      raise ConfigError(f'{directory} is inside the checkpoint directory {path}',
                        where='--output_dir', fix='give the model_dir or another directory: '
                        'an evaluation never writes among the checkpoints')
    path = os.path.dirname(path)
  existing = directory
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise ConfigError(f'cannot write {directory}: {existing} is not a writable directory',
                      where='--output_dir', fix='give a directory you can write to')
  return directory
